//! A batch of READ requests in flight, and the reaper that keeps the
//! destinations of an abandoned batch claimed until the engine has finished
//! with them.
//!
//! A pull that fails or times out while some of its requests are still
//! queued or moving cannot take them back: the C API has no cancel. Those
//! requests may still write into their destinations, so the destinations
//! stay claimed (the reader refuses to hand them out or pull into them again)
//! until every request has ended; a reader thread polls them meanwhile.

use super::engine::Engine;
use super::fail;
use crate::error::Result;
use crate::region::DestSpan;
use connex_mooncake_sys as sys;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Requests of one batch that have not ended yet, and what they write into.
pub(crate) struct Inflight {
    engine: Arc<Engine>,
    id: sys::batch_id_t,
    requests: usize,
    /// The destinations, claimed until every request has ended.
    spans: Vec<DestSpan>,
    /// Indices of the requests still queued or moving.
    open: Vec<usize>,
    /// A request whose status could not be read: it may write at any time,
    /// so its destinations are never handed back.
    uncertain: bool,
    /// The first request that ended without completing: (index, status).
    pub failed: Option<(usize, i32)>,
}

// SAFETY: the spans are claimed for this batch alone (see `DestSpan`); the
// engine handle is `Send`.
unsafe impl Send for Inflight {}

impl Inflight {
    /// Submits one READ per `(destination, remote address)`.
    pub(crate) fn submit(
        engine: Arc<Engine>,
        segment: sys::segment_id_t,
        mut reads: Vec<(DestSpan, u64)>,
    ) -> Result<Self> {
        let mut requests: Vec<sys::transfer_request> = reads
            .iter_mut()
            .map(|(dest, remote)| {
                let dest = dest.as_mut();
                sys::transfer_request {
                    opcode: sys::OPCODE_READ,
                    source: dest.as_mut_ptr().cast(),
                    target_id: segment,
                    // The remote absolute address, not an offset.
                    target_offset: *remote,
                    length: dest.len() as u64,
                }
            })
            .collect();
        // SAFETY: the requests point into claimed destinations, kept by the
        // returned batch until every request has ended.
        unsafe {
            let id = sys::allocateBatchID(engine.raw(), requests.len());
            if id == sys::INVALID_BATCH {
                return Err(fail(format!("allocateBatchID({}) failed", requests.len())));
            }
            let rc = sys::submitTransfer(engine.raw(), id, requests.as_mut_ptr(), requests.len());
            if rc != 0 {
                // Mooncake checks a batch (capacity, transport for the
                // segment) before queueing any of it: nothing is in flight.
                sys::freeBatchID(engine.raw(), id);
                return Err(fail(format!("submitTransfer failed ({rc})")));
            }
            Ok(Self {
                engine,
                id,
                requests: requests.len(),
                spans: reads.into_iter().map(|(span, _)| span).collect(),
                open: (0..requests.len()).collect(),
                uncertain: false,
                failed: None,
            })
        }
    }

    pub(crate) fn requests(&self) -> usize {
        self.requests
    }

    /// True once no request can write any more.
    pub(crate) fn ended(&self) -> bool {
        self.open.is_empty()
    }

    /// Reads the status of every open request; returns how many ended now.
    pub(crate) fn poll(&mut self) -> usize {
        let before = self.open.len();
        let (engine, id) = (self.engine.raw(), self.id);
        let (mut failed, mut uncertain) = (self.failed, false);
        self.open.retain(|&task| {
            let mut status = sys::transfer_status {
                status: 0,
                transferred_bytes: 0,
            };
            // SAFETY: `task` is an index of this live batch.
            if unsafe { sys::getTransferStatus(engine, id, task, &mut status) } != 0 {
                uncertain = true;
                failed.get_or_insert((task, -1));
                return false;
            }
            match status.status {
                sys::STATUS_COMPLETED => false,
                sys::STATUS_WAITING | sys::STATUS_PENDING => true,
                other => {
                    failed.get_or_insert((task, other));
                    false
                }
            }
        });
        self.failed = failed;
        self.uncertain |= uncertain;
        before - self.open.len()
    }

    /// Frees an ended batch and hands its destinations back.
    fn free(mut self) {
        debug_assert!(self.ended());
        // SAFETY: every request of the batch has ended.
        unsafe { sys::freeBatchID(self.engine.raw(), self.id) };
        if self.uncertain {
            leak(std::mem::take(&mut self.spans));
        }
    }
}

/// Keeps destinations claimed (and their memory alive) for good: for
/// requests the engine might still be writing.
fn leak(spans: Vec<DestSpan>) {
    if !spans.is_empty() {
        tracing::warn!(
            blocks = spans.len(),
            "mooncake: destinations of reads that never ended stay claimed"
        );
    }
    std::mem::forget(spans);
}

/// A batch as one pull owns it: freed when it has ended, else given to the
/// reaper on drop (a pull that failed, timed out or was cancelled).
pub(crate) struct Batch {
    inflight: Option<Inflight>,
    reaper: Sender<Inflight>,
}

impl Batch {
    pub(crate) fn new(inflight: Inflight, reaper: Sender<Inflight>) -> Self {
        Self {
            inflight: Some(inflight),
            reaper,
        }
    }

    pub(crate) fn get(&mut self) -> &mut Inflight {
        self.inflight.as_mut().expect("present until dropped")
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        let Some(inflight) = self.inflight.take() else {
            return;
        };
        if inflight.ended() {
            inflight.free();
        } else if let Err(mpsc::SendError(mut orphan)) = self.reaper.send(inflight) {
            // No reaper any more (the backend is going away).
            leak(std::mem::take(&mut orphan.spans));
        }
    }
}

/// The thread that watches abandoned batches until they end; stopped and
/// joined with the backend.
pub(crate) struct Reaper {
    tx: Sender<Inflight>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Reaper {
    pub(crate) fn start() -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Inflight>();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("connex-mooncake-reaper".into())
                .spawn(move || {
                    let mut waiting: Vec<Inflight> = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let wait = if waiting.is_empty() { 100 } else { 5 };
                        match rx.recv_timeout(Duration::from_millis(wait)) {
                            Ok(batch) => waiting.push(batch),
                            Err(RecvTimeoutError::Timeout) => {}
                            Err(RecvTimeoutError::Disconnected) => break,
                        }
                        let mut i = 0;
                        while i < waiting.len() {
                            waiting[i].poll();
                            if waiting[i].ended() {
                                waiting.swap_remove(i).free();
                            } else {
                                i += 1;
                            }
                        }
                    }
                    for mut batch in waiting.drain(..).chain(rx.try_iter()) {
                        leak(std::mem::take(&mut batch.spans));
                    }
                })?
        };
        Ok(Self {
            tx,
            stop,
            thread: Some(thread),
        })
    }

    pub(crate) fn sender(&self) -> Sender<Inflight> {
        self.tx.clone()
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
