//! The holder's listener (`remote_ctrl`): control ops and the TCP data path.
//!
//! One task per connection, all owned by the accept loop's `JoinSet` and
//! stopped by the holder's cancellation token. Connections are kept open for
//! many requests (readers and the router pool them). A frame whose payload is
//! bad gets an error reply and the connection goes on; a header that cannot be
//! trusted (bad magic, unknown version, oversized) gets an error reply and the
//! connection is closed. Nothing a peer sends can stop the listener.

use crate::backend::Backend;
use crate::config::{BackendKind, Faults, Secret};
use crate::conn::{self, IO_PIECE};
use crate::error::{Result, TransferError};
use crate::hold::HoldTable;
use crate::proto::{Descriptor, ErrorCode, RemoteBlock, Reply, Request, MAX_KEYS};
use crate::region::{RegionId, RegionTable, SrcSpan};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Most connections served at once; more are closed on accept.
pub(crate) const MAX_CONNECTIONS: usize = 1024;
/// How long a connection may sit idle between frames.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// What every connection of a holder shares.
pub(crate) struct Shared {
    pub(crate) holds: HoldTable,
    pub(crate) regions: RegionTable,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) io_timeout: Duration,
    pub(crate) faults: Faults,
    /// Block bytes written so far (for the stall fault).
    pub(crate) streamed: AtomicU64,
    /// Required (op `hello`) before any other op of a connection.
    pub(crate) secret: Option<Secret>,
}

/// Accepts connections until `shutdown`, then stops every connection task.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut connections = JoinSet::new();
    let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(permit) = limit.clone().try_acquire_owned() else {
                        tracing::warn!(%peer, "connection limit reached; closing");
                        continue;
                    };
                    if let Err(err) = stream.set_nodelay(true) {
                        tracing::debug!(%err, "set_nodelay");
                    }
                    connections.spawn(connection(stream, shared.clone(), shutdown.clone(), permit));
                }
                Err(err) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}

async fn connection(
    mut stream: TcpStream,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    let io = shared.io_timeout;
    let mut admitted = shared.secret.is_none();
    loop {
        let raw = tokio::select! {
            _ = shutdown.cancelled() => return,
            raw = conn::read_header(&mut stream, IDLE_TIMEOUT, io) => raw,
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
        if let Err(refusal) = admit(&shared, &request, &mut admitted) {
            tracing::warn!(refusal, "connection refused");
            let reply = Reply::error(ErrorCode::Unauthorized, refusal);
            let _ = conn::write_all(&mut stream, &reply.encode(seq), io).await;
            return;
        }
        let served = match request {
            Request::Read {
                id,
                epoch,
                offset,
                len,
            } => {
                let range = (offset, len);
                match stream_range(stream, &shared, &shutdown, seq, &id, epoch, range).await {
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
                let reply = answer(&shared, other);
                conn::write_all(&mut stream, &reply.encode(seq), io).await
            }
        };
        if let Err(err) = served {
            tracing::debug!(%err, "connection closed while answering");
            return;
        }
    }
}

/// Whether `request` may be served on a connection: with a secret, only a
/// `hello` that carries it admits the connection, and the refusal of anything
/// else ends it. Without one, a `hello` is welcome and changes nothing.
fn admit(shared: &Shared, request: &Request, admitted: &mut bool) -> Result<(), &'static str> {
    match (request, &shared.secret) {
        (Request::Hello { secret }, Some(ours)) if !ours.matches(secret) => {
            Err("wrong transfer secret")
        }
        (Request::Hello { .. }, _) => {
            *admitted = true;
            Ok(())
        }
        _ if *admitted => Ok(()),
        _ => Err("this holder requires the transfer secret first"),
    }
}

/// The reply to every request but `Read`.
fn answer(shared: &Shared, request: Request) -> Reply {
    let now = Instant::now();
    let holds = &shared.holds;
    let result = match request {
        Request::Renew { id, epoch } => holds.renew(&id, epoch, now).map(Reply::Hold),
        Request::Release { id } => Ok(Reply::Released(holds.release(&id, now))),
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
        Request::Hello { .. } => Ok(Reply::Welcome),
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
