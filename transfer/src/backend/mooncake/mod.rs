//! The Mooncake backend: reads through Mooncake Transfer Engine's C API
//! (bindings generated from its `transfer_engine_c.h`, see mooncake-sys).
//!
//! Holder and reader each run an engine with P2P handshake metadata (no
//! metadata server; a segment is named by its engine's `ip:port`) and the
//! transports the engine discovers: RDMA where the library and the NICs have
//! it, else TCP (`MC_FORCE_TCP=1` forces TCP). The host it publishes and the
//! memory location it registers come from the environment (`engine.rs`).
//!
//! The holder registers its regions with its engine; the descriptor carries
//! the segment name as endpoint and the blocks' virtual addresses (Mooncake
//! reads by remote absolute address, and only inside registered ranges). The
//! reader registers its destination regions, opens the holder's segment once
//! (a handshake, bounded by the I/O timeout), and submits one batch of READs
//! per pull, polling their status until all completed, one failed, or none
//! ended for one I/O timeout. Requests still in flight when a pull gives up
//! keep their destinations claimed until they end (`batch.rs`).
#![allow(unsafe_code)]

mod batch;
mod engine;
mod stall;

use super::{Backend, Exposure, Fetch, PullFence, Role};
use crate::config::BackendKind;
use crate::error::{Result, TransferError};
use crate::region::{DestSpan, RegionEntry};
use batch::{Batch, Inflight, Reaper};
use connex_mooncake_sys as sys;
use engine::{Engine, Settings};
use futures_util::future::BoxFuture;
use stall::EngineThreads;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn fail(message: impl Into<String>) -> TransferError {
    TransferError::Backend {
        backend: "mooncake",
        message: message.into(),
    }
}

pub(crate) struct MooncakeBackend {
    engine: Arc<Engine>,
    segment_name: String,
    /// Holder with the stall fault: the engine threads to park on a pull.
    stall: Option<EngineThreads>,
    /// Reader: segments opened so far, by name, and names whose reads failed
    /// (opened afresh next time, in case the holder restarted).
    segments: Mutex<Segments>,
    /// Reader: watches the reads of pulls that gave up (holders read nothing).
    reaper: Option<Reaper>,
}

impl Drop for MooncakeBackend {
    fn drop(&mut self) {
        // Parked engine threads wake before the engine (dropped with the
        // fields, after this) joins them.
        drop(self.stall.take());
    }
}

#[derive(Default)]
struct Segments {
    open: HashMap<String, sys::segment_id_t>,
    stale: HashSet<String>,
}

impl MooncakeBackend {
    pub(crate) fn new(role: Role<'_>) -> Result<Self> {
        let settings = Settings::from_env();
        let stall_on_pull =
            matches!(role, Role::Holder { faults, .. } if faults.stall_after_bytes.is_some());
        let (engine, threads) = EngineThreads::around(|| Engine::new(&settings));
        let engine = Arc::new(engine?);
        let segment_name = engine.segment_name()?;
        tracing::debug!(segment = %segment_name, location = %settings.location, "mooncake engine started");
        Ok(Self {
            engine,
            segment_name,
            stall: stall_on_pull.then_some(threads),
            segments: Mutex::new(Segments::default()),
            reaper: match role {
                Role::Reader => Some(Reaper::start()?),
                Role::Holder { .. } => None,
            },
        })
    }

    fn segments(&self) -> std::sync::MutexGuard<'_, Segments> {
        self.segments.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of segment `name`, opening it (a handshake with its engine)
    /// on first use; bounded by `io`.
    async fn segment(&self, name: &str, io: Duration) -> Result<sys::segment_id_t> {
        let fresh = {
            let segments = self.segments();
            if let Some(id) = segments.open.get(name) {
                return Ok(*id);
            }
            segments.stale.contains(name)
        };
        let cname = engine::cstring(name)?;
        let engine = self.engine.clone();
        let open = tokio::task::spawn_blocking(move || {
            // SAFETY: the name outlives the call; the engine is alive (Arc).
            unsafe {
                if fresh {
                    sys::openSegmentNoCache(engine.raw(), cname.as_ptr())
                } else {
                    sys::openSegment(engine.raw(), cname.as_ptr())
                }
            }
        });
        // A holder that hangs mid-handshake would block this for good: the
        // thread is left to finish on its own.
        let id = match tokio::time::timeout(io, open).await {
            Ok(joined) => joined.map_err(|e| fail(format!("openSegment task of {name}: {e}")))?,
            Err(_) => {
                return Err(TransferError::Timeout {
                    what: "opening the holder's mooncake segment",
                    after: io,
                })
            }
        };
        if id < 0 {
            return Err(fail(format!(
                "openSegment({name}) failed ({id}): the holder's engine is unreachable"
            )));
        }
        let mut segments = self.segments();
        segments.stale.remove(name);
        segments.open.insert(name.to_string(), id);
        Ok(id)
    }

    fn forget_segment(&self, name: &str) {
        let mut segments = self.segments();
        segments.open.remove(name);
        segments.stale.insert(name.to_string());
    }
}

/// Neighbouring blocks that are contiguous on both sides become one read.
fn coalesce(reads: impl Iterator<Item = (DestSpan, u64)>) -> Vec<(DestSpan, u64)> {
    let mut out: Vec<(DestSpan, u64)> = Vec::new();
    for (dest, remote) in reads {
        if let Some((last, last_remote)) = out.last_mut() {
            if *last_remote + last.len as u64 == remote && last.try_merge(&dest) {
                continue;
            }
        }
        out.push((dest, remote));
    }
    out
}

impl Backend for MooncakeBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Mooncake
    }

    fn expose(&self, region: &RegionEntry) -> Result<Exposure> {
        self.engine.register(region)
    }

    fn pull_started(&self) {
        if let Some(threads) = &self.stall {
            threads.park();
        }
    }

    fn register_local(&self, region: &RegionEntry) -> Result<Exposure> {
        self.engine.register(region)
    }

    fn endpoint(&self) -> Vec<u8> {
        self.segment_name.clone().into_bytes()
    }

    fn fetch<'a>(&'a self, job: Fetch<'a>) -> BoxFuture<'a, Result<u32>> {
        Box::pin(async move {
            let name = String::from_utf8(job.descriptor.endpoint.clone()).map_err(|_| {
                TransferError::Protocol("mooncake segment name is not UTF-8".into())
            })?;
            let reads = coalesce(
                job.descriptor
                    .blocks
                    .iter()
                    .zip(job.dest)
                    .filter(|(b, _)| b.len > 0)
                    .map(|(b, dest)| (dest, b.addr)),
            );
            if reads.is_empty() {
                return Ok(0);
            }
            let reaper = self
                .reaper
                .as_ref()
                .ok_or_else(|| fail("a mooncake holder cannot pull"))?;
            let segment = self.segment(&name, job.io_timeout).await?;
            let inflight = Inflight::submit(self.engine.clone(), segment, reads)?;
            let mut batch = Batch::new(inflight, reaper.sender());
            let outcome = wait(batch.get(), job.io_timeout, job.deadline, &job.fence).await;
            if outcome.is_err() {
                self.forget_segment(&name);
            }
            // Dropping the batch frees it, or leaves its unfinished requests
            // (and their destinations) to the reaper; so does a cancelled pull.
            drop(batch);
            outcome.map_err(|err| match err {
                Wait::Failed(task, status, requests) => fail(format!(
                    "read {task} of {requests} from segment {name} ended with status {status} \
                     ({}): the holder's engine failed or went away",
                    status_name(status)
                )),
                Wait::Stuck(after) => TransferError::Timeout {
                    what: "waiting for mooncake reads",
                    after,
                },
            })
        })
    }
}

enum Wait {
    /// (request, status, requests in the batch)
    Failed(usize, i32, usize),
    Stuck(Duration),
}

/// Polls `batch` until every request ended, none ended for `io`, the pull's
/// `deadline` passed or its `fence` was cut. Busy at first (small pulls end in
/// microseconds), then in 1 ms naps. Mooncake cannot cancel a read: on a
/// timeout the batch's unfinished requests (and their destinations) go to the
/// reaper, which releases them only once the engine reports them ended.
async fn wait(
    batch: &mut Inflight,
    io: Duration,
    deadline: Instant,
    fence: &PullFence,
) -> Result<u32, Wait> {
    let started = Instant::now();
    let mut last_progress = Instant::now();
    let mut idle_polls = 0u32;
    loop {
        if batch.poll() > 0 {
            last_progress = Instant::now();
            idle_polls = 0;
        }
        if batch.ended() {
            return match batch.failed {
                None => Ok(batch.requests() as u32),
                Some((task, status)) => Err(Wait::Failed(task, status, batch.requests())),
            };
        }
        if last_progress.elapsed() > io {
            return Err(match batch.failed {
                Some((task, status)) => Wait::Failed(task, status, batch.requests()),
                None => Wait::Stuck(io),
            });
        }
        if fence.is_cut() || Instant::now() >= deadline {
            return Err(Wait::Stuck(started.elapsed()));
        }
        idle_polls += 1;
        if idle_polls < 64 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

fn status_name(status: i32) -> &'static str {
    match status {
        sys::STATUS_INVALID => "invalid",
        sys::STATUS_CANCELED => "canceled",
        sys::STATUS_TIMEOUT => "timeout",
        sys::STATUS_FAILED => "failed",
        -1 => "status unreadable",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::coalesce;
    use crate::region::{BlockRef, Region, RegionTable};

    #[test]
    fn neighbours_contiguous_on_both_sides_become_one_read() {
        let table = RegionTable::default();
        let region = table.register(Region::owned(vec![0; 1000])).id;
        let dest = [(0, 100), (100, 100), (300, 50), (350, 50), (400, 10)]
            .map(|(at, len)| BlockRef::new(region, at, len));
        let spans = table.claim(&dest).expect("free, in bounds");
        // Remote: the first two and the next two are contiguous, the last is not.
        let remote = [5000u64, 5100, 9000, 9050, 9200];
        let reads = coalesce(spans.into_iter().zip(remote));
        let got: Vec<(usize, u64)> = reads.iter().map(|(d, r)| (d.len, *r)).collect();
        assert_eq!(got, [(200, 5000), (100, 9000), (10, 9200)]);
    }

    #[test]
    fn blocks_contiguous_on_one_side_only_stay_apart() {
        let table = RegionTable::default();
        let region = table.register(Region::owned(vec![0; 400])).id;
        let dest =
            [(0, 100), (100, 100), (300, 100)].map(|(at, len)| BlockRef::new(region, at, len));
        let spans = table.claim(&dest).expect("free, in bounds");
        // Destination 0-1 contiguous but not the remote; remote 1-2 contiguous but not the destination.
        let reads = coalesce(spans.into_iter().zip([100u64, 300, 400]));
        assert_eq!(reads.len(), 3);
    }
}
