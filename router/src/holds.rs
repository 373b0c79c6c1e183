//! The router's side of the prefill holds (DESIGN.md "Holds").
//!
//! - Backstop release: when a request ends (finished, failed or abandoned by its
//!   client) the router releases its hold through the prefill's `remote_ctrl`.
//!   The decoder releases it too on a normal finish; release is idempotent.
//! - Renewal: a request that runs longer than half its hold's lease gets the
//!   hold renewed, so that a resume late in a long decode still finds it.
//! - The check a resume makes before relying on a hold.
//!
//! The I/O of releases and renewals happens on one keeper task owned by the
//! router, so the end of a request never waits on a holder.

use crate::journal::Journal;
use connex_transfer::{CtrlClient, Secret, TransferError};
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// A prefill's hold as its `kv_transfer_params` name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// The holder's control address (`remote_ctrl`).
    pub ctrl: String,
    pub transfer_id: String,
    /// `lease_s`: how long the hold lives without a pull or renew.
    pub lease: Duration,
}

impl Hold {
    /// The hold named by `kv_transfer_params`; `None` when the connector gave no
    /// control address or transfer id (a connector without holds).
    pub fn from_params(kv: &Value) -> Option<Self> {
        let text = |key| kv.get(key).and_then(Value::as_str).map(str::to_string);
        Some(Self {
            ctrl: text("remote_ctrl")?,
            transfer_id: text("transfer_id")?,
            lease: Duration::from_secs_f64(
                kv.get("lease_s")
                    .and_then(Value::as_f64)
                    .unwrap_or(60.0)
                    .clamp(0.0, 86_400.0),
            ),
        })
    }
}

/// What a resume learns of its hold.
#[derive(Debug)]
pub enum HoldState {
    Held,
    /// Released, expired, evicted, or its holder is unreachable.
    Lost(String),
}

/// Handle to the keeper: queue releases, check holds.
#[derive(Debug, Clone)]
pub struct Holds {
    ctrl: CtrlClient,
    releases: mpsc::UnboundedSender<Hold>,
}

/// The keeper's end of the release queue, taken by [`Holds::spawn_keeper`].
pub struct ReleaseQueue(mpsc::UnboundedReceiver<Hold>);

impl Holds {
    pub fn new(ctrl_timeout: Duration, secret: Option<Secret>) -> (Self, ReleaseQueue) {
        let (releases, queue) = mpsc::unbounded_channel();
        let ctrl = CtrlClient::with_config(connex_transfer::ClientConfig {
            connect_timeout: ctrl_timeout,
            io_timeout: ctrl_timeout,
            secret,
            ..Default::default()
        });
        (Self { ctrl, releases }, ReleaseQueue(queue))
    }

    /// Queues the backstop release of `hold`.
    pub fn release(&self, hold: Hold) {
        // The queue only closes when the router stops; a release then is moot
        // (the hold expires by its lease).
        let _ = self.releases.send(hold);
    }

    /// Whether `hold` can still be pulled. An unreachable holder counts as lost:
    /// its KV is gone with it.
    pub async fn check(&self, hold: &Hold) -> HoldState {
        match self.ctrl.stat(&hold.ctrl, &hold.transfer_id).await {
            Ok(Some(_)) => HoldState::Held,
            Ok(None) => HoldState::Lost(format!(
                "hold {} on {} is gone (released, expired or evicted)",
                hold.transfer_id, hold.ctrl
            )),
            Err(err) => {
                if matches!(err, TransferError::Unauthorized(_)) {
                    tracing::warn!(%err, "hold check refused: --transfer-secret must be the engines' secret");
                }
                HoldState::Lost(format!("hold {} unusable: {err}", hold.transfer_id))
            }
        }
    }

    /// Starts the keeper task in `tasks`; it stops with `shutdown` after sending
    /// the releases already queued.
    pub fn spawn_keeper(
        &self,
        queue: ReleaseQueue,
        journal: Arc<Journal>,
        tasks: &mut JoinSet<()>,
        shutdown: CancellationToken,
    ) {
        tasks.spawn(keep(self.ctrl.clone(), queue.0, journal, shutdown));
    }
}

/// Most release or renew calls in flight at once.
const MAX_CALLS: usize = 64;

async fn keep(
    ctrl: CtrlClient,
    mut queue: mpsc::UnboundedReceiver<Hold>,
    journal: Arc<Journal>,
    shutdown: CancellationToken,
) {
    let mut calls = JoinSet::new();
    // Often enough that a hold renewed at half its lease never lapses (1 s leases too).
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(hold) = queue.recv() => {
                if calls.len() >= MAX_CALLS {
                    calls.join_next().await;
                }
                calls.spawn(release(ctrl.clone(), hold));
            }
            _ = tick.tick() => {
                for (hold, epoch) in journal.holds_to_renew(Instant::now()) {
                    if calls.len() < MAX_CALLS {
                        calls.spawn(renew(ctrl.clone(), hold, epoch));
                    }
                }
            }
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
        }
    }
    // Releases queued before the stop still go out, bounded by the client's timeouts.
    queue.close();
    while let Some(hold) = queue.recv().await {
        calls.spawn(release(ctrl.clone(), hold));
    }
    while calls.join_next().await.is_some() {}
}

async fn release(ctrl: CtrlClient, hold: Hold) {
    // One retry covers a holder that was briefly busy; after that the lease
    // frees the hold anyway.
    for attempt in 0..2 {
        match ctrl.release(&hold.ctrl, &hold.transfer_id).await {
            Ok(was_held) => {
                crate::metrics::hold_released(if was_held { "released" } else { "gone" });
                return;
            }
            Err(err) if attempt == 0 && !matches!(err, TransferError::Unreachable { .. }) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => {
                tracing::debug!(transfer_id = %hold.transfer_id, %err, "hold release failed");
                crate::metrics::hold_released("failed");
                return;
            }
        }
    }
}

async fn renew(ctrl: CtrlClient, hold: Hold, epoch: u32) {
    match ctrl.renew(&hold.ctrl, &hold.transfer_id, epoch).await {
        Ok(_) => crate::metrics::hold_renewed("renewed"),
        Err(err) => {
            tracing::debug!(transfer_id = %hold.transfer_id, %err, "hold renew failed");
            crate::metrics::hold_renewed(if err.is_hold_lost() { "gone" } else { "failed" });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hold_comes_from_the_connector_params() {
        let hold =
            Hold::from_params(&json!({"remote_ctrl":"127.0.0.1:9","transfer_id":"t","lease_s":30}))
                .expect("a hold");
        assert_eq!(hold.ctrl, "127.0.0.1:9");
        assert_eq!(hold.lease, Duration::from_secs(30));
        assert_eq!(Hold::from_params(&json!({"transfer_id":"t"})), None);
    }
}
