//! The transport seam: every backend implements [`Backend`], and the holder,
//! the reader and the conformance suite only talk to that trait.
//!
//! Holds, leases, epochs and the control protocol are the same for every
//! backend (they live in `hold`, `server` and `client`). A backend only does
//! two things: on the holder, make registered memory readable from afar (and
//! say how: an endpoint and per-region keys that travel in the descriptor);
//! on the reader, move the hold's bytes into the destination blocks.

pub(crate) mod tcp;

use crate::client::CtrlClient;
use crate::config::BackendKind;
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

/// A transport for block bytes.
pub(crate) trait Backend: Send + Sync + 'static {
    fn kind(&self) -> BackendKind;

    /// Holder: makes a region readable by remote readers. Returns the key a
    /// reader needs to read it (`None` when the transport needs none).
    fn expose(&self, region: &RegionEntry) -> Result<Option<Vec<u8>>>;

    /// Holder: how a reader reaches this holder's data (empty when the
    /// control address is enough).
    fn endpoint(&self) -> Vec<u8>;

    /// Reader: fills `job.dest` with the hold's bytes. Returns the number of
    /// streams used. Every wait is bounded by `job.io_timeout`.
    fn fetch<'a>(&'a self, job: Fetch<'a>) -> BoxFuture<'a, Result<u32>>;
}

/// The backend of `kind`, or why this build cannot provide it.
pub(crate) fn create(kind: BackendKind) -> Result<Arc<dyn Backend>> {
    match kind {
        BackendKind::Tcp => Ok(Arc::new(tcp::TcpBackend)),
        BackendKind::Ucx => Err(TransferError::Unsupported(
            "the ucx backend is not built in; rebuild connex-transfer with `--features ucx` (needs Debian libucx-dev and libclang-dev)".into(),
        )),
        BackendKind::Mooncake => Err(TransferError::Unsupported(
            "the mooncake backend is not built in; rebuild connex-transfer with `--features mooncake` and MOONCAKE_LIB_DIR set (see docs/transfer.md)".into(),
        )),
    }
}
