//! The router's HTTP/1.1 client for engines: one POST per exchange over pooled
//! keep-alive connections, its response body read by the task that consumes
//! it.
//!
//! Why not hyper's client (which the router used before): a decode stream
//! holds its connection for the whole generation, and with 10k streams in
//! flight that connection is most of the router's memory. hyper's client gives
//! each connection a task of its own, a dispatch channel (a ~9 KiB block), an
//! 8 KiB write buffer and a read buffer, ~23 KiB in all, and relays each body
//! chunk from that task to the reader's. Here a connection in use is its
//! socket and one small read buffer, read directly by the stream's consumer,
//! and an idle one is only its socket (docs/bench.md, "scale", has the
//! measurements). The wire format is the narrow part of HTTP/1.1 an exchange
//! with an engine needs: a request with a `content-length` body, a response
//! with a length, chunked or close-delimited body (`framing.rs`); heads are
//! parsed by `httparse`.

mod framing;
mod head;
mod pool;

pub use framing::FramingError;
pub use head::HeadError;

use bytes::{Bytes, BytesMut};
use framing::Framing;
use pool::Pool;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No connection was made: the engine never saw the request. `refused`:
    /// nothing listens there.
    #[error("{message}")]
    Connect { refused: bool, message: String },
    #[error("invalid engine URL `{0}`: only http://host:port is supported")]
    Url(String),
    #[error(transparent)]
    Head(#[from] HeadError),
    #[error(transparent)]
    Framing(#[from] FramingError),
    #[error("connection closed before the response")]
    ClosedBeforeResponse,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The client: cheap to clone, connections shared.
#[derive(Clone)]
pub struct EngineClient {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    connect_timeout: Duration,
}

/// A response: its status, and its body to read.
pub struct Response {
    pub status: u16,
    pub body: Body,
}

/// A response body, read from the connection as it is asked for. Read to its
/// end, the connection goes back to the pool; dropped before, it is closed
/// (which is how a decode stream is cancelled at the engine).
pub struct Body {
    conn: Option<Conn>,
    framing: Framing,
    buf: BytesMut,
    reusable: bool,
}

struct Conn {
    stream: TcpStream,
    authority: Box<str>,
    client: EngineClient,
}

impl EngineClient {
    /// `max_idle_per_host` idle connections kept per engine for
    /// `idle_timeout`.
    pub fn new(
        connect_timeout: Duration,
        max_idle_per_host: usize,
        idle_timeout: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                pool: Pool::new(max_idle_per_host, idle_timeout),
                connect_timeout,
            }),
        }
    }

    /// Idle pooled connections (for tests).
    pub fn idle_connections(&self) -> usize {
        self.inner.pool.idle_count()
    }

    /// POSTs `body` (JSON) to `path` on the engine at `url`
    /// (`http://host:port`) with `headers`; the response once its head is
    /// read. The caller bounds the time.
    pub async fn post(
        &self,
        url: &str,
        path: &str,
        headers: &[(&'static str, &str)],
        body: &Bytes,
    ) -> Result<Response, ClientError> {
        let authority = url
            .strip_prefix("http://")
            .filter(|a| !a.is_empty() && !a.contains(['/', '?', '#', '@']))
            .ok_or_else(|| ClientError::Url(url.to_string()))?;
        let request_head = head::request(authority, path, headers, body.len())?;
        // A pooled connection the engine closed just as it was taken fails
        // before any answer: the request is sent again on a new connection.
        if let Some(stream) = self.inner.pool.take(authority) {
            match self.exchange(stream, authority, &request_head, body).await {
                Err(Exchange::Stale(_)) => {}
                Err(Exchange::Failed(err)) => return Err(err),
                Ok(response) => return Ok(response),
            }
        }
        let stream = self.connect(authority).await?;
        match self.exchange(stream, authority, &request_head, body).await {
            Ok(response) => Ok(response),
            Err(Exchange::Stale(Some(err))) => Err(err.into()),
            Err(Exchange::Stale(None)) => Err(ClientError::ClosedBeforeResponse),
            Err(Exchange::Failed(err)) => Err(err),
        }
    }

    /// Writes the request on `stream` and reads the response head.
    async fn exchange(
        &self,
        mut stream: TcpStream,
        authority: &str,
        request_head: &[u8],
        body: &Bytes,
    ) -> Result<Response, Exchange> {
        let mut request = bytes::Buf::chain(request_head, body.clone());
        stream
            .write_all_buf(&mut request)
            .await
            .map_err(Exchange::stale)?;
        let mut buf = BytesMut::new();
        let head = loop {
            if let Some(head) = head::response(&buf).map_err(Exchange::failed)? {
                let _ = buf.split_to(head.len);
                if (100..200).contains(&head.status) {
                    // An interim answer (100 Continue): the real one follows.
                    continue;
                }
                break head;
            }
            buf.reserve(1024);
            let read = stream.read_buf(&mut buf).await;
            match read {
                Ok(0) if buf.is_empty() => return Err(Exchange::Stale(None)),
                Ok(0) => return Err(Exchange::Failed(ClientError::ClosedBeforeResponse)),
                Ok(_) => {}
                Err(err) if buf.is_empty() => return Err(Exchange::stale(err)),
                Err(err) => return Err(Exchange::Failed(err.into())),
            }
        };
        Ok(Response {
            status: head.status,
            body: Body {
                conn: Some(Conn {
                    stream,
                    authority: authority.into(),
                    client: self.clone(),
                }),
                framing: head.framing,
                buf,
                reusable: head.reusable,
            },
        })
    }

    /// A new connection to `authority` (`host:port`, a name resolved here).
    async fn connect(&self, authority: &str) -> Result<TcpStream, ClientError> {
        let limit = self.inner.connect_timeout;
        let connect = async {
            let mut last = None;
            for addr in resolve(authority).await? {
                match TcpStream::connect(addr).await {
                    Ok(stream) => return Ok(stream),
                    Err(err) => last = Some(err),
                }
            }
            Err(last.unwrap_or_else(|| std::io::Error::other("no address")))
        };
        let stream = match tokio::time::timeout(limit, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => {
                return Err(ClientError::Connect {
                    refused: err.kind() == std::io::ErrorKind::ConnectionRefused,
                    message: format!("tcp connect error: {err}"),
                })
            }
            Err(_) => {
                return Err(ClientError::Connect {
                    refused: false,
                    message: format!("tcp connect timed out after {} ms", limit.as_millis()),
                })
            }
        };
        // Every token is its own small write; see `server.rs`.
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

/// An exchange's failure: `Stale` when the connection failed before any answer
/// came (on a pooled one: the engine had closed it), else why.
enum Exchange {
    Stale(Option<std::io::Error>),
    Failed(ClientError),
}

impl Exchange {
    fn stale(err: std::io::Error) -> Self {
        Exchange::Stale(Some(err))
    }

    fn failed(err: impl Into<ClientError>) -> Self {
        Exchange::Failed(err.into())
    }
}

/// The addresses of `authority` (`host:port`, `[v6]:port`).
async fn resolve(authority: &str) -> std::io::Result<Vec<SocketAddr>> {
    let (host, port) = authority
        .rsplit_once(':')
        .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
        .unwrap_or((authority, 80));
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    Ok(tokio::net::lookup_host((bare, port)).await?.collect())
}

impl Body {
    /// The next piece of the body; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, ClientError> {
        loop {
            if let Some(data) = self.framing.decode(&mut self.buf)? {
                return Ok(Some(data));
            }
            if self.framing.is_done() {
                self.finish();
                return Ok(None);
            }
            let Some(conn) = self.conn.as_mut() else {
                return Ok(None);
            };
            self.buf.reserve(self.framing.read_hint());
            if conn.stream.read_buf(&mut self.buf).await? == 0 {
                self.reusable = false;
                self.framing.eof()?;
            }
        }
    }

    /// The body as a stream of its pieces.
    pub fn into_stream(
        self,
    ) -> impl futures_util::Stream<Item = Result<Bytes, ClientError>> + Send {
        futures_util::stream::unfold(Some(self), |body| async move {
            let mut body = body?;
            match body.chunk().await {
                Ok(Some(data)) => Some((Ok(data), Some(body))),
                Ok(None) => None,
                Err(err) => Some((Err(err), None)),
            }
        })
    }

    /// At the body's end: the connection back to the pool, when it may carry
    /// another exchange.
    fn finish(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.reusable && self.buf.is_empty() {
            let pool = &conn.client.inner.pool;
            pool.put(&conn.authority, conn.stream);
        }
    }
}

#[cfg(test)]
mod tests;
