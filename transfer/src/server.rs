//! The holder's listener (`remote_ctrl`): control ops and the TCP data path.
//!
//! One task per connection, all owned by the accept loop's `JoinSet` and
//! stopped by the holder's cancellation token. Connections are kept open for
//! many requests (readers and the router pool them). A frame whose payload is
//! bad gets an error reply and the connection goes on; a header that cannot be
//! trusted (bad magic, unknown version, oversized) gets an error reply and the
//! connection is closed. Nothing a peer sends can stop the listener.
//!
//! With a transfer secret, a connection must complete the handshake (`auth`)
//! within [`HANDSHAKE_TIMEOUT`] of being accepted, before any op; a failed
//! or late one closes it. One peer address holds at most
//! `max_connections_per_peer` connections, and a connection still unproven
//! after [`UNPROVEN_GRACE`] gives its slot up when the holder needs one, so
//! hosts without the secret cannot keep readers out.

use crate::auth::{self, Nonce};
use crate::backend::Backend;
use crate::config::{BackendKind, Faults, Secret};
use crate::conn::{self, IO_PIECE};
use crate::error::{Result, TransferError};
use crate::hold_table::HoldTable;
use crate::inbound_idle::{ConnIdle, IdleConns, IdleMark};
use crate::proto::{Descriptor, ErrorCode, RemoteBlock, Reply, Request, MAX_KEYS};
use crate::region::{RegionId, RegionTable, SrcSpan};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long a connection may sit idle between frames.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a connection to a holder with a secret may take to prove it.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connection may hold a slot unproven before the holder, out of
/// slots, may close it for a new one (so addresses that never prove anything
/// cannot keep every slot for the whole handshake timeout, again and again).
const UNPROVEN_GRACE: Duration = Duration::from_millis(250);
/// Largest frame payload read before the handshake is done.
const MAX_HANDSHAKE_PAYLOAD: u32 = 256;

/// What every connection of a holder shares.
pub(crate) struct Shared {
    pub(crate) holds: HoldTable,
    pub(crate) regions: RegionTable,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) io_timeout: Duration,
    pub(crate) faults: Faults,
    /// Block bytes written so far (for the stall fault).
    pub(crate) streamed: AtomicU64,
    /// Proven (ops `hello`, `proof`) before any other op of a connection.
    pub(crate) secret: Option<Secret>,
    /// Most connections served at once ([`crate::HolderConfig::max_connections`]).
    pub(crate) max_connections: usize,
    pub(crate) max_connections_per_peer: usize,
    /// One permit per connection served (`max_connections` of them).
    pub(crate) slots: Arc<Semaphore>,
    /// The connections between frames, to close one when out of slots.
    pub(crate) idle: Arc<IdleConns>,
}

impl Shared {
    /// Connections served now, and how many of them sit idle.
    pub(crate) fn connections(&self) -> crate::stats::ConnectionCounts {
        crate::stats::ConnectionCounts {
            open: self.max_connections - self.slots.available_permits(),
            idle: self.idle.count(),
        }
    }
}

/// Open connections per peer address.
#[derive(Default)]
struct Peers(Mutex<HashMap<IpAddr, usize>>);

impl Peers {
    /// A slot for one more connection of `peer`, if under `max`.
    fn take(self: &Arc<Self>, peer: IpAddr, max: usize) -> Option<PeerSlot> {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let count = counts.entry(peer).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(PeerSlot {
            peers: self.clone(),
            peer,
        })
    }
}

/// One connection's place in its peer's count; given back on drop.
struct PeerSlot {
    peers: Arc<Peers>,
    peer: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.peers.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

/// Accepts connections until `shutdown`, then stops every connection task.
/// At `max_connections` a new connection is held, unserved, while the one
/// idle longest is closed to make room (readers pool idle connections), or
/// until one ends; further ones wait in the listen backlog: a burst of pulls
/// queues instead of failing.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut connections = JoinSet::new();
    let (limit, idle) = (&shared.slots, &shared.idle);
    let peers = Arc::new(Peers::default());
    let mut logs = LimitLogs::default();
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let Some(slot) = peers.take(peer.ip(), shared.max_connections_per_peer) else {
            tracing::debug!(%peer, "per-peer connection limit reached; closing");
            continue;
        };
        let permit = match limit.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let Some(permit) = make_room(&shared, &shutdown, &mut logs).await else {
                    break;
                };
                permit
            }
        };
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(%err, "set_nodelay");
        }
        let conn = Connection {
            shared: shared.clone(),
            shutdown: shutdown.clone(),
            idle: idle.register(),
            _slots: (permit, slot),
        };
        connections.spawn(conn.serve(stream));
    }
    connections.shutdown().await;
}

/// How long a holder at its limit waits for a connection to end before it
/// closes an idle one (one about to end frees its slot without a close).
const MAKE_ROOM_GRACE: Duration = Duration::from_millis(5);
/// How often it closes another idle connection while no slot frees (the one
/// told to close took a frame at the same moment, or none was idle).
const MAKE_ROOM_EVERY: Duration = Duration::from_millis(50);

/// When the limit's log lines were last written: at most one of each kind
/// per [`LimitLogs::EVERY`].
#[derive(Default)]
struct LimitLogs {
    busy: Option<Instant>,
    closing: Option<Instant>,
}

impl LimitLogs {
    const EVERY: Duration = Duration::from_secs(10);

    fn due(last: &mut Option<Instant>) -> bool {
        let due = last.is_none_or(|at| at.elapsed() >= Self::EVERY);
        if due {
            *last = Some(Instant::now());
        }
        due
    }
}

/// Waits for a connection slot, closing idle connections to free one. None:
/// shutting down.
async fn make_room(
    shared: &Shared,
    shutdown: &CancellationToken,
    logs: &mut LimitLogs,
) -> Option<OwnedSemaphorePermit> {
    let (limit, idle) = (&shared.slots, &shared.idle);
    let since = Instant::now();
    let mut wait = MAKE_ROOM_GRACE;
    let mut closed = 0usize;
    let permit = loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            permit = limit.clone().acquire_owned() => break permit.ok()?,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = MAKE_ROOM_EVERY;
        if idle.close_longest_idle() {
            closed += 1;
        } else if LimitLogs::due(&mut logs.busy) {
            tracing::warn!(
                max = shared.max_connections,
                "connection limit reached with every connection busy; new connections wait"
            );
        }
    };
    if closed > 0 && LimitLogs::due(&mut logs.closing) {
        tracing::info!(
            max = shared.max_connections,
            closed,
            waited_ms = since.elapsed().as_millis() as u64,
            "connection limit reached: idle connections closed for new ones \
             (raise max_connections if this goes on)"
        );
    }
    Some(permit)
}

/// One accepted connection and what it holds while served.
struct Connection {
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    idle: ConnIdle,
    _slots: (OwnedSemaphorePermit, PeerSlot),
}

impl Connection {
    /// Waits for the next frame's first byte within `limit`. `closable_after`:
    /// from when on the wait counts as idle, a connection the holder may close
    /// for a new one (`None`: never). False: close the connection (the peer
    /// closed or sent nothing in time, the holder needed the slot or is
    /// stopping).
    async fn next_frame(
        &self,
        stream: &TcpStream,
        limit: Duration,
        closable_after: Option<Duration>,
    ) -> bool {
        let mut first = [0u8; 1];
        let mut limit = limit;
        if let Some(after) = closable_after.filter(|after| !after.is_zero()) {
            let kept = after.min(limit);
            tokio::select! {
                _ = self.shutdown.cancelled() => return false,
                peeked = tokio::time::timeout(kept, stream.peek(&mut first)) => {
                    if let Ok(peeked) = peeked {
                        return matches!(peeked, Ok(1..));
                    }
                }
            }
            limit = limit.saturating_sub(kept);
            if limit.is_zero() {
                return false;
            }
        }
        let mark = closable_after.map(|_| self.idle.idle());
        let closing = async {
            match &mark {
                Some(mark) => mark.closing().await,
                None => std::future::pending().await,
            }
        };
        // A peek, not `readable()`: readiness can be left over from the last
        // frame, and a peek consumes nothing, so a closed idle connection
        // never loses a byte of a frame.
        let peeked = tokio::select! {
            _ = self.shutdown.cancelled() => return false,
            _ = closing => {
                tracing::debug!("idle connection closed for a new one");
                return false;
            }
            peeked = tokio::time::timeout(limit, stream.peek(&mut first)) => peeked,
        };
        // A frame arriving as the holder chose this connection is left
        // unread: the peer sees the connection closed and retries.
        mark.is_none_or(IdleMark::busy) && matches!(peeked, Ok(Ok(1..)))
    }

    async fn serve(self, stream: TcpStream) {
        connection(stream, &self).await
    }
}

async fn connection(mut stream: TcpStream, this: &Connection) {
    let (shared, shutdown) = (&*this.shared, &this.shutdown);
    let accepted = Instant::now();
    let mut auth = match shared.secret {
        None => Auth::Open,
        Some(_) => Auth::AwaitHello,
    };
    // Only a connection that has served an op (a pooled one) may be closed
    // as idle: a new one's first request may be on its way (with a secret,
    // right after its handshake), and its peer does not retry on a
    // connection it has just opened. One still unproven after
    // [`UNPROVEN_GRACE`] may be closed too: a reader proves itself in a round
    // trip, so it is someone without the secret holding a slot.
    let mut served_op = false;
    loop {
        // Until the handshake is done, every wait ends at its deadline.
        let (idle, io) = if auth.done() {
            (IDLE_TIMEOUT, shared.io_timeout)
        } else {
            let left = HANDSHAKE_TIMEOUT.saturating_sub(accepted.elapsed());
            if left.is_zero() {
                tracing::debug!("handshake not completed in time; closing");
                return;
            }
            (left, left.min(shared.io_timeout))
        };
        let closable_after = if served_op {
            Some(Duration::ZERO)
        } else if auth.done() {
            None
        } else {
            Some(UNPROVEN_GRACE.saturating_sub(accepted.elapsed()))
        };
        if !this.next_frame(&stream, idle, closable_after).await {
            return;
        }
        let raw = tokio::select! {
            _ = shutdown.cancelled() => return,
            raw = conn::read_header(&mut stream, io, io) => raw,
        };
        let raw = match raw {
            Ok(Some(raw)) => raw,
            Ok(None) => return,
            Err(err) => {
                // A header cut short: tell the peer, if it still listens.
                if matches!(err, TransferError::Io(_)) {
                    let reply = Reply::error(ErrorCode::BadFrame, "truncated frame header");
                    let _ = conn::write_all(&mut stream, &reply.encode(0), io).await;
                }
                return;
            }
        };
        let seq = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
        let header = match conn::check_header(&raw) {
            Ok(header) => header,
            Err((code, err)) => {
                let _ =
                    conn::write_all(&mut stream, &Reply::error(code, err.0).encode(seq), io).await;
                return;
            }
        };
        if !auth.done() && header.len > MAX_HANDSHAKE_PAYLOAD {
            // Nobody unproven makes this side buffer megabytes.
            let reply = Reply::error(ErrorCode::Unauthorized, "handshake first");
            let _ = conn::write_all(&mut stream, &reply.encode(seq), io).await;
            return;
        }
        let payload = match conn::read_payload(&mut stream, header.len, io).await {
            Ok(payload) => payload,
            Err(err) => {
                let reply = Reply::error(ErrorCode::BadFrame, format!("truncated frame: {err}"));
                let _ = conn::write_all(&mut stream, &reply.encode(seq), io).await;
                return;
            }
        };
        let request = match Request::decode(header.op, &payload) {
            Ok(request) => request,
            Err(err) => {
                let code = if Request::known_op(header.op) {
                    ErrorCode::BadFrame
                } else {
                    ErrorCode::UnknownOp
                };
                let reply = Reply::error(code, err.0);
                if conn::write_all(&mut stream, &reply.encode(seq), io)
                    .await
                    .is_err()
                {
                    return;
                }
                continue;
            }
        };
        let request = match auth.admit(shared.secret.as_ref(), request) {
            Ok(Admit::Serve(request)) => {
                served_op = true;
                request
            }
            Ok(Admit::Answer(reply)) => {
                if conn::write_all(&mut stream, &reply.encode(seq), io)
                    .await
                    .is_err()
                {
                    return;
                }
                continue;
            }
            Err(refusal) => {
                tracing::warn!(refusal, "connection refused");
                let reply = Reply::error(ErrorCode::Unauthorized, refusal);
                let _ = conn::write_all(&mut stream, &reply.encode(seq), io).await;
                return;
            }
        };
        let served = match request {
            Request::Read {
                id,
                epoch,
                offset,
                len,
            } => {
                let range = (offset, len);
                match stream_range(stream, shared, shutdown, seq, &id, epoch, range).await {
                    Ok(back) => {
                        stream = back;
                        continue;
                    }
                    Err(err) => {
                        tracing::debug!(%err, "connection closed while streaming");
                        return;
                    }
                }
            }
            other => {
                let reply = answer(shared, other);
                conn::write_all(&mut stream, &reply.encode(seq), io).await
            }
        };
        if let Err(err) = served {
            tracing::debug!(%err, "connection closed while answering");
            return;
        }
    }
}

/// Where a connection stands in the handshake.
enum Auth {
    /// The holder has no secret: every op is served (and a `hello` answered
    /// with a plain welcome, which a client with a secret refuses).
    Open,
    AwaitHello,
    AwaitProof {
        reader: Nonce,
        holder: Nonce,
    },
    Proven,
}

/// What to do with a request.
enum Admit {
    Serve(Request),
    /// A handshake step: send this and read the next frame.
    Answer(Reply),
}

impl Auth {
    fn done(&self) -> bool {
        matches!(self, Self::Open | Self::Proven)
    }

    /// The handshake's rules; an error ends the connection.
    fn admit(&mut self, secret: Option<&Secret>, request: Request) -> Result<Admit, &'static str> {
        match (&*self, request, secret) {
            (Self::Open, Request::Hello { .. }, _) => Ok(Admit::Answer(Reply::Welcome)),
            (Self::Open | Self::Proven, Request::Proof { .. }, _) => Err("unexpected proof"),
            (Self::Proven, Request::Hello { .. }, _) => Err("handshake already done"),
            (Self::Open | Self::Proven, request, _) => Ok(Admit::Serve(request)),
            (Self::AwaitHello, Request::Hello { nonce: reader }, Some(secret)) => {
                let holder = auth::nonce();
                let proof = auth::holder_proof(secret, &reader, &holder);
                *self = Self::AwaitProof { reader, holder };
                Ok(Admit::Answer(Reply::Challenge {
                    nonce: holder,
                    proof,
                }))
            }
            (Self::AwaitProof { reader, holder }, Request::Proof { proof }, Some(secret)) => {
                if auth::verify(&auth::reader_proof(secret, holder, reader), &proof) {
                    *self = Self::Proven;
                    Ok(Admit::Answer(Reply::Welcome))
                } else {
                    Err("wrong transfer secret")
                }
            }
            _ => Err("this holder requires the transfer handshake first"),
        }
    }
}

/// The reply to every request but `Read`.
fn answer(shared: &Shared, request: Request) -> Reply {
    let now = Instant::now();
    let holds = &shared.holds;
    let result = match request {
        Request::Renew { id, epoch } => holds.renew(&id, epoch, now).map(Reply::Hold),
        Request::Release { id } => Ok(Reply::Released(holds.release(&id, now))),
        Request::ReleaseMany { ids } => Ok(Reply::ReleasedMany(holds.release_many(&ids, now))),
        Request::Stat { id } => Ok(Reply::Stat(holds.stat(&id, now))),
        Request::Stats => Ok(Reply::Stats(holds.stats())),
        Request::Describe {
            id,
            epoch,
            backend,
            window_ms,
        } => describe(shared, &id, epoch, (backend, window_ms), now),
        Request::Done { id, epoch, .. } => holds
            .finish_pull(&id, epoch, now)
            .map(|released| Reply::Done { released }),
        Request::Abort { id } => {
            holds.abort_pull(&id, now);
            Ok(Reply::Done { released: false })
        }
        Request::Hello { .. } | Request::Proof { .. } => Err(TransferError::Protocol(
            "handshake ops are answered above".into(),
        )),
        Request::Read { .. } => Err(TransferError::Protocol("read is streamed".into())),
    };
    result.unwrap_or_else(|err| error_reply(&err))
}

/// Longest window a one-sided pull may keep a freed hold's blocks from the engine.
const MAX_PULL_WINDOW: Duration = Duration::from_secs(600);

fn describe(
    shared: &Shared,
    id: &str,
    epoch: u32,
    (backend, window_ms): (u8, u32),
    now: Instant,
) -> Result<Reply> {
    let ours = shared.backend.kind();
    if backend != ours.code() {
        return Ok(Reply::error(
            ErrorCode::WrongBackend,
            format!("this holder serves the {ours} backend (reader asked code {backend})"),
        ));
    }
    // A one-sided pull reads the blocks without this side: count it as a
    // read until its done or the end of the window its reader announced.
    let window = (ours != BackendKind::Tcp)
        .then(|| Duration::from_millis(u64::from(window_ms)).min(MAX_PULL_WINDOW));
    let (info, spans) = shared.holds.describe(id, epoch, window, now)?;
    shared.backend.pull_started();
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut index: HashMap<RegionId, u16> = HashMap::new();
    let mut blocks = Vec::with_capacity(spans.len());
    for span in &spans {
        let key = match span.remote_key() {
            None => 0,
            Some(key) => match index.get(&span.region_id()) {
                Some(i) => *i,
                None => {
                    if keys.len() >= MAX_KEYS {
                        return Ok(Reply::error(
                            ErrorCode::Internal,
                            format!("hold spans more than {MAX_KEYS} regions"),
                        ));
                    }
                    keys.push(key.to_vec());
                    let i = (keys.len() - 1) as u16;
                    index.insert(span.region_id(), i);
                    i
                }
            },
        };
        blocks.push(RemoteBlock {
            len: span.len() as u64,
            addr: span.addr(),
            key,
        });
    }
    Ok(Reply::Descriptor(Descriptor {
        backend,
        info,
        endpoint: shared.backend.endpoint(),
        keys,
        blocks,
    }))
}

/// Maps an error to its wire reply.
pub(crate) fn error_reply(err: &TransferError) -> Reply {
    match err {
        TransferError::HoldNotFound { .. } => {
            Reply::error(ErrorCode::HoldNotFound, err.to_string())
        }
        TransferError::StaleEpoch { served, asked } => Reply::Error {
            code: ErrorCode::StaleEpoch as u16,
            served: *served,
            asked: *asked,
            message: err.to_string(),
        },
        TransferError::EpochOutOfRange { asked, max } => Reply::Error {
            code: ErrorCode::EpochOutOfRange as u16,
            served: *max,
            asked: *asked,
            message: err.to_string(),
        },
        TransferError::InvalidArgument(_) => Reply::error(ErrorCode::BadRange, err.to_string()),
        _ => Reply::error(ErrorCode::Internal, err.to_string()),
    }
}

/// Answers a `Read`: a `Data` header, then the bytes straight from the held
/// memory (no copy on this side; the kernel copies into the socket).
/// Takes the connection and gives it back when the answer is complete. The
/// read is counted on the hold until its writer has stopped, and a release
/// meanwhile shuts the socket down (the reader sees a cut stream).
async fn stream_range(
    mut stream: TcpStream,
    shared: &Shared,
    shutdown: &CancellationToken,
    seq: u32,
    id: &str,
    epoch: u32,
    (offset, len): (u64, u64),
) -> Result<TcpStream> {
    let io = shared.io_timeout;
    let (spans, read) = match shared.holds.read(id, epoch, offset, len, Instant::now()) {
        Ok(found) => found,
        Err(err) => {
            conn::write_all(&mut stream, &error_reply(&err).encode(seq), io).await?;
            return Ok(stream);
        }
    };
    conn::write_all(&mut stream, &Reply::Data { len }.encode(seq), io).await?;
    // Blocks that sit end to end in memory go out as one buffer.
    let mut merged: Vec<SrcSpan> = Vec::with_capacity(spans.len());
    for span in spans {
        if !merged.last_mut().is_some_and(|last| last.try_merge(&span)) {
            merged.push(span);
        }
    }
    let faults = &shared.faults;
    let stream = match (faults.stall_after_bytes, faults.trickle) {
        (None, Some(every)) => {
            // Fault injection: one byte per interval until done or fenced.
            let fenced = read.fenced();
            for span in &merged {
                for byte in span.bytes().chunks(1) {
                    tokio::select! {
                        _ = tokio::time::sleep(every) => {}
                        _ = fenced.cancelled() => {
                            return Err(TransferError::Protocol("hold freed".into()));
                        }
                        _ = shutdown.cancelled() => {
                            return Err(TransferError::Protocol("holder stopping".into()));
                        }
                    }
                    conn::write_all(&mut stream, byte, io).await?;
                }
            }
            drop(read);
            stream
        }
        (None, None) if len <= conn::ASYNC_MAX => {
            // A small read: written on the async socket (conn::ASYNC_MAX says
            // why), within one I/O timeout (it is less than one I/O piece),
            // and stopped at once when the hold is freed or the holder stops.
            // The read counts until this arm ends, so the blocks stay the
            // hold's while their bytes are written.
            let fenced = read.fenced();
            let bufs: Vec<&[u8]> = merged.iter().map(SrcSpan::bytes).collect();
            tokio::select! {
                written = conn::timed("moving block bytes", io, conn::write_gather_async(&stream, &bufs)) => written?,
                _ = fenced.cancelled() => {
                    return Err(TransferError::Protocol("hold freed".into()));
                }
                _ = shutdown.cancelled() => {
                    return Err(TransferError::Protocol("holder stopping".into()));
                }
            }
            drop(bufs);
            drop(read);
            stream
        }
        (None, None) => {
            // A reader must take at least one I/O piece per I/O timeout.
            let pieces = u32::try_from(len / IO_PIECE as u64).unwrap_or(u32::MAX);
            let now = Instant::now();
            let deadline = now
                .checked_add(io.saturating_mul(pieces.saturating_add(1)))
                .unwrap_or(now + IDLE_TIMEOUT);
            let fencer = read.fencer();
            let (stream, ()) = conn::blocking(
                stream,
                io,
                deadline,
                |socket| fencer.watch(socket),
                move |stream| {
                    // Owned here: the read counts until this writer stops.
                    let _read = read;
                    let bufs: Vec<&[u8]> = merged.iter().map(SrcSpan::bytes).collect();
                    conn::write_gather(stream, &bufs)
                },
            )
            .await?;
            stream
        }
        (Some(limit), _) => {
            // Fault injection: after `limit` bytes, keep the connection and
            // send nothing more until the holder stops or the hold is freed.
            let fenced = read.fenced();
            for span in &merged {
                for piece in span.bytes().chunks(IO_PIECE) {
                    if shared.streamed.load(Ordering::Relaxed) >= limit {
                        tokio::select! {
                            _ = shutdown.cancelled() => {}
                            _ = fenced.cancelled() => {}
                        }
                        return Err(TransferError::Protocol("read stopped".into()));
                    }
                    tokio::select! {
                        written = conn::write_all(&mut stream, piece, io) => written?,
                        _ = fenced.cancelled() => {
                            return Err(TransferError::Protocol("hold freed".into()));
                        }
                    }
                    shared
                        .streamed
                        .fetch_add(piece.len() as u64, Ordering::Relaxed);
                }
            }
            drop(read);
            stream
        }
    };
    shared.holds.add_bytes_served(len);
    Ok(stream)
}
