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
//!
//! Bounds (docs/security.md, "Hold calls"): the command queue is bounded and a
//! request never waits on it; each holder has its own few calls in flight and
//! its own queue of waiting work, each call a time limit, and a renewal is not
//! retried past its hold's expiry. So a holder that accepts connections and
//! never answers costs only its own holds, never another holder's renewals.

use connex_transfer::proto::MAX_RELEASE_BATCH;
use connex_transfer::{CtrlClient, Secret, TransferError};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// A transfer id the control protocol refuses (too long, not printable
    /// ASCII) names no hold either: no holder could renew or release it, and
    /// in a batch of releases it would spoil the others.
    pub fn from_params(kv: &Value) -> Option<Self> {
        let text = |key| kv.get(key).and_then(Value::as_str).map(str::to_string);
        Some(Self {
            ctrl: text("remote_ctrl")?,
            transfer_id: text("transfer_id")
                .filter(|id| connex_transfer::proto::check_transfer_id(id).is_ok())?,
            lease: Duration::from_secs_f64(
                kv.get("lease_s")
                    .and_then(Value::as_f64)
                    .unwrap_or(60.0)
                    .clamp(MIN_LEASE_S, MAX_LEASE_S),
            ),
        })
    }
}

/// The shortest lease the keeper believes. A hold is renewed at half its
/// lease (and retried at an eighth after a failure), so a prefill answering
/// `lease_s: 1e-300` would have the keeper renew it in a tight loop; a
/// hold shorter than this could not last through a resume's check and pull
/// anyway.
const MIN_LEASE_S: f64 = 1.0;
/// The longest: a day.
const MAX_LEASE_S: f64 = 86_400.0;

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
    commands: mpsc::Sender<KeeperCommand>,
    next_key: Arc<AtomicU64>,
    limits: CallLimits,
}

/// The keeper's end of the command queue, taken by [`Holds::spawn_keeper`].
pub struct ReleaseQueue(mpsc::Receiver<KeeperCommand>);

/// Commands queued for the keeper at most (about 100 bytes each). The keeper
/// never waits on a holder while it takes commands, so the queue only fills
/// when requests end faster than one task files them; then a request does not
/// wait for room either: see [`Holds::lease`] and [`HoldLease`]'s drop for
/// what is given up instead.
const COMMAND_QUEUE: usize = 65_536;

/// What the keeper is told.
#[derive(Debug)]
enum KeeperCommand {
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
struct LeaseState {
    /// The resume epoch renewals use.
    epoch: AtomicU64,
    /// Set when the lease drops. The keeper looks at it before each renewal,
    /// so a hold whose `Release` found the queue full is still released, at
    /// its next due renewal (within half its lease), instead of being renewed
    /// for ever.
    dropped: AtomicBool,
}

/// A request's claim on a hold: renewed by the keeper while it lives, released
/// when it drops (however the request ended: finished, failed, or its client
/// went away). The decoder releases the hold too on a normal finish; release is
/// idempotent.
#[derive(Debug)]
pub struct HoldLease {
    hold: Hold,
    key: u64,
    state: Arc<LeaseState>,
    commands: mpsc::Sender<KeeperCommand>,
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

impl Holds {
    pub fn new(ctrl_timeout: Duration, secret: Option<Secret>) -> (Self, ReleaseQueue) {
        Self::with_queue(ctrl_timeout, secret, COMMAND_QUEUE)
    }

    fn with_queue(
        ctrl_timeout: Duration,
        secret: Option<Secret>,
        queue: usize,
    ) -> (Self, ReleaseQueue) {
        let (commands, queue) = mpsc::channel(queue);
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
            limits: CallLimits::new(ctrl_timeout),
        };
        (holds, ReleaseQueue(queue))
    }

    /// The same holds, their control calls resolving holder addresses with
    /// `resolver` (the router's checks them against `--allowed-upstreams` at
    /// every connect). Call before the keeper starts.
    pub fn resolving_with(self, resolver: connex_transfer::Resolver) -> Self {
        let config = connex_transfer::ClientConfig {
            resolver: Some(resolver),
            ..self.ctrl.config().clone()
        };
        Self {
            ctrl: CtrlClient::with_config(config),
            ..self
        }
    }

    /// Leases `hold` for a request at resume `epoch`. Never waits: with the
    /// keeper's queue full the hold is not tracked (counted as `untracked` in
    /// `connex_holds_renewed_total`), so the router neither renews nor
    /// releases it; the decoder releases it on a normal finish and its lease
    /// frees it otherwise.
    pub fn lease(&self, hold: Hold, epoch: u64) -> HoldLease {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(LeaseState {
            epoch: AtomicU64::new(epoch),
            dropped: AtomicBool::new(false),
        });
        let track = KeeperCommand::Track {
            key,
            hold: hold.clone(),
            lease: state.clone(),
        };
        if let Err(mpsc::error::TrySendError::Full(_)) = self.commands.try_send(track) {
            tracing::debug!(transfer_id = %hold.transfer_id, "hold keeper's queue full: hold not tracked");
            crate::observe::metrics::hold_renewed("untracked");
        }
        HoldLease {
            hold,
            key,
            state,
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
    /// the releases already queued (for at most one release's time limit).
    pub fn spawn_keeper(
        &self,
        queue: ReleaseQueue,
        tasks: &mut JoinSet<()>,
        shutdown: CancellationToken,
    ) {
        let keeper = Keeper::new(self.ctrl.clone(), self.limits);
        tasks.spawn(keeper.run(queue.0, shutdown));
    }
}

/// Most calls in flight to one holder at once (renewals and releases
/// together). Each holder has its own: a holder that accepts connections and
/// never answers ties up only its own calls, never another holder's renewals.
/// Holders are the registered prefills' control addresses (a prefill answer
/// naming another is refused), so at most `--max-instances` times this many
/// calls run at once.
const MAX_CALLS_PER_HOLDER: usize = 8;

/// Most release batches (of up to [`MAX_RELEASE_BATCH`] holds each) waiting
/// for one holder behind its calls in flight. Past it the oldest batch is
/// given up (counted as `dropped`): its holds expire by their leases.
const MAX_WAITING_RELEASE_BATCHES: usize = 16;

/// Most queued commands or due renewals the keeper takes in one turn before it
/// looks at its timers and finished calls again.
const MAX_COMMANDS_AT_ONCE: usize = 256;

/// How long a release waits for others to the same holder: the requests that
/// end within it cost their holder one `ReleaseMany` call instead of one call
/// each (at a few thousand requests a second, one call in ~20). The router's
/// release is a backstop (the decoder releases the hold on a normal finish,
/// the lease frees it otherwise), so a few ms later costs nothing.
const RELEASE_LINGER: Duration = Duration::from_millis(5);

/// Waits before each retry of a release: a holder busy under load (its
/// accept backlog full, a call past the control timeout) gets a few chances
/// over ~2 s; after that the hold's lease frees it anyway.
const RELEASE_BACKOFF: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_millis(1500),
];

/// Time limits of the keeper's calls, from `--ctrl-timeout` (which the
/// control client applies to each connect, read and write on its own, so a
/// call of several steps could otherwise last several times it).
#[derive(Debug, Clone, Copy)]
struct CallLimits {
    /// One request: a connect and three exchanges (a new connection's two
    /// handshake exchanges, then the request). A renewal also ends at its
    /// hold's expiry, after which it is of no use.
    attempt: Duration,
    /// One release, its retries and their waits included.
    release: Duration,
}

impl CallLimits {
    fn new(ctrl_timeout: Duration) -> Self {
        let attempt = ctrl_timeout.saturating_mul(4);
        let waits: Duration = RELEASE_BACKOFF.iter().sum();
        Self {
            attempt,
            release: attempt.saturating_mul(2).saturating_add(waits),
        }
    }
}

/// Releases waiting to go out, by holder (its control address).
#[derive(Default)]
struct Releases {
    waiting: HashMap<String, Vec<String>>,
    /// When the oldest waiting release goes out.
    due: Option<Instant>,
}

impl Releases {
    /// Queues `hold`'s release; a holder's batch that is full comes back, to
    /// go out now.
    fn add(&mut self, hold: Hold, now: Instant) -> Option<(String, Vec<String>)> {
        self.due.get_or_insert(now + RELEASE_LINGER);
        let ids = match self.waiting.get_mut(&hold.ctrl) {
            Some(ids) => ids,
            None => self.waiting.entry(hold.ctrl.clone()).or_default(),
        };
        ids.push(hold.transfer_id);
        if ids.len() < MAX_RELEASE_BATCH {
            return None;
        }
        let ids = self.waiting.remove(&hold.ctrl).unwrap_or_default();
        if self.waiting.is_empty() {
            self.due = None;
        }
        Some((hold.ctrl, ids))
    }

    /// Every waiting batch, by holder; nothing waits after.
    fn take_all(&mut self) -> Vec<(String, Vec<String>)> {
        self.due = None;
        self.waiting.drain().collect()
    }
}

/// A leased hold the keeper renews.
struct Tracked {
    hold: Hold,
    lease: Arc<LeaseState>,
    /// When the next renewal is due (its key in the schedule), `None` while one
    /// is waiting for its holder or in flight, or once renewing has stopped.
    due: Option<Instant>,
    /// When the hold lapses unless renewed: its lease from when it was taken
    /// or from the start of its last successful renewal.
    expires: Instant,
}

/// What to do with a renewal whose turn has come.
#[derive(Debug)]
enum Turn {
    /// Renew it, for at most `limit`.
    Renew {
        hold: Hold,
        epoch: u32,
        limit: Duration,
    },
    /// Its lease dropped meanwhile: release it instead.
    Release(Hold),
    /// It lapsed before a renewal could go through: renewing stops.
    Expired,
    /// Released meanwhile.
    Untracked,
}

/// The leased holds and when each is next renewed: the keeper wakes at the
/// earliest renewal instead of scanning every request.
#[derive(Default)]
struct Schedule {
    tracked: HashMap<u64, Tracked>,
    order: BTreeSet<(Instant, u64)>,
}

impl Schedule {
    fn track(&mut self, key: u64, hold: Hold, lease: Arc<LeaseState>, now: Instant) {
        let due = now + hold.lease / 2;
        self.order.insert((due, key));
        let expires = now + hold.lease;
        self.tracked.insert(
            key,
            Tracked {
                hold,
                lease,
                due: Some(due),
                expires,
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

    /// The holds due at `now`, with their holders; no longer due until
    /// [`Schedule::renewed`].
    fn take_due(&mut self, now: Instant, most: usize) -> Vec<(u64, String)> {
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
                out.push((key, tracked.hold.ctrl.clone()));
            }
        }
        out
    }

    /// The renewal of `key` may start: what it does, at the lease's current
    /// epoch, bounded by `attempt` and by the hold's expiry.
    fn turn(&mut self, key: u64, now: Instant, attempt: Duration) -> Turn {
        let Some(tracked) = self.tracked.get(&key) else {
            return Turn::Untracked;
        };
        if tracked.lease.dropped.load(Ordering::Relaxed) {
            return self.untrack(key).map_or(Turn::Untracked, Turn::Release);
        }
        let left = tracked.expires.saturating_duration_since(now);
        if left.is_zero() {
            return Turn::Expired;
        }
        let epoch = u32::try_from(tracked.lease.epoch.load(Ordering::Relaxed)).unwrap_or(u32::MAX);
        Turn::Renew {
            hold: tracked.hold.clone(),
            epoch,
            limit: attempt.min(left),
        }
    }

    /// A renewal started at `started` ended at `now`: the next one at half
    /// the lease after a success, sooner after a failure while the hold can
    /// still be alive; none once the hold is gone or has lapsed.
    fn renewed(&mut self, key: u64, outcome: Renewal, started: Instant, now: Instant) {
        let Some(tracked) = self.tracked.get_mut(&key) else {
            return;
        };
        let due = match outcome {
            Renewal::Renewed => {
                tracked.expires = started + tracked.hold.lease;
                now + tracked.hold.lease / 2
            }
            Renewal::Failed => {
                let due = now + (tracked.hold.lease / 8).min(Duration::from_secs(1));
                if due >= tracked.expires {
                    // Retrying past the hold's own expiry renews nothing and
                    // keeps one of its holder's call slots busy.
                    crate::observe::metrics::hold_renewed("expired");
                    return;
                }
                due
            }
            Renewal::Gone => return,
        };
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

/// One holder's calls: how many are in flight, and the work waiting for a
/// free call (renewals first: a late renewal loses a hold, a late release
/// only frees it later).
#[derive(Default)]
struct HolderCalls {
    in_flight: usize,
    renewals: VecDeque<u64>,
    releases: VecDeque<Vec<String>>,
}

impl HolderCalls {
    fn idle(&self) -> bool {
        self.in_flight == 0 && self.renewals.is_empty() && self.releases.is_empty()
    }
}

/// What a finished call reports: a renewal its key, outcome and start; a
/// release nothing.
type CallDone = Option<(u64, Renewal, Instant)>;

/// The keeper task's state: the renewal schedule, the releases waiting for
/// their batch, and each holder's calls. Its loop never waits on a call: a
/// holder that never answers delays only its own calls.
struct Keeper {
    ctrl: CtrlClient,
    limits: CallLimits,
    calls: JoinSet<CallDone>,
    /// The holder of each call in flight (a call that panicked still frees
    /// its holder's slot).
    call_holders: HashMap<tokio::task::Id, String>,
    holders: HashMap<String, HolderCalls>,
    schedule: Schedule,
    releases: Releases,
    /// Stopping: releases still go out, renewals no longer do.
    stopping: bool,
}

impl Keeper {
    fn new(ctrl: CtrlClient, limits: CallLimits) -> Self {
        Self {
            ctrl,
            limits,
            calls: JoinSet::new(),
            call_holders: HashMap::new(),
            holders: HashMap::new(),
            schedule: Schedule::default(),
            releases: Releases::default(),
            stopping: false,
        }
    }

    async fn run(mut self, mut queue: mpsc::Receiver<KeeperCommand>, shutdown: CancellationToken) {
        loop {
            let wake = self.schedule.next_due();
            let flush = self.releases.due;
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(command) = queue.recv() => {
                    // With the ones already queued (a bounded number): the
                    // releases of requests that ended together join one batch.
                    self.command(command);
                    for _ in 1..MAX_COMMANDS_AT_ONCE {
                        let Ok(command) = queue.try_recv() else { break };
                        self.command(command);
                    }
                }
                _ = sleep_until(flush), if flush.is_some() => self.flush(),
                _ = sleep_until(wake), if wake.is_some() => self.renew_due(),
                Some(done) = self.calls.join_next_with_id(), if !self.calls.is_empty() => {
                    self.finished(done);
                }
            }
        }
        self.stop(queue).await;
    }

    /// Releases queued before the stop still go out, for at most one
    /// release's time limit (a lease taken meanwhile is tracked, so that its
    /// release is too); calls still running then are dropped, and the leases
    /// free their holds.
    async fn stop(mut self, mut queue: mpsc::Receiver<KeeperCommand>) {
        self.stopping = true;
        queue.close();
        while let Ok(command) = queue.try_recv() {
            self.command(command);
        }
        self.flush();
        for holder in self.holders.values_mut() {
            holder.renewals.clear();
        }
        let limit = self.limits.release;
        let drain = async {
            while let Some(done) = self.calls.join_next_with_id().await {
                self.finished(done);
            }
        };
        if tokio::time::timeout(limit, drain).await.is_err() {
            tracing::debug!("hold releases still unanswered at the stop are given up");
        }
    }

    fn command(&mut self, command: KeeperCommand) {
        match command {
            KeeperCommand::Track { key, hold, lease } => {
                self.schedule.track(key, hold, lease, Instant::now());
            }
            KeeperCommand::Release { key } => {
                if let Some(hold) = self.schedule.untrack(key) {
                    self.release_later(hold);
                }
            }
        }
    }

    /// Queues `hold`'s release into its holder's next batch.
    fn release_later(&mut self, hold: Hold) {
        if let Some(batch) = self.releases.add(hold, Instant::now()) {
            self.queue_release(batch);
        }
    }

    /// Sends every waiting release batch (as its holder has room).
    fn flush(&mut self) {
        for batch in self.releases.take_all() {
            self.queue_release(batch);
        }
    }

    /// Queues the renewals that are due on their holders, a bounded number a
    /// turn (the rest are still due at the next).
    fn renew_due(&mut self) {
        let due = self.schedule.take_due(Instant::now(), MAX_COMMANDS_AT_ONCE);
        let mut touched = BTreeSet::new();
        for (key, holder) in due {
            self.holders
                .entry(holder.clone())
                .or_default()
                .renewals
                .push_back(key);
            touched.insert(holder);
        }
        for holder in touched {
            self.pump(&holder);
        }
    }

    /// Queues one holder's batch of releases: joined to the last batch waiting
    /// for that holder while it has room, the oldest given up past
    /// [`MAX_WAITING_RELEASE_BATCHES`].
    fn queue_release(&mut self, (holder, ids): (String, Vec<String>)) {
        let calls = self.holders.entry(holder.clone()).or_default();
        match calls.releases.back_mut() {
            Some(last) if last.len() + ids.len() <= MAX_RELEASE_BATCH => last.extend(ids),
            _ => calls.releases.push_back(ids),
        }
        while calls.releases.len() > MAX_WAITING_RELEASE_BATCHES {
            let Some(given_up) = calls.releases.pop_front() else {
                break;
            };
            tracing::debug!(%holder, holds = given_up.len(), "too many releases waiting for this holder: their leases free them");
            for _ in &given_up {
                crate::observe::metrics::hold_released("dropped");
            }
        }
        self.pump(&holder);
    }

    /// Starts `holder`'s waiting work while it has fewer than
    /// [`MAX_CALLS_PER_HOLDER`] calls in flight.
    fn pump(&mut self, holder: &str) {
        let now = Instant::now();
        let mut released = Vec::new();
        loop {
            let Some(calls) = self.holders.get_mut(holder) else {
                return;
            };
            if calls.in_flight >= MAX_CALLS_PER_HOLDER {
                break;
            }
            if let Some(key) = calls.renewals.pop_front().filter(|_| !self.stopping) {
                match self.schedule.turn(key, now, self.limits.attempt) {
                    Turn::Renew { hold, epoch, limit } => {
                        let ctrl = self.ctrl.clone();
                        self.spawn(holder, async move {
                            let started = Instant::now();
                            Some((key, renew(ctrl, hold, epoch, limit).await, started))
                        });
                    }
                    Turn::Release(hold) => released.push(hold),
                    Turn::Expired => crate::observe::metrics::hold_renewed("expired"),
                    Turn::Untracked => {}
                }
            } else if let Some(ids) = calls.releases.pop_front() {
                let (ctrl, holder_addr, limits) =
                    (self.ctrl.clone(), holder.to_string(), self.limits);
                self.spawn(holder, async move {
                    release(ctrl, holder_addr, ids, limits).await;
                    None
                });
            } else {
                break;
            }
        }
        if self.holders.get(holder).is_some_and(HolderCalls::idle) {
            self.holders.remove(holder);
        }
        for hold in released {
            self.release_later(hold);
        }
    }

    fn spawn(
        &mut self,
        holder: &str,
        call: impl std::future::Future<Output = CallDone> + Send + 'static,
    ) {
        let id = self.calls.spawn(call).id();
        self.call_holders.insert(id, holder.to_string());
        self.holders
            .entry(holder.to_string())
            .or_default()
            .in_flight += 1;
    }

    /// A call ended: its renewal's outcome goes into the schedule, and its
    /// holder's slot to the work waiting for it.
    fn finished(&mut self, done: Result<(tokio::task::Id, CallDone), tokio::task::JoinError>) {
        let id = match done {
            Ok((id, Some((key, outcome, started)))) => {
                self.schedule.renewed(key, outcome, started, Instant::now());
                id
            }
            Ok((id, None)) => id,
            Err(err) => {
                tracing::warn!(%err, "hold call ended abnormally");
                err.id()
            }
        };
        let Some(holder) = self.call_holders.remove(&id) else {
            return;
        };
        if let Some(calls) = self.holders.get_mut(&holder) {
            calls.in_flight = calls.in_flight.saturating_sub(1);
        }
        self.pump(&holder);
    }
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at.into()).await;
    }
}

/// Releases the holds `ids` on `holder`: in one `ReleaseMany` call, or one
/// by one for a single hold or a holder that predates the op; all within
/// `limits.release`.
async fn release(ctrl: CtrlClient, holder: String, ids: Vec<String>, limits: CallLimits) {
    let deadline = Instant::now() + limits.release;
    if ids.len() > 1 {
        match with_backoff(deadline, limits.attempt, || {
            ctrl.release_many(&holder, &ids)
        })
        .await
        {
            Ok(were) => {
                for was in were {
                    count_release(&holder, Ok(was));
                }
                return;
            }
            Err(err) if err.is_unknown_op() => {
                tracing::debug!(%holder, "the holder has no ReleaseMany: releasing one by one");
            }
            Err(err) => {
                for _ in &ids {
                    count_release(&holder, Err(&err));
                }
                return;
            }
        }
    }
    for id in &ids {
        let outcome = with_backoff(deadline, limits.attempt, || ctrl.release(&holder, id)).await;
        count_release(&holder, outcome.as_ref().map(|was| *was));
    }
}

/// A release call, each try bounded by `attempt`, tried again after
/// [`RELEASE_BACKOFF`]'s waits while it fails for a reason that may pass: not
/// a refused connection (the holder is gone, and its holds with it), not an op
/// the holder does not know; nothing starts or waits past `deadline`.
async fn with_backoff<T, F, Fut>(
    deadline: Instant,
    attempt: Duration,
    mut call: F,
) -> Result<T, TransferError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TransferError>>,
{
    let mut backoff = RELEASE_BACKOFF.iter();
    loop {
        let limit = attempt.min(deadline.saturating_duration_since(Instant::now()));
        let outcome = match tokio::time::timeout(limit, call()).await {
            Ok(outcome) => outcome,
            Err(_) => Err(TransferError::Timeout {
                what: "releasing holds",
                after: limit,
            }),
        };
        match outcome {
            Err(err) if !is_refused(&err) && !err.is_unknown_op() => match backoff.next() {
                Some(wait) if Instant::now() + *wait < deadline => {
                    tokio::time::sleep(*wait).await;
                }
                _ => return Err(err),
            },
            outcome => return outcome,
        }
    }
}

/// One hold's release outcome, in `connex_holds_released_total`.
fn count_release(holder: &str, outcome: Result<bool, &TransferError>) {
    match outcome {
        Ok(was_held) => {
            crate::observe::metrics::hold_released(if was_held { "released" } else { "gone" });
        }
        Err(err) => {
            tracing::debug!(%holder, %err, "hold release failed");
            crate::observe::metrics::hold_released("failed");
        }
    }
}

/// A refused connection, or an address the upstream policy refuses: no
/// retry would go through.
fn is_refused(err: &TransferError) -> bool {
    use std::io::ErrorKind::{ConnectionRefused, PermissionDenied};
    matches!(err, TransferError::Unreachable { source, .. }
        if matches!(source.kind(), ConnectionRefused | PermissionDenied))
}

/// Renews `hold` at `epoch`, giving up after `limit`.
async fn renew(ctrl: CtrlClient, hold: Hold, epoch: u32, limit: Duration) -> Renewal {
    let call = ctrl.renew(&hold.ctrl, &hold.transfer_id, epoch);
    let outcome = match tokio::time::timeout(limit, call).await {
        Ok(outcome) => outcome,
        Err(_) => Err(TransferError::Timeout {
            what: "renewing a hold",
            after: limit,
        }),
    };
    match outcome {
        Ok(_) => {
            crate::observe::metrics::hold_renewed("renewed");
            Renewal::Renewed
        }
        Err(err) => {
            tracing::debug!(transfer_id = %hold.transfer_id, %err, "hold renew failed");
            if err.is_hold_lost() {
                crate::observe::metrics::hold_renewed("gone");
                Renewal::Gone
            } else {
                crate::observe::metrics::hold_renewed("failed");
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
        for bad in ["", "has space", "é"] {
            let kv = json!({"remote_ctrl":"127.0.0.1:9","transfer_id":bad});
            assert_eq!(Hold::from_params(&kv), None, "{bad:?}");
        }
    }

    fn hold(lease_s: u64) -> Hold {
        Hold {
            ctrl: "127.0.0.1:9".into(),
            transfer_id: "t".into(),
            lease: Duration::from_secs(lease_s),
        }
    }

    fn lease_state(epoch: u64) -> Arc<LeaseState> {
        Arc::new(LeaseState {
            epoch: AtomicU64::new(epoch),
            dropped: AtomicBool::new(false),
        })
    }

    /// The epoch a due renewal of `key` would use.
    fn renew_epoch(schedule: &mut Schedule, key: u64, now: Instant) -> u32 {
        match schedule.turn(key, now, Duration::from_secs(1)) {
            Turn::Renew { epoch, .. } => epoch,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn renewals_are_due_at_half_the_lease_and_rescheduled_only_on_success() {
        let mut schedule = Schedule::default();
        let now = Instant::now();
        let lease = lease_state(2);
        schedule.track(1, hold(10), lease.clone(), now);
        assert_eq!(schedule.next_due(), Some(now + Duration::from_secs(5)));
        assert!(schedule.take_due(now, 8).is_empty());
        lease.epoch.store(3, Ordering::Relaxed);
        let due = schedule.take_due(now + Duration::from_secs(5), 8);
        assert_eq!(due, vec![(1, "127.0.0.1:9".to_string())]);
        assert_eq!(
            renew_epoch(&mut schedule, 1, now + Duration::from_secs(5)),
            3,
            "renewed at the lease's current epoch"
        );
        // In flight: not due again until its outcome is known.
        assert_eq!(schedule.next_due(), None);
        let later = now + Duration::from_secs(6);
        schedule.renewed(1, Renewal::Failed, later, later);
        assert_eq!(schedule.next_due(), Some(later + Duration::from_secs(1)));
        schedule.take_due(later + Duration::from_secs(1), 8);
        schedule.renewed(1, Renewal::Renewed, later, later);
        assert_eq!(schedule.next_due(), Some(later + Duration::from_secs(5)));
        assert!(schedule.untrack(1).is_some());
        assert_eq!(schedule.next_due(), None);
        schedule.track(2, hold(10), lease_state(0), now);
        schedule.take_due(now + Duration::from_secs(5), 8);
        schedule.renewed(2, Renewal::Gone, later, later);
        assert_eq!(
            schedule.next_due(),
            None,
            "a gone hold is not renewed again"
        );
    }

    #[test]
    fn a_failing_renewal_is_not_retried_past_its_holds_expiry() {
        let mut schedule = Schedule::default();
        let now = Instant::now();
        schedule.track(1, hold(10), lease_state(0), now);
        // Renewed at 5 s: the hold now lives until 15 s.
        let at = now + Duration::from_secs(5);
        schedule.take_due(at, 8);
        schedule.renewed(1, Renewal::Renewed, at, at);
        // Every retry fails, a second apart, until the next would be late.
        let mut at = now + Duration::from_secs(10);
        let mut tries = 0;
        while let Some(due) = schedule.next_due() {
            at = at.max(due);
            assert_eq!(schedule.take_due(at, 8).len(), 1);
            assert!(
                matches!(schedule.turn(1, at, Duration::from_secs(60)),
                Turn::Renew { limit, .. } if limit <= Duration::from_secs(5)),
                "a try never outlives the hold"
            );
            schedule.renewed(1, Renewal::Failed, at, at);
            tries += 1;
        }
        assert_eq!(tries, 5, "from 10 s to 14 s, then no more");
        assert!(
            matches!(
                schedule.turn(1, now + Duration::from_secs(15), Duration::from_secs(1)),
                Turn::Expired
            ),
            "a turn after the expiry renews nothing"
        );
    }

    #[test]
    fn a_lease_claimed_absurdly_short_is_renewed_no_faster_than_a_second_allows() {
        let kv = json!({"remote_ctrl":"127.0.0.1:9","transfer_id":"t","lease_s":1e-300});
        let hold = Hold::from_params(&kv).expect("a hold");
        assert_eq!(hold.lease, Duration::from_secs(1));
        let mut schedule = Schedule::default();
        let now = Instant::now();
        schedule.track(1, hold, lease_state(0), now);
        assert_eq!(schedule.next_due(), Some(now + Duration::from_millis(500)));
    }

    #[test]
    fn releases_wait_by_holder_and_a_full_batch_goes_at_once() {
        let mut releases = Releases::default();
        let now = Instant::now();
        let on = |ctrl: &str, id: &str| Hold {
            ctrl: ctrl.into(),
            transfer_id: id.into(),
            lease: Duration::from_secs(10),
        };
        assert!(releases.add(on("a:1", "x"), now).is_none());
        let later = now + Duration::from_millis(3);
        assert!(releases.add(on("b:1", "y"), later).is_none());
        assert!(releases.add(on("a:1", "z"), later).is_none());
        assert_eq!(
            releases.due,
            Some(now + RELEASE_LINGER),
            "the oldest release sets the time"
        );
        let mut batches = releases.take_all();
        batches.sort();
        assert_eq!(
            batches,
            vec![
                ("a:1".to_string(), vec!["x".to_string(), "z".to_string()]),
                ("b:1".to_string(), vec!["y".to_string()]),
            ]
        );
        assert_eq!(releases.due, None);
        for i in 0..MAX_RELEASE_BATCH - 1 {
            assert!(releases.add(on("a:1", &i.to_string()), now).is_none());
        }
        let (holder, full) = releases.add(on("a:1", "last"), now).expect("full");
        assert_eq!((holder.as_str(), full.len()), ("a:1", MAX_RELEASE_BATCH));
        assert_eq!(releases.due, None, "nothing else waits");
    }

    /// A holder speaking the control protocol that records each request's op
    /// and ids; `knows_many`: whether it has `ReleaseMany` (older ones
    /// answer "unknown op").
    async fn recording_holder(
        knows_many: bool,
    ) -> (
        String,
        Arc<std::sync::Mutex<Vec<(u8, Vec<String>, Instant)>>>,
    ) {
        use connex_transfer::proto::{ErrorCode, Header, Reply, Request, HEADER_LEN};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let record = record.clone();
                tokio::spawn(async move {
                    let mut head = [0u8; HEADER_LEN];
                    while stream.read_exact(&mut head).await.is_ok() {
                        let header = Header::parse(&head).expect("header");
                        let mut payload = vec![0; header.len as usize];
                        stream.read_exact(&mut payload).await.expect("payload");
                        let request = Request::decode(header.op, &payload).expect("request");
                        let (ids, reply) = match request {
                            Request::Renew { id, epoch } => {
                                let info = connex_transfer::HoldInfo {
                                    transfer_id: id.clone(),
                                    blocks: 1,
                                    bytes: 1,
                                    expires_in_ms: 1_000,
                                    epoch,
                                    pulls: 0,
                                };
                                (vec![id], Reply::Hold(info))
                            }
                            Request::Release { id } => (vec![id], Reply::Released(true)),
                            Request::ReleaseMany { ids } if knows_many => {
                                let reply = Reply::ReleasedMany(vec![true; ids.len()]);
                                (ids, reply)
                            }
                            Request::ReleaseMany { ids } => (
                                ids,
                                Reply::error(ErrorCode::UnknownOp, "unknown request op 0x0b"),
                            ),
                            other => panic!("unexpected {other:?}"),
                        };
                        record
                            .lock()
                            .expect("record")
                            .push((header.op, ids, Instant::now()));
                        let frame = reply.encode(header.seq);
                        stream.write_all(&frame).await.expect("reply");
                    }
                });
            }
        });
        (addr, seen)
    }

    /// Leases `n` holds on `addr`, drops them together, and waits until the
    /// holder has seen `calls` requests.
    async fn release_together(
        addr: &str,
        n: usize,
        seen: &std::sync::Mutex<Vec<(u8, Vec<String>, Instant)>>,
        calls: usize,
    ) {
        let (holds, queue) = Holds::new(Duration::from_secs(2), None);
        let mut tasks = JoinSet::new();
        let shutdown = CancellationToken::new();
        holds.spawn_keeper(queue, &mut tasks, shutdown.clone());
        let leases: Vec<HoldLease> = (0..n)
            .map(|i| {
                let hold = Hold {
                    ctrl: addr.to_string(),
                    transfer_id: format!("t{i}"),
                    lease: Duration::from_secs(60),
                };
                holds.lease(hold, 0)
            })
            .collect();
        drop(leases);
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.lock().expect("seen").len() < calls {
            assert!(
                Instant::now() < deadline,
                "{:?}",
                seen.lock().expect("seen")
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        shutdown.cancel();
        while tasks.join_next().await.is_some() {}
    }

    #[tokio::test]
    async fn holds_released_together_go_to_their_holder_in_one_call() {
        let (addr, seen) = recording_holder(true).await;
        release_together(&addr, 3, &seen, 1).await;
        let seen = without_times(&seen);
        assert_eq!(
            seen,
            vec![(0x0B, vec!["t0".into(), "t1".into(), "t2".into()])]
        );
    }

    #[tokio::test]
    async fn a_holder_without_release_many_gets_each_release_alone() {
        let (addr, seen) = recording_holder(false).await;
        release_together(&addr, 3, &seen, 4).await;
        let seen = without_times(&seen);
        assert_eq!(seen[0].0, 0x0B, "the batch first");
        let singles: Vec<(u8, Vec<String>)> = ["t0", "t1", "t2"]
            .iter()
            .map(|id| (0x02, vec![id.to_string()]))
            .collect();
        assert_eq!(seen[1..], singles[..]);
    }

    fn without_times(
        seen: &std::sync::Mutex<Vec<(u8, Vec<String>, Instant)>>,
    ) -> Vec<(u8, Vec<String>)> {
        let seen = seen.lock().expect("seen");
        seen.iter().map(|(op, ids, _)| (*op, ids.clone())).collect()
    }

    /// The times at which `seen` (of [`recording_holder`]) got a renewal of `id`.
    fn renewals_of(
        seen: &std::sync::Mutex<Vec<(u8, Vec<String>, Instant)>>,
        id: &str,
    ) -> Vec<Instant> {
        let seen = seen.lock().expect("seen");
        seen.iter()
            .filter(|(op, ids, _)| *op == 0x01 && ids.iter().any(|i| i == id))
            .map(|(_, _, at)| *at)
            .collect()
    }

    /// A holder whose packets are black-holed after the connect: it accepts
    /// connections, reads what comes and never answers. Counts the
    /// connections open at once (most ever seen) and in all.
    async fn black_hole() -> (String, Arc<std::sync::Mutex<(usize, usize, usize)>>) {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        // (open now, most open at once, accepted in all)
        let counts = Arc::new(std::sync::Mutex::new((0, 0, 0)));
        let count = counts.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                {
                    let mut c = count.lock().expect("counts");
                    c.0 += 1;
                    c.1 = c.1.max(c.0);
                    c.2 += 1;
                }
                let count = count.clone();
                tokio::spawn(async move {
                    let mut sink = [0u8; 4096];
                    while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                    count.lock().expect("counts").0 -= 1;
                });
            }
        });
        (addr, counts)
    }

    fn on(ctrl: &str, id: &str, lease: Duration) -> Hold {
        Hold {
            ctrl: ctrl.into(),
            transfer_id: id.into(),
            lease,
        }
    }

    /// N4: requests on a prefill whose control port swallows every call end
    /// steadily (each end a release to that holder, each release ~3 s of
    /// timeouts and retries) while some of its holds are renewed in vain. A
    /// hold on a healthy prefill must still be renewed within every lease.
    /// Before, 64 calls in flight to the black hole blocked the keeper's loop
    /// for seconds and the healthy hold lapsed.
    #[tokio::test]
    async fn a_holder_that_never_answers_cannot_make_holds_on_other_holders_lapse() {
        let (healthy, seen) = recording_holder(true).await;
        let (hole, hole_counts) = black_hole().await;
        let (holds, queue) = Holds::new(Duration::from_millis(200), None);
        let mut tasks = JoinSet::new();
        let shutdown = CancellationToken::new();
        holds.spawn_keeper(queue, &mut tasks, shutdown.clone());
        let lease = Duration::from_secs(1);
        let began = Instant::now();
        let kept = holds.lease(on(&healthy, "kept", lease), 0);
        let stuck: Vec<HoldLease> = (0..16)
            .map(|i| holds.lease(on(&hole, &format!("stuck{i}"), lease), 0))
            .collect();
        for i in 0..300 {
            drop(holds.lease(on(&hole, &format!("ended{i}"), Duration::from_secs(60)), 0));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ended = Instant::now();
        let renewals = renewals_of(&seen, "kept");
        let mut last = began;
        for at in &renewals {
            assert!(
                *at - last < lease,
                "the healthy hold went {:?} without a renewal (lease {lease:?}): {:?}",
                *at - last,
                renewals.iter().map(|at| *at - began).collect::<Vec<_>>()
            );
            last = *at;
        }
        assert!(
            ended - last < lease,
            "no renewal of the healthy hold in the last {:?}",
            ended - last
        );
        let (_, most_open, _) = *hole_counts.lock().expect("counts");
        assert!(
            most_open <= MAX_CALLS_PER_HOLDER,
            "{most_open} calls at once to the black hole"
        );
        drop((kept, stuck));
        shutdown.cancel();
        // The stop waits at most one release's limit for the black hole.
        let stopped = Instant::now();
        while tasks.join_next().await.is_some() {}
        let limit = CallLimits::new(Duration::from_millis(200)).release;
        assert!(stopped.elapsed() < limit + Duration::from_millis(500));
    }

    /// A renewal that fails (its holder swallows the call) is retried only
    /// while its hold can still be alive: after that the holder hears no more
    /// of it.
    #[tokio::test]
    async fn renewals_to_a_silent_holder_stop_when_the_hold_lapses() {
        let (hole, counts) = black_hole().await;
        let (holds, queue) = Holds::new(Duration::from_millis(100), None);
        let mut tasks = JoinSet::new();
        let shutdown = CancellationToken::new();
        holds.spawn_keeper(queue, &mut tasks, shutdown.clone());
        let lease = holds.lease(on(&hole, "t", Duration::from_secs(1)), 0);
        // Due at 0.5 s, retried every 125 ms until the hold lapses at 1 s.
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let (_, _, tried) = *counts.lock().expect("counts");
        assert!((1..=5).contains(&tried), "{tried} renewal connections");
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let (_, _, later) = *counts.lock().expect("counts");
        assert_eq!(later, tried, "renewed after the hold lapsed");
        shutdown.cancel();
        while tasks.join_next().await.is_some() {}
        drop(lease);
    }

    /// The keeper's queue is bounded and a request never waits on it: past
    /// it a lease is not tracked, and a release that finds it full still
    /// happens, at the hold's next due renewal.
    #[tokio::test]
    async fn a_full_keeper_queue_never_blocks_and_loses_no_release() {
        let (addr, seen) = recording_holder(true).await;
        let (holds, queue) = Holds::with_queue(Duration::from_secs(1), None, 2);
        let first = holds.lease(on(&addr, "first", Duration::from_secs(1)), 0);
        let _second = holds.lease(on(&addr, "second", Duration::from_secs(1)), 0);
        // The queue is full: neither of these waits.
        let third = holds.lease(on(&addr, "untracked", Duration::from_secs(1)), 0);
        drop(first);
        drop(third);
        let mut tasks = JoinSet::new();
        let shutdown = CancellationToken::new();
        holds.spawn_keeper(queue, &mut tasks, shutdown.clone());
        let deadline = Instant::now() + Duration::from_secs(3);
        let released = |seen: &std::sync::Mutex<Vec<(u8, Vec<String>, Instant)>>| {
            seen.lock()
                .expect("seen")
                .iter()
                .filter(|(op, _, _)| *op == 0x02 || *op == 0x0B)
                .flat_map(|(_, ids, _)| ids.clone())
                .collect::<Vec<_>>()
        };
        while released(&seen).is_empty() {
            assert!(
                Instant::now() < deadline,
                "the dropped lease was never released"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(released(&seen), vec!["first".to_string()]);
        assert!(
            renewals_of(&seen, "first").is_empty(),
            "renewed after its lease dropped"
        );
        assert!(renewals_of(&seen, "untracked").is_empty());
        shutdown.cancel();
        while tasks.join_next().await.is_some() {}
    }
}
