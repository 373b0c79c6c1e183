//! Counters and descriptions a holder reports, and what a pull measured.

use serde::Serialize;
use std::time::Duration;

/// A holder's counters (and its current holds / bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HolderStats {
    /// Holds alive now.
    pub holds: u64,
    /// Bytes of the holds alive now.
    pub held_bytes: u64,
    /// Completed pulls.
    pub pulls: u64,
    /// Holds freed by a release (explicit, or `after_pull`).
    pub releases: u64,
    /// Holds dropped because their lease ran out.
    pub expiries: u64,
    /// Holds dropped to stay under the byte budget.
    pub evictions: u64,
    /// Pulls and renews refused for a stale resume epoch.
    pub stale_epoch_refusals: u64,
    /// Block bytes sent by the TCP data path.
    pub bytes_served: u64,
}

/// A holder's control connections now ([`crate::Holder::connections`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnectionCounts {
    /// Connections served (at most `max_connections`).
    pub open: usize,
    /// Of those, the ones between requests once they have served one
    /// (pooled by their readers): closed, idle longest first, when the
    /// holder is out of connections.
    pub idle: usize,
}

/// One hold, as `stat` and `renew` describe it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HoldInfo {
    pub transfer_id: String,
    pub blocks: u32,
    pub bytes: u64,
    /// Time left on the lease, in milliseconds.
    pub expires_in_ms: u64,
    /// Highest resume epoch the hold has served.
    pub epoch: u32,
    /// Completed pulls of this hold.
    pub pulls: u32,
}

/// What one pull did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullStats {
    pub bytes: u64,
    pub blocks: u32,
    /// Data connections (TCP) or transfer requests in flight at once.
    pub streams: u32,
    pub elapsed: Duration,
}
