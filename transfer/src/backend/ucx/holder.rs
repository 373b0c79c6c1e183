//! The holder's side: one worker, driven by a progress thread, that maps
//! every registered region and publishes its rkey and the worker's address.

use super::ffi::Ucx;
use super::{host_identity, HolderEndpoint};
use crate::backend::Exposure;
use crate::config::Faults;
use crate::error::Result;
use crate::region::RegionEntry;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The holder's worker, the endpoint readers connect to, and the fault
/// switches.
pub(crate) struct HolderSide {
    ucx: Arc<Ucx>,
    /// This host's identity + the worker address.
    endpoint: Vec<u8>,
    /// Fault switch: stop progressing once a pull starts.
    stall_on_pull: bool,
    stalled: Arc<AtomicBool>,
    _progress: Progress,
}

impl HolderSide {
    pub(super) fn new(faults: &Faults) -> Result<Self> {
        let ucx = Arc::new(Ucx::new()?);
        let endpoint = HolderEndpoint::encode(&host_identity(), &ucx.address()?);
        let stalled = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (ucx, stop, stalled) = (ucx.clone(), stop.clone(), stalled.clone());
            let trickle = faults.trickle;
            std::thread::Builder::new()
                .name("connex-ucx-progress".into())
                .spawn(move || progress_loop(&ucx, &stop, &stalled, trickle))?
        };
        Ok(Self {
            ucx,
            endpoint,
            stall_on_pull: faults.stall_after_bytes.is_some(),
            stalled,
            _progress: Progress {
                stop,
                thread: Some(thread),
            },
        })
    }

    /// Maps a region; the mapping is its keepalive (dropped before the memory).
    pub(super) fn expose(&self, region: &RegionEntry) -> Result<Exposure> {
        if region.region.is_empty() {
            return Ok(Exposure::default());
        }
        let (mapping, key) = self.ucx.map(region.region.addr(), region.region.len())?;
        Ok(Exposure {
            key: Some(key),
            keepalive: Some(Box::new(mapping)),
        })
    }

    pub(super) fn pull_started(&self) {
        if self.stall_on_pull {
            self.stalled.store(true, Ordering::Relaxed);
        }
    }

    pub(super) fn endpoint(&self) -> Vec<u8> {
        self.endpoint.clone()
    }
}

/// The progress thread; stopped and joined on drop.
struct Progress {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Drives the holder's worker: busy while there is work, then backing off to
/// short sleeps so an idle holder costs little CPU. With the trickle fault,
/// one progress call per interval.
fn progress_loop(ucx: &Ucx, stop: &AtomicBool, stalled: &AtomicBool, trickle: Option<Duration>) {
    let mut idle = 0u32;
    while !stop.load(Ordering::Relaxed) {
        if stalled.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        if let Some(every) = trickle {
            ucx.progress();
            std::thread::sleep(every);
            continue;
        }
        if ucx.progress() > 0 {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > 2000 {
                std::thread::sleep(Duration::from_micros(200));
            } else if idle > 100 {
                std::thread::yield_now();
            }
        }
    }
}
