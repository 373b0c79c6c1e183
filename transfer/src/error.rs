//! The crate's one error type. Remote errors arrive as codes on the wire
//! ([`crate::proto::ErrorCode`]) and are mapped back to these variants, so a
//! reader sees the same `HoldNotFound` whether the check failed here or there.

use std::time::Duration;

/// Everything that can go wrong holding, serving or pulling KV blocks.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The holder's control listener could not be reached.
    #[error("holder {addr} unreachable: {source}")]
    Unreachable {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// A connect, read or write took longer than its limit.
    #[error("timed out after {after:?} while {what}")]
    Timeout { what: &'static str, after: Duration },
    /// The hold is unknown: never created, released, expired or evicted.
    #[error("hold {transfer_id:?} not found (unknown, released, expired or evicted)")]
    HoldNotFound { transfer_id: String },
    /// The hold already served a higher resume epoch.
    #[error("stale resume epoch {asked}: the hold has served epoch {served}")]
    StaleEpoch { served: u32, asked: u32 },
    /// The resume epoch is above the holder's bound (no resume goes that far:
    /// a bug or an attack, refused so that nobody can lock a hold out).
    #[error("resume epoch {asked} is above the holder's bound {max}")]
    EpochOutOfRange { asked: u32, max: u32 },
    /// A hold with this transfer id exists already.
    #[error("hold {0:?} exists already")]
    HoldExists(String),
    /// The hold alone is larger than the holder's byte budget.
    #[error("hold of {bytes} bytes exceeds the budget of {budget} bytes")]
    OverBudget { bytes: u64, budget: u64 },
    /// The peer broke the protocol (bad frame, wrong reply, unexpected length).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The destination blocks do not match the hold's blocks.
    #[error("size mismatch: {0}")]
    SizeMismatch(String),
    /// A caller-side argument is invalid (unknown region, out of bounds, busy range).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The holder refused the request for a reason of its own.
    #[error("holder error ({code}): {message}")]
    Remote { code: u16, message: String },
    /// The handshake over the transfer secret failed: this side or the peer
    /// lacks it or has another one.
    #[error("transfer handshake failed: {0} (holders, readers and the router need the same CONNEX_TRANSFER_SECRET)")]
    Unauthorized(String),
    /// The transport backend failed.
    #[error("{backend} backend: {message}")]
    Backend {
        backend: &'static str,
        message: String,
    },
    /// The backend was not compiled in, or the holder uses another backend.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The connection failed while transferring.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

impl TransferError {
    /// The holder does not know the op (a holder older than the client).
    pub fn is_unknown_op(&self) -> bool {
        matches!(self, Self::Remote { code, .. } if *code == crate::proto::ErrorCode::UnknownOp as u16)
    }

    /// True when the hold cannot be read any more (gone or taken over by a newer
    /// epoch): the caller should re-prefill rather than retry.
    pub fn is_hold_lost(&self) -> bool {
        matches!(
            self,
            Self::HoldNotFound { .. } | Self::StaleEpoch { .. } | Self::EpochOutOfRange { .. }
        )
    }
}

/// Result alias of this crate.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;
