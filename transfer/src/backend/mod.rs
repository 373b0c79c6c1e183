//! The transport seam: every backend implements [`Backend`], and the holder,
//! the reader and the conformance suite only talk to that trait.
//!
//! Holds, leases, epochs and the control protocol are the same for every
//! backend (they live in `hold`, `server` and `client`). A backend only does
//! two things: on the holder, make registered memory readable from afar (and
//! say how: an endpoint and per-region keys that travel in the descriptor);
//! on the reader, move the hold's bytes into the destination blocks.

#[cfg(feature = "mooncake")]
pub(crate) mod mooncake;
pub(crate) mod tcp;
#[cfg(feature = "ucx")]
pub(crate) mod ucx;

use crate::client::CtrlClient;
use crate::config::{BackendKind, Faults};
use crate::error::{Result, TransferError};
use crate::proto::Descriptor;
use crate::region::{DestSpan, RegionEntry};
use futures_util::future::BoxFuture;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One pull, as the reader hands it to its backend.
pub(crate) struct Fetch<'a> {
    pub ctrl: &'a CtrlClient,
    pub remote_ctrl: &'a str,
    pub transfer_id: &'a str,
    pub epoch: u32,
    #[cfg_attr(not(any(feature = "ucx", feature = "mooncake")), allow(dead_code))]
    pub descriptor: &'a Descriptor,
    /// Claimed destination blocks, in the order of `descriptor.blocks`
    /// (lengths checked).
    pub dest: Vec<DestSpan>,
    /// The bytes of the hold to read, as (offset, length) runs of the hold's
    /// blocks laid end to end, in order: the whole hold, or the runs of the
    /// blocks a pull selected (whose `descriptor` lists only those).
    pub ranges: Vec<(u64, u64)>,
    /// Limit of each wait for the peer (one I/O, one get).
    pub io_timeout: Duration,
    /// The whole pull's deadline: by then the backend has stopped every
    /// write into `dest` and returned (a timeout).
    pub deadline: Instant,
    /// Cut when the pull is abandoned (its future dropped) or past its
    /// deadline: the backend stops its writers as soon as it can.
    pub fence: Arc<PullFence>,
    /// Most data streams / requests in flight at once.
    pub max_streams: usize,
}

/// What exposing a region produced.
#[derive(Default)]
pub(crate) struct Exposure {
    /// The key a reader needs to read the region (`None`: the transport needs none).
    pub key: Option<Vec<u8>>,
    /// Kept with the region and dropped just before its memory (e.g. a UCX
    /// memory mapping that must be undone first).
    pub keepalive: Option<Box<dyn Send + Sync>>,
}

/// Which side a backend instance serves.
pub(crate) enum Role<'a> {
    Holder {
        #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
        faults: &'a Faults,
    },
    Reader,
}

/// A transport for block bytes.
pub(crate) trait Backend: Send + Sync + 'static {
    fn kind(&self) -> BackendKind;

    /// Whether this transport can read and write GPU memory itself (a
    /// registered region may then be a device address). Decided at run time
    /// from the library actually loaded; false means host memory only, and
    /// the engine stages device KV through host buffers.
    fn device_memory(&self) -> bool {
        false
    }

    /// Holder: makes a region readable by remote readers.
    fn expose(&self, region: &RegionEntry) -> Result<Exposure>;

    /// Holder: a reader started a pull (fault injection hooks in here).
    fn pull_started(&self) {}

    /// Reader: registers destination memory with the transport, where it
    /// needs that (Mooncake reads only into registered memory).
    fn register_local(&self, _region: &RegionEntry) -> Result<Exposure> {
        Ok(Exposure::default())
    }

    /// Holder: how a reader reaches this holder's data (empty when the
    /// control address is enough).
    fn endpoint(&self) -> Vec<u8>;

    /// Reader: fills `job.dest` with the hold's bytes. Returns the number of
    /// streams used. Every wait is bounded by `job.io_timeout`, the whole by
    /// `job.deadline`; and whatever the outcome, the returned future resolves
    /// only once nothing writes into `job.dest` any more (a caller gives the
    /// blocks back to its engine as soon as it has the error). When the
    /// future is dropped instead, `job.fence` is cut, and the claim that the
    /// spans hold is released only when the last writer has stopped.
    fn fetch<'a>(&'a self, job: Fetch<'a>) -> BoxFuture<'a, Result<u32>>;
}

/// The backend of `kind` for `role`, or why this build cannot provide it.
pub(crate) fn create(kind: BackendKind, role: Role<'_>) -> Result<Arc<dyn Backend>> {
    match kind {
        BackendKind::Tcp => Ok(Arc::new(tcp::TcpBackend)),
        #[cfg(feature = "ucx")]
        BackendKind::Ucx => Ok(Arc::new(ucx::UcxBackend::new(role)?)),
        #[cfg(not(feature = "ucx"))]
        BackendKind::Ucx => Err(TransferError::Unsupported(
            "the ucx backend is not built in; rebuild connex-transfer with `--features ucx` (needs Debian libucx-dev and libclang-dev)".into(),
        )),
        #[cfg(feature = "mooncake")]
        BackendKind::Mooncake => Ok(Arc::new(mooncake::MooncakeBackend::new(role)?)),
        #[cfg(not(feature = "mooncake"))]
        BackendKind::Mooncake => {
            let _ = role;
            Err(TransferError::Unsupported(
            "the mooncake backend is not built in; rebuild connex-transfer with `--features mooncake` and MOONCAKE_LIB_DIR set (see docs/transfer.md)".into(),
            ))
        }
    }
}

/// Stops a pull's data movement on demand: the sockets its writers block on
/// are shut down (a blocked `readv` then returns at once) and one-sided
/// backends poll [`PullFence::is_cut`] between gets.
#[derive(Default)]
pub(crate) struct PullFence {
    /// Set by the cut, beside the token below: one-sided backends read it
    /// between gets, and the token's own check takes a lock.
    cut: AtomicBool,
    /// Cancelled by the cut: what async transfers (small TCP stripes) await.
    cancelled: tokio_util::sync::CancellationToken,
    next: AtomicU64,
    sockets: Mutex<HashMap<u64, std::net::TcpStream>>,
}

impl PullFence {
    pub(crate) fn is_cut(&self) -> bool {
        self.cut.load(Ordering::Acquire)
    }

    /// Shuts every watched socket down; later ones are shut down as they come.
    pub(crate) fn cut(&self) {
        self.cut.store(true, Ordering::Release);
        self.cancelled.cancel();
        let sockets = std::mem::take(&mut *self.lock());
        for socket in sockets.into_values() {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Resolves once the fence is cut.
    pub(crate) async fn cancelled(&self) {
        self.cancelled.cancelled().await;
    }

    /// Watches `socket` (a handle of a stream a writer uses) until the
    /// returned key is given to [`PullFence::unwatch`]. Refused after a cut.
    pub(crate) fn watch(&self, socket: std::net::TcpStream) -> Result<u64> {
        let mut sockets = self.lock();
        if self.is_cut() {
            let _ = socket.shutdown(std::net::Shutdown::Both);
            return Err(TransferError::Timeout {
                what: "pulling a hold (cut)",
                after: Duration::ZERO,
            });
        }
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        sockets.insert(key, socket);
        Ok(key)
    }

    /// Stops watching a socket whose transfer ended (it may go back to a pool).
    pub(crate) fn unwatch(&self, key: u64) {
        self.lock().remove(&key);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, std::net::TcpStream>> {
        self.sockets.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Cuts a pull's fence when the pull's future is dropped before it ended.
pub(crate) struct CutOnDrop(pub(crate) Option<Arc<PullFence>>);

impl CutOnDrop {
    /// The pull ended by itself: nothing to cut.
    pub(crate) fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CutOnDrop {
    fn drop(&mut self) {
        if let Some(fence) = self.0.take() {
            fence.cut();
        }
    }
}
