//! `CtrlClient`: requests to holders over pooled, reused connections.
//!
//! The router (release backstop, renew, hold-lost check) and every reader use
//! it. Connections are kept per address and reused; each request has a connect
//! and an I/O time limit; a reused connection that the holder closed while it
//! sat idle is replaced once, transparently. One request runs on a connection
//! at a time (a checked-out connection is exclusive), so replies never interleave.

use crate::auth;
use crate::config::Secret;
use crate::conn;
use crate::error::{Result, TransferError};
use crate::net::IdlePool;
use crate::proto::{Descriptor, ErrorCode, Reply, Request};
use crate::stats::{HoldInfo, HolderStats};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Limits of a [`CtrlClient`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub connect_timeout: Duration,
    /// Limit for each read or write (a reply, a piece of block bytes).
    pub io_timeout: Duration,
    /// Idle connections kept per holder address.
    pub max_idle_per_addr: usize,
    /// An idle connection older than this is closed instead of reused (the
    /// listener closes its side after two minutes, or sooner when it needs
    /// the slot for a new connection).
    pub idle_ttl: Duration,
    /// Proven on every new connection, and required of the holder (default:
    /// [`crate::SECRET_ENV`]).
    pub secret: Option<Secret>,
    /// Resolves a holder's address for each new connection (default: the
    /// system's resolver, at every connect).
    pub resolver: Option<Resolver>,
}

/// Resolves a holder's address (`host:port`) to the addresses a new
/// connection tries, in order. The router passes one that checks every
/// address against its upstream policy: a holder's name re-pointed after it
/// was registered (DNS rebinding) must not make the router connect elsewhere.
pub trait Resolve: Send + Sync {
    fn resolve<'a>(
        &'a self,
        addr: &'a str,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'a>>;
}

/// A shared [`Resolve`].
#[derive(Clone)]
pub struct Resolver(pub Arc<dyn Resolve>);

impl std::fmt::Debug for Resolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resolver")
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(10),
            // A decoder starting many requests at once pulls from one
            // prefill over as many connections; with fewer kept, each burst
            // closed and reopened the rest (and with a secret, each new one
            // costs a handshake round trip). Holders allow 512 per peer.
            max_idle_per_addr: 64,
            idle_ttl: Duration::from_secs(60),
            secret: Secret::from_env(),
            resolver: None,
        }
    }
}

struct Pool {
    config: ClientConfig,
    idle: IdlePool,
    seq: AtomicU32,
}

/// Pooled control client; cheap to clone (clones share the pool).
#[derive(Clone)]
pub struct CtrlClient {
    pool: Arc<Pool>,
}

impl Default for CtrlClient {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for CtrlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CtrlClient")
            .field("config", &self.pool.config)
            .finish()
    }
}

/// A checked-out connection; goes back to the pool on drop only after a
/// complete exchange (so a half-read reply can never be seen by the next user).
pub(crate) struct Conn {
    stream: Option<TcpStream>,
    addr: String,
    pool: Arc<Pool>,
    reused: bool,
    reusable: bool,
}

impl Conn {
    pub(crate) fn stream(&mut self) -> Result<&mut TcpStream> {
        self.stream
            .as_mut()
            .ok_or_else(|| TransferError::Protocol("connection already closed".into()))
    }

    /// Takes the stream out for blocking I/O; put it back with [`Conn::put_stream`].
    pub(crate) fn take_stream(&mut self) -> Result<TcpStream> {
        self.stream
            .take()
            .ok_or_else(|| TransferError::Protocol("connection already closed".into()))
    }

    pub(crate) fn put_stream(&mut self, stream: TcpStream) {
        self.stream = Some(stream);
    }

    /// Marks the exchange complete: the connection may serve the next request.
    pub(crate) fn finish(&mut self) {
        self.reusable = true;
    }

    /// Sends `request` and reads its reply. The reply's first byte is waited
    /// for until `answer_by` when given (see [`AnswerBy`]), else for one I/O
    /// timeout; the rest of the frame within one I/O timeout.
    async fn exchange(&mut self, request: &Request, answer_by: AnswerBy) -> Result<Reply> {
        self.reusable = false;
        let seq = self.pool.seq.fetch_add(1, Ordering::Relaxed);
        let io = self.pool.config.io_timeout;
        let frame = request.encode(seq);
        let stream = self.stream()?;
        conn::write_all(stream, &frame, io).await?;
        let wait = match answer_by {
            AnswerBy::IoTimeout => io,
            AnswerBy::Deadline(at) => at.saturating_duration_since(Instant::now()),
        };
        let raw = conn::read_header(stream, wait, io).await?.ok_or_else(|| {
            TransferError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "holder closed the connection",
            ))
        })?;
        let header = conn::check_header(&raw)
            .map_err(|(_, e)| TransferError::Protocol(format!("bad reply header: {e}")))?;
        if header.seq != seq {
            return Err(TransferError::Protocol(format!(
                "reply to request {} while waiting for {seq}",
                header.seq
            )));
        }
        let payload = conn::read_payload(stream, header.len, io).await?;
        let reply = Reply::decode(header.op, &payload)
            .map_err(|e| TransferError::Protocol(format!("bad reply: {e}")))?;
        if let Reply::Error {
            code,
            served,
            asked,
            message,
        } = reply
        {
            // An error reply ends the exchange cleanly.
            self.reusable = true;
            return Err(remote_error(request, code, served, asked, message));
        }
        Ok(reply)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if !self.reusable {
            return;
        }
        if let Some(stream) = self.stream.take() {
            self.pool.idle.put(&self.addr, stream);
        }
    }
}

/// The error a holder's error reply stands for.
fn remote_error(
    request: &Request,
    code: u16,
    served: u32,
    asked: u32,
    message: String,
) -> TransferError {
    match ErrorCode::from_u16(code) {
        Some(ErrorCode::HoldNotFound) => TransferError::HoldNotFound {
            transfer_id: request.transfer_id().unwrap_or_default().to_string(),
        },
        Some(ErrorCode::StaleEpoch) => TransferError::StaleEpoch { served, asked },
        Some(ErrorCode::EpochOutOfRange) => TransferError::EpochOutOfRange { asked, max: served },
        Some(ErrorCode::BadRange) => TransferError::SizeMismatch(message),
        Some(ErrorCode::WrongBackend) => TransferError::Unsupported(message),
        Some(ErrorCode::Unauthorized) => TransferError::Unauthorized(message),
        _ => TransferError::Remote { code, message },
    }
}

/// How long a request waits for the holder to start answering.
///
/// A pull's requests wait until the pull's own deadline: a holder inside an
/// engine may be alive but given no CPU for seconds (a TP 2 engine's first
/// forward on two cores took its holder's answer past the fixed I/O timeout,
/// 10 s, while the pull had 30 s). A holder that died is still found at once
/// (its connection resets or closes), one that hangs at the pull's deadline.
/// Other requests (renew, release, stat) wait one I/O timeout.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AnswerBy {
    IoTimeout,
    Deadline(Instant),
}

/// The reader's half of the handshake (see `auth`).
async fn handshake(conn: &mut Conn, secret: &Secret, answer_by: AnswerBy) -> Result<()> {
    let reader = auth::nonce();
    let hello = Request::Hello { nonce: reader };
    let (holder, proof) = match conn.exchange(&hello, answer_by).await? {
        Reply::Challenge { nonce, proof } => (nonce, proof),
        Reply::Welcome => {
            return Err(TransferError::Unauthorized(format!(
                "holder {} has no transfer secret, so it cannot prove it is one of ours",
                conn.addr
            )))
        }
        other => return Err(unexpected(&other)),
    };
    if !auth::verify(&auth::holder_proof(secret, &reader, &holder), &proof) {
        return Err(TransferError::Unauthorized(format!(
            "holder {} could not prove it knows the transfer secret",
            conn.addr
        )));
    }
    let proof = auth::reader_proof(secret, &holder, &reader);
    match conn.exchange(&Request::Proof { proof }, answer_by).await? {
        Reply::Welcome => Ok(()),
        other => Err(unexpected(&other)),
    }
}

/// Errors that mean "the idle connection was dead", worth one fresh retry.
fn is_stale(err: &TransferError) -> bool {
    use std::io::ErrorKind::*;
    matches!(err, TransferError::Io(e) if matches!(e.kind(), UnexpectedEof | ConnectionReset | BrokenPipe | ConnectionAborted))
}

impl CtrlClient {
    /// A client with the default limits.
    pub fn new() -> Self {
        Self::with_config(ClientConfig::default())
    }

    pub fn with_config(config: ClientConfig) -> Self {
        Self {
            pool: Arc::new(Pool {
                idle: IdlePool::new(config.max_idle_per_addr, config.idle_ttl),
                config,
                seq: AtomicU32::new(1),
            }),
        }
    }

    pub fn config(&self) -> &ClientConfig {
        &self.pool.config
    }

    /// Idle pooled connections to `addr` (for tests and diagnostics).
    pub fn idle_connections(&self, addr: &str) -> usize {
        self.pool.idle.idle_to(addr)
    }

    async fn connect(&self, addr: &str) -> Result<TcpStream> {
        let limit = self.pool.config.connect_timeout;
        let connect = async {
            match &self.pool.config.resolver {
                // Resolved once, and connected to exactly what was resolved
                // (and checked).
                Some(Resolver(resolver)) => {
                    let addrs = resolver.resolve(addr).await?;
                    TcpStream::connect(&addrs[..]).await
                }
                None => TcpStream::connect(addr).await,
            }
        };
        let stream = match tokio::time::timeout(limit, connect).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => {
                return Err(TransferError::Unreachable {
                    addr: addr.to_string(),
                    source,
                })
            }
            Err(_) => {
                return Err(TransferError::Timeout {
                    what: "connecting to the holder",
                    after: limit,
                })
            }
        };
        stream.set_nodelay(true)?;
        Ok(stream)
    }

    /// A new connection, past the handshake when this client has a secret:
    /// the holder proves it knows the secret before this side proves it (and
    /// before anything else is sent), so a fake holder learns nothing.
    async fn fresh(&self, addr: &str, answer_by: AnswerBy) -> Result<Conn> {
        let mut conn = self.wrap(addr, self.connect(addr).await?, false);
        if let Some(secret) = &self.pool.config.secret {
            if let Err(err) = handshake(&mut conn, secret, answer_by).await {
                // Refused or abandoned: not a connection for the pool.
                conn.reusable = false;
                return Err(err);
            }
        }
        Ok(conn)
    }

    fn wrap(&self, addr: &str, stream: TcpStream, reused: bool) -> Conn {
        Conn {
            stream: Some(stream),
            addr: addr.to_string(),
            pool: self.pool.clone(),
            reused,
            reusable: false,
        }
    }

    /// Sends `request` and reads the reply frame, retrying once on a fresh
    /// connection when a reused one turns out dead. The connection is returned
    /// for a `Data` reply (bytes follow) and otherwise given back to the pool.
    pub(crate) async fn open(
        &self,
        addr: &str,
        request: &Request,
        answer_by: AnswerBy,
    ) -> Result<(Conn, Reply)> {
        let mut conn = match self.pool.idle.take(addr) {
            Some(stream) => self.wrap(addr, stream, true),
            None => self.fresh(addr, answer_by).await?,
        };
        let reply = match conn.exchange(request, answer_by).await {
            Err(err) if conn.reused && is_stale(&err) => {
                conn = self.fresh(addr, answer_by).await?;
                conn.exchange(request, answer_by).await?
            }
            other => other?,
        };
        if !matches!(reply, Reply::Data { .. }) {
            conn.finish();
        }
        Ok((conn, reply))
    }

    async fn call(&self, addr: &str, request: Request) -> Result<Reply> {
        Ok(self.open(addr, &request, AnswerBy::IoTimeout).await?.1)
    }

    /// Extends the lease of a hold (refused for a stale epoch).
    pub async fn renew(&self, addr: &str, transfer_id: &str, epoch: u32) -> Result<HoldInfo> {
        let id = transfer_id.to_string();
        match self.call(addr, Request::Renew { id, epoch }).await? {
            Reply::Hold(info) => Ok(info),
            other => Err(unexpected(&other)),
        }
    }

    /// Frees a hold; `false` when it was not held. Idempotent.
    pub async fn release(&self, addr: &str, transfer_id: &str) -> Result<bool> {
        let id = transfer_id.to_string();
        match self.call(addr, Request::Release { id }).await? {
            Reply::Released(was) => Ok(was),
            other => Err(unexpected(&other)),
        }
    }

    /// Frees several holds in one call (at most
    /// [`MAX_RELEASE_BATCH`](crate::proto::MAX_RELEASE_BATCH)); per id, in
    /// order, whether it was held. A holder older than the op answers with an
    /// error for which [`TransferError::is_unknown_op`] holds: release those
    /// one by one.
    pub async fn release_many(&self, addr: &str, transfer_ids: &[String]) -> Result<Vec<bool>> {
        if transfer_ids.len() > crate::proto::MAX_RELEASE_BATCH {
            return Err(TransferError::InvalidArgument(format!(
                "{} transfer ids in one release, at most {}",
                transfer_ids.len(),
                crate::proto::MAX_RELEASE_BATCH
            )));
        }
        let ids = transfer_ids.to_vec();
        match self.call(addr, Request::ReleaseMany { ids }).await? {
            Reply::ReleasedMany(were) if were.len() == transfer_ids.len() => Ok(were),
            other => Err(unexpected(&other)),
        }
    }

    /// The hold as it is, without renewing it; `None` when unknown, expired or released.
    pub async fn stat(&self, addr: &str, transfer_id: &str) -> Result<Option<HoldInfo>> {
        let id = transfer_id.to_string();
        match self.call(addr, Request::Stat { id }).await? {
            Reply::Stat(info) => Ok(info),
            other => Err(unexpected(&other)),
        }
    }

    /// The holder's counters.
    pub async fn stats(&self, addr: &str) -> Result<HolderStats> {
        match self.call(addr, Request::Stats).await? {
            Reply::Stats(stats) => Ok(stats),
            other => Err(unexpected(&other)),
        }
    }

    pub(crate) async fn describe(
        &self,
        addr: &str,
        transfer_id: &str,
        epoch: u32,
        backend: u8,
        window_ms: u32,
        deadline: Instant,
    ) -> Result<Descriptor> {
        let id = transfer_id.to_string();
        let request = Request::Describe {
            id,
            epoch,
            backend,
            window_ms,
        };
        match self
            .open(addr, &request, AnswerBy::Deadline(deadline))
            .await?
            .1
        {
            Reply::Descriptor(d) => Ok(d),
            other => Err(unexpected(&other)),
        }
    }

    /// Tells the holder a one-sided pull failed and its gets have stopped.
    pub(crate) async fn abort(&self, addr: &str, transfer_id: &str) -> Result<()> {
        let id = transfer_id.to_string();
        match self.call(addr, Request::Abort { id }).await? {
            Reply::Done { .. } => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    pub(crate) async fn done(
        &self,
        addr: &str,
        transfer_id: &str,
        epoch: u32,
        bytes: u64,
        deadline: Instant,
    ) -> Result<bool> {
        let request = Request::Done {
            id: transfer_id.to_string(),
            epoch,
            bytes,
        };
        match self
            .open(addr, &request, AnswerBy::Deadline(deadline))
            .await?
            .1
        {
            Reply::Done { released } => Ok(released),
            other => Err(unexpected(&other)),
        }
    }
}

fn unexpected(reply: &Reply) -> TransferError {
    let mut text = format!("{reply:?}");
    text.truncate(200);
    TransferError::Protocol(format!("unexpected reply {text}"))
}
