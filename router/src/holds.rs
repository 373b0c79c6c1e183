//! The router's side of the prefill holds (docs/architecture.md, "Holds").
//!
//! - Backstop release: when a request ends (finished, failed or abandoned by its
//!   client) the router releases its hold through the prefill's `remote_ctrl`.
//!   The decoder releases it too on a normal finish; release is idempotent.
//! - Renewal: a request that runs longer than half its hold's lease gets the
//!   hold renewed, so that a resume late in a long decode still finds it.
//! - The check a resume makes before relying on a hold.
//!
//! The I/O of releases and renewals happens on one keeper task owned by the
//! router, so the end of a request never waits on a holder. Each request holds a
//! [`HoldLease`]; the keeper keeps the leases in renewal order and wakes only
//! when one is due.

use connex_transfer::{CtrlClient, Secret, TransferError};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
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

/// Handle to the keeper: lease holds (renewed while leased, released when the
/// lease drops), check holds.
#[derive(Debug, Clone)]
pub struct Holds {
    ctrl: CtrlClient,
    commands: mpsc::UnboundedSender<Command>,
    next_key: Arc<AtomicU64>,
}

/// The keeper's end of the command queue, taken by [`Holds::spawn_keeper`].
pub struct ReleaseQueue(mpsc::UnboundedReceiver<Command>);

/// What the keeper is told.
#[derive(Debug)]
pub enum Command {
    /// Renew `hold` at half its lease, at the lease's current epoch, until untracked.
    Track {
        key: u64,
        hold: Hold,
        epoch: Arc<AtomicU64>,
    },
    /// Stop renewing; release the hold (the router's backstop).
    Release { key: u64 },
}

/// A request's claim on a hold: renewed by the keeper while it lives, released
/// when it drops (however the request ended: finished, failed, or its client
/// went away). The decoder releases the hold too on a normal finish; release is
/// idempotent.
#[derive(Debug)]
pub struct HoldLease {
    hold: Hold,
    key: u64,
    epoch: Arc<AtomicU64>,
    commands: mpsc::UnboundedSender<Command>,
}

impl HoldLease {
    pub fn hold(&self) -> &Hold {
        &self.hold
    }

    /// The resume epoch renewals use from now on.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }
}

impl Drop for HoldLease {
    fn drop(&mut self) {
        // The queue only closes when the router stops; a release then is moot
        // (the hold expires by its lease).
        let _ = self.commands.send(Command::Release { key: self.key });
    }
}

impl Holds {
    pub fn new(ctrl_timeout: Duration, secret: Option<Secret>) -> (Self, ReleaseQueue) {
        let (commands, queue) = mpsc::unbounded_channel();
        let ctrl = CtrlClient::with_config(connex_transfer::ClientConfig {
            connect_timeout: ctrl_timeout,
            io_timeout: ctrl_timeout,
            secret,
            ..Default::default()
        });
        let holds = Self {
            ctrl,
            commands,
            next_key: Arc::new(AtomicU64::new(0)),
        };
        (holds, ReleaseQueue(queue))
    }

    /// Leases `hold` for a request at resume `epoch`.
    pub fn lease(&self, hold: Hold, epoch: u64) -> HoldLease {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let epoch = Arc::new(AtomicU64::new(epoch));
        let _ = self.commands.send(Command::Track {
            key,
            hold: hold.clone(),
            epoch: epoch.clone(),
        });
        HoldLease {
            hold,
            key,
            epoch,
            commands: self.commands.clone(),
        }
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
        tasks: &mut JoinSet<()>,
        shutdown: CancellationToken,
    ) {
        tasks.spawn(keep(self.ctrl.clone(), queue.0, shutdown));
    }
}

/// Most release or renew calls in flight at once.
const MAX_CALLS: usize = 64;

/// A leased hold the keeper renews.
struct Tracked {
    hold: Hold,
    epoch: Arc<AtomicU64>,
    /// When the next renewal is due (its key in the schedule), `None` while one
    /// is in flight.
    due: Option<Instant>,
}

/// The leased holds and when each is next renewed: the keeper wakes at the
/// earliest renewal instead of scanning every request.
#[derive(Default)]
struct Schedule {
    tracked: HashMap<u64, Tracked>,
    order: BTreeSet<(Instant, u64)>,
}

impl Schedule {
    fn track(&mut self, key: u64, hold: Hold, epoch: Arc<AtomicU64>, now: Instant) {
        let due = now + hold.lease / 2;
        self.order.insert((due, key));
        self.tracked.insert(
            key,
            Tracked {
                hold,
                epoch,
                due: Some(due),
            },
        );
    }

    fn untrack(&mut self, key: u64) -> Option<Hold> {
        let tracked = self.tracked.remove(&key)?;
        if let Some(due) = tracked.due {
            self.order.remove(&(due, key));
        }
        Some(tracked.hold)
    }

    fn next_due(&self) -> Option<Instant> {
        self.order.first().map(|(due, _)| *due)
    }

    /// The holds due at `now`, with their epochs; marked in flight.
    fn take_due(&mut self, now: Instant, most: usize) -> Vec<(u64, Hold, u32)> {
        let mut out = Vec::new();
        while out.len() < most {
            let Some(&(due, key)) = self.order.first() else {
                break;
            };
            if due > now {
                break;
            }
            self.order.remove(&(due, key));
            if let Some(tracked) = self.tracked.get_mut(&key) {
                tracked.due = None;
                let epoch =
                    u32::try_from(tracked.epoch.load(Ordering::Relaxed)).unwrap_or(u32::MAX);
                out.push((key, tracked.hold.clone(), epoch));
            }
        }
        out
    }

    /// A renewal ended: the next one at half the lease after a success, sooner
    /// after a failure; none once the hold is gone.
    fn renewed(&mut self, key: u64, outcome: Renewal, now: Instant) {
        let Some(tracked) = self.tracked.get_mut(&key) else {
            return;
        };
        let after = match outcome {
            Renewal::Renewed => tracked.hold.lease / 2,
            Renewal::Failed => (tracked.hold.lease / 8).min(Duration::from_secs(1)),
            Renewal::Gone => return,
        };
        let due = now + after;
        tracked.due = Some(due);
        self.order.insert((due, key));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renewal {
    Renewed,
    Failed,
    Gone,
}

async fn keep(
    ctrl: CtrlClient,
    mut queue: mpsc::UnboundedReceiver<Command>,
    shutdown: CancellationToken,
) {
    let mut calls: JoinSet<Option<(u64, Renewal)>> = JoinSet::new();
    let mut schedule = Schedule::default();
    loop {
        let wake = schedule.next_due();
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(command) = queue.recv() => match command {
                Command::Track { key, hold, epoch } => {
                    schedule.track(key, hold, epoch, Instant::now());
                }
                Command::Release { key } => {
                    if let Some(hold) = schedule.untrack(key) {
                        if calls.len() >= MAX_CALLS {
                            apply(&mut schedule, calls.join_next().await);
                        }
                        let ctrl = ctrl.clone();
                        calls.spawn(async move {
                            release(ctrl, hold).await;
                            None
                        });
                    }
                }
            },
            _ = sleep_until(wake), if wake.is_some() => {
                let now = Instant::now();
                let room = MAX_CALLS.saturating_sub(calls.len()).max(1);
                for (key, hold, epoch) in schedule.take_due(now, room) {
                    let ctrl = ctrl.clone();
                    calls.spawn(async move { Some((key, renew(ctrl, hold, epoch).await)) });
                }
            }
            Some(done) = calls.join_next(), if !calls.is_empty() => apply(&mut schedule, Some(done)),
        }
    }
    // Releases queued before the stop still go out, bounded by the client's timeouts.
    queue.close();
    while let Some(command) = queue.recv().await {
        if let Command::Release { key } = command {
            if let Some(hold) = schedule.untrack(key) {
                let ctrl = ctrl.clone();
                calls.spawn(async move {
                    release(ctrl, hold).await;
                    None
                });
            }
        }
    }
    while calls.join_next().await.is_some() {}
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at.into()).await;
    }
}

fn apply(
    schedule: &mut Schedule,
    done: Option<Result<Option<(u64, Renewal)>, tokio::task::JoinError>>,
) {
    if let Some(Ok(Some((key, outcome)))) = done {
        schedule.renewed(key, outcome, Instant::now());
    }
}

/// Waits before each retry of a release: a holder busy under load (its
/// accept backlog full, a call past the control timeout) gets a few chances
/// over ~2 s; after that the hold's lease frees it anyway.
const RELEASE_BACKOFF: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_millis(1500),
];

async fn release(ctrl: CtrlClient, hold: Hold) {
    let mut backoff = RELEASE_BACKOFF.iter();
    loop {
        match ctrl.release(&hold.ctrl, &hold.transfer_id).await {
            Ok(was_held) => {
                crate::metrics::hold_released(if was_held { "released" } else { "gone" });
                return;
            }
            Err(err) => match backoff.next() {
                // A refused connection: the holder is gone, and its holds with it.
                Some(wait) if !is_refused(&err) => tokio::time::sleep(*wait).await,
                _ => {
                    tracing::debug!(transfer_id = %hold.transfer_id, %err, "hold release failed");
                    crate::metrics::hold_released("failed");
                    return;
                }
            },
        }
    }
}

fn is_refused(err: &TransferError) -> bool {
    matches!(err, TransferError::Unreachable { source, .. }
        if source.kind() == std::io::ErrorKind::ConnectionRefused)
}

async fn renew(ctrl: CtrlClient, hold: Hold, epoch: u32) -> Renewal {
    match ctrl.renew(&hold.ctrl, &hold.transfer_id, epoch).await {
        Ok(_) => {
            crate::metrics::hold_renewed("renewed");
            Renewal::Renewed
        }
        Err(err) => {
            tracing::debug!(transfer_id = %hold.transfer_id, %err, "hold renew failed");
            if err.is_hold_lost() {
                crate::metrics::hold_renewed("gone");
                Renewal::Gone
            } else {
                crate::metrics::hold_renewed("failed");
                Renewal::Failed
            }
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

    fn hold(lease_s: u64) -> Hold {
        Hold {
            ctrl: "127.0.0.1:9".into(),
            transfer_id: "t".into(),
            lease: Duration::from_secs(lease_s),
        }
    }

    #[test]
    fn renewals_are_due_at_half_the_lease_and_rescheduled_only_on_success() {
        let mut schedule = Schedule::default();
        let now = Instant::now();
        let epoch = Arc::new(AtomicU64::new(2));
        schedule.track(1, hold(10), epoch.clone(), now);
        assert_eq!(schedule.next_due(), Some(now + Duration::from_secs(5)));
        assert!(schedule.take_due(now, 8).is_empty());
        epoch.store(3, Ordering::Relaxed);
        let due = schedule.take_due(now + Duration::from_secs(5), 8);
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].2, 3, "renewed at the lease's current epoch");
        // In flight: not due again until its outcome is known.
        assert_eq!(schedule.next_due(), None);
        let later = now + Duration::from_secs(6);
        schedule.renewed(1, Renewal::Failed, later);
        assert_eq!(schedule.next_due(), Some(later + Duration::from_secs(1)));
        schedule.take_due(later + Duration::from_secs(1), 8);
        schedule.renewed(1, Renewal::Renewed, later);
        assert_eq!(schedule.next_due(), Some(later + Duration::from_secs(5)));
        assert!(schedule.untrack(1).is_some());
        assert_eq!(schedule.next_due(), None);
        schedule.track(2, hold(10), epoch, now);
        schedule.take_due(now + Duration::from_secs(5), 8);
        schedule.renewed(2, Renewal::Gone, later);
        assert_eq!(
            schedule.next_due(),
            None,
            "a gone hold is not renewed again"
        );
    }
}
