//! The router's HTTP/1.1 client for engines, the one every call to an engine
//! goes through (requests, health probes, model lists): one POST (or a
//! bodiless GET) per exchange over pooled keep-alive connections, its
//! response body read by the task that consumes it.
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
//! parsed by `httparse`. Idle connections are pooled per engine address in
//! the same pool the hold control client uses (`connex_transfer::net`).

mod framing;
mod head;
mod payload;

pub use framing::FramingError;
pub use head::HeadError;
pub use payload::Payload;

use crate::engines::addresses::UpstreamPolicy;
use bytes::{Bytes, BytesMut};
use connex_transfer::net::{IdlePool, KeyedLimit};
use framing::Framing;
use head::Method;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The engine never saw the request: no connection was made (`refused`:
    /// nothing listens there), or the request could not be written.
    #[error("{message}")]
    Connect { refused: bool, message: String },
    /// The request cannot be sent as asked (nothing reached the engine).
    #[error("invalid engine URL `{0}`: only http://host:port is supported")]
    Url(String),
    #[error(transparent)]
    Head(#[from] HeadError),
    #[error(transparent)]
    Framing(#[from] FramingError),
    /// The request was sent and the connection ended without an answer.
    #[error("connection closed before the response")]
    ClosedBeforeResponse,
    #[error("more than {MAX_INTERIM} interim (1xx) answers")]
    TooManyInterim,
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
}

impl ClientError {
    /// Whether the engine cannot have seen the request.
    pub fn not_sent(&self) -> bool {
        matches!(
            self,
            ClientError::Connect { .. }
                | ClientError::Url(_)
                | ClientError::Head(HeadError::RequestHeader(_))
        )
    }

    fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| ClientError::Io { what, source }
    }
}

/// Most interim (1xx) answers skipped before the real one.
const MAX_INTERIM: usize = 8;
/// Most connects in progress at once to one engine: a burst of requests
/// beyond it waits for a connect slot (or a connection given back) instead of
/// overflowing the engine's listen backlog, where a lost connect costs a 1 s
/// SYN retry and, past the connect timeout, a failed request.
pub const MAX_CONNECTING_PER_ENGINE: usize = 128;

/// The client: cheap to clone, connections shared.
#[derive(Clone)]
pub struct EngineClient {
    inner: Arc<ClientState>,
}

struct ClientState {
    pool: IdlePool,
    connecting: Arc<KeyedLimit>,
    connect_timeout: Duration,
    /// Checked at every connect: the addresses an engine's name resolves to
    /// then, not only when it registered (DNS rebinding). `None`: no policy
    /// (tests, tools).
    policy: Option<Arc<UpstreamPolicy>>,
    /// Cancelled when the client is dropped: the connects still running on
    /// their own tasks (see [`EngineClient::connect`]) end with it.
    stop: CancellationToken,
}

impl Drop for ClientState {
    fn drop(&mut self) {
        self.stop.cancel();
    }
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
    #[cfg(test)]
    pub fn new(
        connect_timeout: Duration,
        max_idle_per_host: usize,
        idle_timeout: Duration,
    ) -> Self {
        Self::with_policy(connect_timeout, max_idle_per_host, idle_timeout, None)
    }

    /// As [`EngineClient::new`], connecting only to addresses `policy`
    /// allows, resolved and checked at each connect.
    pub fn guarded(
        connect_timeout: Duration,
        max_idle_per_host: usize,
        idle_timeout: Duration,
        policy: Arc<UpstreamPolicy>,
    ) -> Self {
        Self::with_policy(
            connect_timeout,
            max_idle_per_host,
            idle_timeout,
            Some(policy),
        )
    }

    fn with_policy(
        connect_timeout: Duration,
        max_idle_per_host: usize,
        idle_timeout: Duration,
        policy: Option<Arc<UpstreamPolicy>>,
    ) -> Self {
        Self {
            inner: Arc::new(ClientState {
                pool: IdlePool::new(max_idle_per_host, idle_timeout),
                connecting: KeyedLimit::new(MAX_CONNECTING_PER_ENGINE),
                connect_timeout,
                policy,
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Idle pooled connections (for tests).
    #[cfg(test)]
    pub fn idle_connections(&self) -> usize {
        self.inner.pool.idle_count()
    }

    /// POSTs `body` (JSON, in its pieces) to `path` on the engine at `url`
    /// (`http://host:port`) with `headers` (lower-case names, never
    /// `host`, `content-length` or `content-type`); the response once its head
    /// is read. The caller bounds the time.
    pub async fn post(
        &self,
        url: &str,
        path: &str,
        headers: &[(&'static str, &str)],
        body: &Payload,
    ) -> Result<Response, ClientError> {
        self.send(Method::Post, url, path, headers, body).await
    }

    /// GETs `path` on the engine at `url` (probes, model lists), as
    /// [`EngineClient::post`] does; read its body to the end and the
    /// connection is pooled for the next call.
    pub async fn get(&self, url: &str, path: &str) -> Result<Response, ClientError> {
        self.send(Method::Get, url, path, &[], &Payload::new())
            .await
    }

    async fn send(
        &self,
        method: Method,
        url: &str,
        path: &str,
        headers: &[(&'static str, &str)],
        body: &Payload,
    ) -> Result<Response, ClientError> {
        let authority = url
            .strip_prefix("http://")
            .filter(|a| !a.is_empty() && a.bytes().all(is_authority_byte))
            .ok_or_else(|| ClientError::Url(url.to_string()))?;
        let request_head = head::request(method, authority, path, headers, body.len())?;
        // A reused connection (pooled, or given back by another request) that
        // the engine closed just as it was taken fails the write: the request
        // never reached it, and goes on a new connection. Once written it is
        // never sent again (a POST the engine may have acted on).
        if let Some(stream) = self.inner.pool.take(authority) {
            match self.exchange(stream, authority, &request_head, body).await {
                Err(Exchange::Unwritten(_)) => {}
                other => return other.map_err(Exchange::into_error),
            }
        }
        let (stream, reused) = self.connect(authority).await?;
        match self.exchange(stream, authority, &request_head, body).await {
            Err(Exchange::Unwritten(_)) if reused => {
                let stream = self.fresh(authority).await?;
                self.exchange(stream, authority, &request_head, body)
                    .await
                    .map_err(Exchange::into_error)
            }
            other => other.map_err(Exchange::into_error),
        }
    }

    /// Writes the request on `stream` and reads the response head.
    async fn exchange(
        &self,
        mut stream: TcpStream,
        authority: &str,
        request_head: &[u8],
        body: &Payload,
    ) -> Result<Response, Exchange> {
        let mut request = bytes::Buf::chain(request_head, body.reader());
        let mut buf = BytesMut::new();
        let written = stream.write_all_buf(&mut request).await;
        let sent_whole = written.is_ok();
        let head = match written {
            Ok(()) => read_head(&mut stream, &mut buf)
                .await
                .map_err(Exchange::Failed)?,
            // An engine may answer before it has read the whole request (a
            // 413) and close: its answer is what the caller needs.
            Err(err) => match read_head(&mut stream, &mut buf).await {
                Ok(head) => head,
                Err(_) if bytes::Buf::remaining(&request) == request_head.len() + body.len() => {
                    return Err(Exchange::Unwritten(err))
                }
                Err(_) => {
                    return Err(Exchange::Failed(ClientError::io("sending the request")(
                        err,
                    )))
                }
            },
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
                reusable: head.reusable && sent_whole,
            },
        })
    }

    /// A connection to `authority` (`host:port`, a name resolved here) for a
    /// request that found none idle, and whether it was used before: a new
    /// one, or one another request gives back meanwhile, whichever comes
    /// first. As in hyper's pool, a connect that loses the race still
    /// completes (on its own task, bounded by the connect timeout) and its
    /// connection is pooled: a burst grows the pool to the engine's
    /// concurrency instead of queueing behind it. That task holds no clone
    /// of the client, and ends when the client is dropped. Waiting for a connect slot
    /// or a connection given back is bounded by the caller (a queue behind a
    /// burst is not a dead engine).
    async fn connect(&self, authority: &str) -> Result<(TcpStream, bool), ClientError> {
        let mut given_back = GivenBack {
            rx: self.inner.pool.wait(authority),
            client: self,
            authority,
        };
        // One given back between the caller's look at the pool and the wait.
        if let Some(stream) = self.inner.pool.take(authority) {
            return Ok((stream, true));
        }
        let (tx, connected) = oneshot::channel();
        let inner: Weak<ClientState> = Arc::downgrade(&self.inner);
        let (connecting, timeout) = (self.inner.connecting.clone(), self.inner.connect_timeout);
        let (stop, addr) = (self.inner.stop.clone(), authority.to_string());
        let policy = self.inner.policy.clone();
        tokio::spawn(async move {
            let connect = async move {
                let mut tx = tx;
                let slot = tokio::select! {
                    slot = connecting.enter(&addr) => slot,
                    // Nobody waits for it any more: no connect.
                    () = tx.closed() => return,
                };
                let result = open(&addr, timeout, policy.as_deref()).await;
                drop(slot);
                if let Err(Ok(stream)) = tx.send(result) {
                    if let Some(inner) = inner.upgrade() {
                        inner.pool.put(&addr, stream);
                    }
                }
            };
            tokio::select! {
                () = connect => {}
                () = stop.cancelled() => {}
            }
        });
        tokio::select! {
            connected = connected => {
                let connected = connected.unwrap_or_else(|_| Err(std::io::Error::other("connect task ended")));
                Ok((connected.map_err(|err| self.connect_error(err))?, false))
            }
            Ok(stream) = &mut given_back.rx => Ok((stream, true)),
        }
    }

    /// A new connection to `authority`, after a connect slot.
    async fn fresh(&self, authority: &str) -> Result<TcpStream, ClientError> {
        let _slot = self.inner.connecting.enter(authority).await;
        open(
            authority,
            self.inner.connect_timeout,
            self.inner.policy.as_deref(),
        )
        .await
        .map_err(|err| self.connect_error(err))
    }

    fn connect_error(&self, err: std::io::Error) -> ClientError {
        let limit = self.inner.connect_timeout;
        if err.kind() == std::io::ErrorKind::TimedOut {
            return ClientError::Connect {
                refused: false,
                message: format!("tcp connect timed out after {} ms", limit.as_millis()),
            };
        }
        ClientError::Connect {
            refused: err.kind() == std::io::ErrorKind::ConnectionRefused,
            message: format!("tcp connect error: {err}"),
        }
    }
}

/// A new TCP connection to `authority` within the connect timeout, name
/// resolution included, each address within its share of what is left (a
/// black-holed first one must not take all of it). With a `policy`, only to
/// addresses it allows, as resolved now.
async fn open(
    authority: &str,
    connect_timeout: Duration,
    policy: Option<&UpstreamPolicy>,
) -> std::io::Result<TcpStream> {
    let deadline = tokio::time::Instant::now() + connect_timeout;
    let addrs = tokio::time::timeout_at(deadline, resolve(authority, policy))
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))?;
    let mut last = std::io::Error::other("no address");
    for (i, addr) in addrs.iter().enumerate() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let share = left / u32::try_from(addrs.len() - i).unwrap_or(u32::MAX);
        match tokio::time::timeout(share, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                // Every token is its own small write; see `server.rs`.
                stream.set_nodelay(true)?;
                crate::observe::metrics::engine_connection_opened(authority);
                return Ok(stream);
            }
            Ok(Err(err)) => last = err,
            Err(_) => last = std::io::ErrorKind::TimedOut.into(),
        }
    }
    Err(last)
}

/// The place of a request waiting for a connection given back. Dropped, it
/// gives up the place, and a connection handed over meanwhile (while the
/// request's own connect won, or the request was cancelled) goes back to the
/// pool instead of being closed.
struct GivenBack<'a> {
    rx: oneshot::Receiver<TcpStream>,
    client: &'a EngineClient,
    authority: &'a str,
}

impl Drop for GivenBack<'_> {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok(stream) = self.rx.try_recv() {
            self.client.inner.pool.put(self.authority, stream);
        }
    }
}

/// Reads a response head (skipping interim ones) into `buf`; what follows it
/// stays in `buf`.
async fn read_head(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
) -> Result<head::ResponseHead, ClientError> {
    let mut interim = 0;
    loop {
        if let Some(head) = head::response(buf)? {
            let _ = buf.split_to(head.len);
            if (100..200).contains(&head.status) {
                // An interim answer (100 Continue): the real one follows.
                interim += 1;
                if interim > MAX_INTERIM {
                    return Err(ClientError::TooManyInterim);
                }
                continue;
            }
            return Ok(head);
        }
        buf.reserve(1024);
        let read = stream
            .read_buf(buf)
            .await
            .map_err(ClientError::io("reading the response head"))?;
        if read == 0 {
            return Err(ClientError::ClosedBeforeResponse);
        }
    }
}

/// A byte an authority (`host:port`, `[v6]:port`) may hold here.
fn is_authority_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']' | b'_')
}

/// An exchange's failure: `Unwritten` when the connection failed before the
/// request was written (on a reused one: the engine had closed it), else why.
enum Exchange {
    Unwritten(std::io::Error),
    Failed(ClientError),
}

impl Exchange {
    /// As the caller sees it: a request not written never reached the engine.
    fn into_error(self) -> ClientError {
        match self {
            Exchange::Unwritten(err) => ClientError::Connect {
                refused: false,
                message: format!("the connection failed before the request was sent: {err}"),
            },
            Exchange::Failed(err) => err,
        }
    }
}

/// The addresses of `authority` (`host:port`, `[v6]:port`); with a
/// `policy`, all of them allowed by it (a refusal is a `PermissionDenied`
/// error that says why).
async fn resolve(
    authority: &str,
    policy: Option<&UpstreamPolicy>,
) -> std::io::Result<Vec<SocketAddr>> {
    let (host, port) = authority
        .rsplit_once(':')
        .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
        .unwrap_or((authority, 80));
    if let Some(policy) = policy {
        return Ok(policy.resolve(host, port).await?);
    }
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
            if self.buf.is_empty() {
                // Nothing held while waiting (a stream waits for each token):
                // the allocation goes once the pieces given out are dropped.
                self.buf = BytesMut::new();
            }
            conn.stream
                .readable()
                .await
                .map_err(ClientError::io("reading the response body"))?;
            self.buf.reserve(self.framing.read_hint());
            match conn.stream.try_read_buf(&mut self.buf) {
                Ok(0) => {
                    self.reusable = false;
                    self.framing.eof()?;
                }
                Ok(_) => {}
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(err) => return Err(ClientError::io("reading the response body")(err)),
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
    /// another exchange (nothing past the body was received).
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
