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
use std::sync::Arc;
use std::time::Duration;

/// One pull, as the reader hands it to its backend.
pub(crate) struct Fetch<'a> {
    pub ctrl: &'a CtrlClient,
    pub remote_ctrl: &'a str,
    pub transfer_id: &'a str,
    pub epoch: u32,
    #[cfg_attr(not(any(feature = "ucx", feature = "mooncake")), allow(dead_code))]
    pub descriptor: &'a Descriptor,
    /// Claimed destination blocks, in the hold's block order (lengths checked).
    pub dest: Vec<DestSpan>,
    pub io_timeout: Duration,
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
    /// streams used. Every wait is bounded by `job.io_timeout`.
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
