//! The replies to every control op but `Read` (which `stream.rs` streams).

use super::Shared;
use crate::config::BackendKind;
use crate::error::{Result, TransferError};
use crate::proto::{Descriptor, ErrorCode, RemoteBlock, Reply, Request, MAX_KEYS};
use crate::region::RegionId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The reply to every request but `Read`.
pub(super) fn answer(shared: &Shared, request: Request) -> Reply {
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
        Request::Read(_) => Err(TransferError::Protocol("read is streamed".into())),
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
pub(super) fn error_reply(err: &TransferError) -> Reply {
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
