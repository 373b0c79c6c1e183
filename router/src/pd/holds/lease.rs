//! A request's claim on its hold (`HoldLease`), and the commands it files
//! for the keeper: track (renew) while it lives, release when it drops.

use super::hold::Hold;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

/// What the keeper is told.
#[derive(Debug)]
pub(super) enum KeeperCommand {
    /// Renew `hold` at half its lease, at the lease's current epoch, until untracked.
    Track {
        key: u64,
        hold: Hold,
        lease: Arc<LeaseState>,
    },
    /// Stop renewing; release the hold (the router's backstop).
    Release { key: u64 },
}

/// What a [`HoldLease`] shares with the keeper.
#[derive(Debug)]
pub(super) struct LeaseState {
    /// The resume epoch renewals use.
    pub(super) epoch: AtomicU64,
    /// Set when the lease drops. The keeper looks at it before each renewal,
    /// so a hold whose `Release` found the queue full is still released, at
    /// its next due renewal (within half its lease), instead of being renewed
    /// for ever.
    pub(super) dropped: AtomicBool,
}

/// A request's claim on a hold: renewed by the keeper while it lives, released
/// when it drops (however the request ended: finished, failed, or its client
/// went away). The decoder releases the hold too on a normal finish; release is
/// idempotent.
#[derive(Debug)]
pub struct HoldLease {
    pub(super) hold: Hold,
    pub(super) key: u64,
    pub(super) state: Arc<LeaseState>,
    pub(super) commands: mpsc::Sender<KeeperCommand>,
}

impl HoldLease {
    pub fn hold(&self) -> &Hold {
        &self.hold
    }

    /// The resume epoch renewals use from now on.
    pub fn set_epoch(&self, epoch: u64) {
        self.state.epoch.store(epoch, Ordering::Relaxed);
    }
}

impl Drop for HoldLease {
    fn drop(&mut self) {
        self.state.dropped.store(true, Ordering::Relaxed);
        // A full queue: the keeper sees `dropped` at the next due renewal and
        // releases the hold then. A closed one: the router is stopping, and a
        // release then is moot (the hold expires by its lease).
        let _ = self
            .commands
            .try_send(KeeperCommand::Release { key: self.key });
    }
}
