//! The reader's side: its own worker, an endpoint per holder (cached), rkeys
//! unpacked per pull, a window of gets in flight, progressed by the pulling
//! thread (tokio's blocking pool) until done, failed, cut, past the pull's
//! deadline, or no get finished for one I/O timeout. However it ends, no get
//! writes into the destination once `run_gets` has returned: a failed pull
//! cancels its gets (mode "peer") or destroys the worker (mode "none").

use super::ffi::{self, Endpoint, ErrMode, Request, Ucx};
use super::{host_identity, HolderEndpoint};
use crate::backend::PullFence;
use crate::error::{Result, TransferError};
use crate::region::DestSpan;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Gets in flight at once per pull.
const WINDOW: usize = 64;

/// A reader's worker and its endpoints (by holder worker address). Pulls
/// take turns on it under the reader's mutex.
struct ReaderState {
    /// Created on first use; dropped (worker destroyed) after a pull that
    /// could not be cleanly cancelled.
    ucx: Option<Ucx>,
    eps: HashMap<Vec<u8>, (Endpoint, ErrMode)>,
}

impl Drop for ReaderState {
    fn drop(&mut self) {
        if let Some(ucx) = &self.ucx {
            for (_, (ep, _)) in self.eps.drain() {
                ep.close(ucx);
            }
        }
    }
}

pub(crate) struct ReaderSide {
    state: Mutex<ReaderState>,
}

/// When a pull's gets must stop.
pub(super) struct Limits {
    /// No get completed for this long: the holder is gone or stuck.
    pub(super) io: Duration,
    /// The pull's overall deadline.
    pub(super) deadline: Instant,
    /// Cut when the pull is abandoned.
    pub(super) fence: Arc<PullFence>,
}

/// One block to fetch.
pub(super) struct Get {
    pub(super) dest: DestSpan,
    pub(super) remote: u64,
    pub(super) key: usize,
}

/// The error mode for a holder on `holder_host`: on the same host (and IPC
/// namespace) shared memory is reachable, so mode "none", unless
/// `CONNEX_UCX_ERR_MODE=peer` says otherwise; on another host mode "peer"
/// (on RDMA a dead peer in mode "none" is a fatal UCX error).
fn err_mode_for(holder_host: &[u8]) -> ErrMode {
    match std::env::var("CONNEX_UCX_ERR_MODE").as_deref() {
        Ok("peer") => ErrMode::Peer,
        Ok("none") => ErrMode::None,
        _ if holder_host == host_identity().as_slice() => ErrMode::None,
        _ => ErrMode::Peer,
    }
}

/// How a pull on an endpoint ended.
enum Ending {
    /// Every get completed or was cancelled: the endpoint is reusable unless
    /// the pull failed.
    Settled,
    /// Every get was cancelled by force-closing the endpoint (mode "peer"):
    /// forget the endpoint, it is closed already.
    Closed,
    /// Some gets may still write into their destinations: the worker must be
    /// destroyed before the destinations are given back.
    Outstanding,
}

impl ReaderSide {
    pub(super) fn new() -> Self {
        Self {
            state: Mutex::new(ReaderState {
                ucx: None,
                eps: HashMap::new(),
            }),
        }
    }

    /// Issues the gets (a window at a time) and progresses until all are done.
    pub(super) fn run_gets(
        &self,
        endpoint: &[u8],
        keys: &[Vec<u8>],
        mut gets: Vec<Get>,
        limits: &Limits,
    ) -> Result<u32> {
        let (host, address) = HolderEndpoint::decode(endpoint)?;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *state;
        let ucx = match &mut state.ucx {
            Some(ucx) => ucx,
            none => none.insert(Ucx::new()?),
        };
        let (ep, mode) = match state.eps.get(address) {
            Some(&found) => found,
            None => {
                let mode = err_mode_for(host);
                let ep = ucx.connect(address, mode)?;
                state.eps.insert(address.to_vec(), (ep, mode));
                (ep, mode)
            }
        };
        let (result, ending) = gets_on(ucx, ep, mode, keys, &mut gets, limits);
        match ending {
            Ending::Outstanding => {
                // Destroying the worker purges its endpoints and every get
                // still outstanding; only then may the destinations go.
                state.eps.clear();
                state.ucx = None;
                tracing::warn!(
                    ?mode,
                    "ucx pull failed with gets outstanding: reader worker reset"
                );
            }
            Ending::Closed => {
                state.eps.remove(address);
            }
            Ending::Settled if result.is_err() => {
                // The endpoint may be broken (peer gone): start afresh next time.
                if let Some((ep, _)) = state.eps.remove(address) {
                    ep.close(ucx);
                }
            }
            Ending::Settled => {}
        }
        drop(gets);
        result
    }
}

fn gets_on(
    ucx: &Ucx,
    ep: Endpoint,
    mode: ErrMode,
    keys: &[Vec<u8>],
    gets: &mut [Get],
    limits: &Limits,
) -> (Result<u32>, Ending) {
    let rkeys = match ep.unpack(keys) {
        Ok(rkeys) => rkeys,
        Err(err) => return (Err(err), Ending::Settled),
    };
    let mut pending: Vec<Request> = Vec::with_capacity(WINDOW);
    let mut next = 0usize;
    let mut last_progress = Instant::now();
    let mut failure: Option<TransferError> = None;
    while failure.is_none() && (next < gets.len() || !pending.is_empty()) {
        while failure.is_none() && next < gets.len() && pending.len() < WINDOW {
            let get = &mut gets[next];
            next += 1;
            // The destination is a claimed span that outlives this function's
            // gets: they complete, are cancelled, or the worker is destroyed
            // (by the caller) before `gets` is dropped.
            match ep.get(get.dest.as_mut(), get.remote, &rkeys, get.key) {
                Ok(Some(request)) => pending.push(request),
                Ok(None) => {}
                Err(err) => failure = Some(err),
            }
        }
        if pending.is_empty() {
            continue;
        }
        ucx.progress();
        if ffi::reap(&mut pending, &mut failure) {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > limits.io {
            failure = Some(TransferError::Timeout {
                what: "waiting for ucx gets",
                after: limits.io,
            });
        }
        if failure.is_none() && (limits.fence.is_cut() || Instant::now() >= limits.deadline) {
            failure = Some(TransferError::Timeout {
                what: "pulling a hold (deadline)",
                after: limits.io,
            });
        }
    }
    let Some(failure) = failure else {
        return (Ok(WINDOW.min(gets.len()).max(1) as u32), Ending::Settled);
    };
    if pending.is_empty() {
        return (Err(failure), Ending::Settled);
    }
    let mut closed = false;
    if mode == ErrMode::Peer {
        // A force close completes every get still outstanding (cancelled).
        ep.close(ucx);
        closed = true;
        let deadline = Instant::now() + Duration::from_secs(2);
        while !pending.is_empty() && Instant::now() < deadline {
            ucx.progress();
            let mut ignored = None;
            ffi::reap(&mut pending, &mut ignored);
        }
    }
    let ending = match (pending.is_empty(), closed) {
        (false, _) => Ending::Outstanding,
        (true, true) => Ending::Closed,
        (true, false) => Ending::Settled,
    };
    // The rkeys go only once no get uses them (settled), or with the worker.
    drop(rkeys);
    (Err(failure), ending)
}
