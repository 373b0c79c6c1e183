//! The seam between the request flow and the engines: a call answered whole
//! (`answer`: a prefill, `/render`, a pass-through route), a decode stream
//! opened (`decode`), a conversion between text and tokens (`convert`). The router talks HTTP through [`HttpUpstream`]; the session's
//! unit tests script an [`Upstream`] of their own, one failure cause at a time.
//!
//! Every wait here is bounded (the prefill call, a decode stream's response
//! headers) and so is every body read (a prefill answer up to
//! `max_upstream_body_bytes`, an error body up to [`MAX_ERROR_BODY`]).
//!
//! The engines are called with the router's own HTTP/1.1 client
//! (`engines::http`): a decode stream holds its connection for the whole
//! generation, and that client keeps a connection to a few hundred bytes of
//! state where hyper's took ~23 KiB (memory per in-flight stream,
//! docs/bench.md).

use crate::config::EngineArgs;
pub use crate::engines::http::Payload;
use crate::engines::http::{Body, ClientError, EngineClient, Response};
use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use std::time::Duration;

/// The body of a decode stream, as the engine sends it.
pub type ByteStream = BoxStream<'static, Result<Bytes, String>>;

/// Most bytes of an engine's error body the router reads (its message goes to
/// the client, bounded again).
pub const MAX_ERROR_BODY: usize = 64 * 1024;

/// Why a call got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// No connection was made: the engine never saw the request. `refused`
    /// when nothing listens there (the process is gone), as opposed to a
    /// connect timeout (a busy engine's full accept backlog).
    Connect { refused: bool, message: String },
    /// Sent, but no response headers within the time limit.
    NoHeaders(Duration),
    /// The request reached the engine and the connection failed after.
    Transport(String),
    /// The answer's body is larger than the router reads.
    TooLarge(usize),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Connect {
                refused: true,
                message,
            } => {
                write!(f, "connection refused: {message}")
            }
            CallError::Connect { message, .. } => write!(f, "cannot connect: {message}"),
            CallError::NoHeaders(after) => {
                write!(f, "no response within {} ms", after.as_millis())
            }
            CallError::Transport(message) => write!(f, "{message}"),
            CallError::TooLarge(limit) => write!(f, "answer larger than {limit} bytes"),
        }
    }
}

/// A whole answer (prefill, or an error status of a decode call).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Bytes,
}

/// What opening a decode stream gives.
pub enum Opened {
    /// A 2xx: the SSE stream.
    Stream(ByteStream),
    /// Another status, with (the start of) its body.
    Status(Reply),
}

/// One call to an engine.
#[derive(Debug, Clone)]
pub struct Call<'a> {
    pub url: &'a str,
    pub path: &'static str,
    pub request_id: &'a str,
    /// W3C trace context headers (`traceparent`, `tracestate`).
    pub trace: Vec<(&'static str, String)>,
    /// Pieces that share the client's body (see [`Payload`]).
    pub body: Payload,
}

/// The three kinds of call the router makes to an engine, named for what the
/// engine does with them.
pub trait Upstream: Send + Sync + 'static {
    /// The engine answers a call whole, within the engine limits
    /// (`--prefill-timeout`, `--max-upstream-body-bytes`): a prefill, a
    /// continuation's `/render`, a pass-through route.
    fn answer<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Reply, CallError>>;
    /// The engine opens a decode stream (the answer's headers).
    fn decode<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Opened, CallError>>;
    /// The engine converts between text and tokens (`/tokenize`,
    /// `/detokenize`, a continuation's derender): its whole answer, up to
    /// [`MAX_TOKENIZE_ANSWER`] bytes (the caller bounds the time).
    fn convert<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Reply, CallError>>;
}

/// Largest `/tokenize` answer read (a long prompt's ids as JSON).
pub const MAX_TOKENIZE_ANSWER: usize = 16 * 1024 * 1024;

/// Posts `request` to the tokenizer route `path` (`/tokenize`, `/detokenize`)
/// of the engine at `url` and reads its 2xx answer as `T`; `None` on any
/// failure (the caller bounds the time and falls back).
pub async fn ask_tokenizer<T: serde::de::DeserializeOwned>(
    upstream: &dyn Upstream,
    url: &str,
    path: &'static str,
    request: Payload,
) -> Option<T> {
    let call = Call {
        url,
        path,
        request_id: "",
        trace: Vec::new(),
        body: request,
    };
    let reply = upstream.convert(call).await.ok()?;
    if !(200..300).contains(&reply.status) {
        return None;
    }
    serde_json::from_slice(&reply.body).ok()
}

/// How long an idle pooled connection to an engine is kept: below the
/// keep-alive timeout of vLLM's server (uvicorn's 5 s), so that the router
/// seldom sends on a connection the engine is closing. Each idle connection
/// is a socket; after a burst they are given back within seconds
/// (reconnecting to an engine costs far less than a prefill).
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// The client [`HttpUpstream`] calls engines with.
#[cfg(test)]
pub fn engine_client(connect_timeout: Duration, max_idle_per_host: usize) -> EngineClient {
    EngineClient::new(connect_timeout, max_idle_per_host, POOL_IDLE_TIMEOUT)
}

/// The engines over HTTP.
pub struct HttpUpstream {
    client: EngineClient,
    /// Its time and size limits (`--prefill-timeout`,
    /// `--decode-open-timeout`, `--max-upstream-body-bytes`).
    limits: EngineArgs,
}

impl HttpUpstream {
    pub fn new(client: EngineClient, limits: EngineArgs) -> Self {
        Self { client, limits }
    }

    /// Sends `call`; its response's head.
    async fn send(&self, call: &Call<'_>) -> Result<Response, CallError> {
        let mut headers: Vec<(&'static str, &str)> = Vec::with_capacity(1 + call.trace.len());
        if !call.request_id.is_empty() {
            headers.push(("x-request-id", call.request_id));
        }
        headers.extend(
            call.trace
                .iter()
                .map(|(name, value)| (*name, value.as_str())),
        );
        self.client
            .post(call.url, call.path, &headers, &call.body)
            .await
            .map_err(call_error)
    }
}

impl Upstream for HttpUpstream {
    fn answer<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Reply, CallError>> {
        Box::pin(async move {
            let limit = self.limits.prefill_timeout;
            let call = async {
                let response = self.send(&call).await?;
                let status = response.status;
                let cap = if success(status) {
                    self.limits.max_upstream_body_bytes
                } else {
                    MAX_ERROR_BODY
                };
                let body = read_capped(response.body, cap, success(status)).await?;
                Ok(Reply { status, body })
            };
            tokio::time::timeout(limit, call)
                .await
                .unwrap_or(Err(CallError::NoHeaders(limit)))
        })
    }

    fn decode<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Opened, CallError>> {
        Box::pin(async move {
            let limit = self.limits.decode_open_timeout;
            let response = tokio::time::timeout(limit, self.send(&call))
                .await
                .map_err(|_| CallError::NoHeaders(limit))??;
            let status = response.status;
            if success(status) {
                let stream = response
                    .body
                    .into_stream()
                    .map(|r| r.map_err(|e| e.to_string()))
                    .boxed();
                return Ok(Opened::Stream(stream));
            }
            // The error body is read within the same limit: a decoder that
            // trickles it must not hold the request.
            let body =
                tokio::time::timeout(limit, read_capped(response.body, MAX_ERROR_BODY, false))
                    .await
                    .unwrap_or(Ok(Bytes::new()))
                    .unwrap_or_default();
            Ok(Opened::Status(Reply { status, body }))
        })
    }

    fn convert<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Reply, CallError>> {
        Box::pin(async move {
            let response = self.send(&call).await?;
            let status = response.status;
            let body = read_capped(response.body, MAX_TOKENIZE_ANSWER, success(status)).await?;
            Ok(Reply { status, body })
        })
    }
}

fn success(status: u16) -> bool {
    (200..300).contains(&status)
}

/// Reads at most `cap` bytes of a body; past it, an error when `strict` (the
/// body is needed whole), else what was read (an error message's start).
async fn read_capped(mut response: Body, cap: usize, strict: bool) -> Result<Bytes, CallError> {
    let mut body = BytesMut::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| CallError::Transport(e.to_string()))?
    {
        if body.len() + chunk.len() > cap {
            if strict {
                return Err(CallError::TooLarge(cap));
            }
            body.extend_from_slice(&chunk[..cap - body.len()]);
            break;
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// A client error as a [`CallError`]: what never reached the engine (no
/// connection, and whether it was refused; a request that could not be sent)
/// apart from failures after the request was sent.
fn call_error(err: ClientError) -> CallError {
    match err {
        ClientError::Connect { refused, message } => CallError::Connect { refused, message },
        err if err.not_sent() => CallError::Connect {
            refused: false,
            message: err.to_string(),
        },
        err => CallError::Transport(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// The router's engine client, with small limits.
    fn upstream() -> HttpUpstream {
        HttpUpstream::new(
            engine_client(Duration::from_secs(1), 8),
            EngineArgs {
                connect_timeout: Duration::from_secs(1),
                prefill_timeout: Duration::from_secs(5),
                decode_open_timeout: Duration::from_millis(300),
                first_token_timeout: Duration::from_secs(60),
                stall_timeout: Duration::from_secs(10),
                max_sse_event_bytes: 1024 * 1024,
                max_upstream_body_bytes: 1024,
            },
        )
    }

    fn call(url: &str) -> Call<'_> {
        Call {
            url,
            path: "/v1/completions",
            request_id: "r",
            trace: Vec::new(),
            body: Bytes::from_static(b"{}").into(),
        }
    }

    /// A server that reads a request and answers `answer` (then keeps the
    /// connection open); `None`: never answers.
    async fn server(answer: Option<Vec<u8>>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0; 4096];
            let _ = socket.read(&mut buf).await;
            if let Some(answer) = answer {
                let _ = socket.write_all(&answer).await;
            }
            std::future::pending::<()>().await;
        });
        url
    }

    #[tokio::test]
    async fn a_refused_connect_is_told_apart() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        drop(listener);
        match upstream().decode(call(&url)).await {
            Err(CallError::Connect { refused, .. }) => assert!(refused),
            other => panic!("not a refused connect: {:?}", other.err()),
        }
    }

    #[tokio::test]
    async fn a_decoder_without_response_headers_times_out() {
        let url = server(None).await;
        let opened = upstream().decode(call(&url)).await;
        assert!(matches!(opened, Err(CallError::NoHeaders(_))));
    }

    #[tokio::test]
    async fn error_bodies_and_prefill_answers_are_read_bounded() {
        let mut answer = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 1048576\r\n\r\n".to_vec();
        answer.extend(std::iter::repeat_n(b'x', 1 << 20));
        let url = server(Some(answer.clone())).await;
        match upstream().decode(call(&url)).await {
            Ok(Opened::Status(reply)) => {
                assert_eq!(reply.status, 400);
                assert_eq!(reply.body.len(), MAX_ERROR_BODY);
            }
            _ => panic!("expected the status"),
        }
        let mut ok = b"HTTP/1.1 200 OK\r\ncontent-length: 4096\r\n\r\n".to_vec();
        ok.extend(std::iter::repeat_n(b'{', 4096));
        let url = server(Some(ok)).await;
        let reply = upstream().answer(call(&url)).await;
        assert_eq!(reply.err(), Some(CallError::TooLarge(1024)));
    }

    #[tokio::test]
    async fn redirects_are_answers_not_followed() {
        let answer = b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://169.254.169.254/\r\ncontent-length: 0\r\n\r\n";
        let url = server(Some(answer.to_vec())).await;
        match upstream().decode(call(&url)).await {
            Ok(Opened::Status(reply)) => assert_eq!(reply.status, 307),
            _ => panic!("expected the redirect itself"),
        }
    }
}
