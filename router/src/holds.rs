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

use connex_transfer::proto::MAX_RELEASE_BATCH;
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
/// Most queued commands the keeper takes in one turn before it looks at its
/// timers and finished calls again.
const MAX_COMMANDS_AT_ONCE: usize = 256;

/// How long a release waits for others to the same holder: the requests that
/// end within it cost their holder one `ReleaseMany` call instead of one call
/// each (at a few thousand requests a second, one call in ~20). The router's
/// release is a backstop (the decoder releases the hold on a normal finish,
/// the lease frees it otherwise), so a few ms later costs nothing.
const RELEASE_LINGER: Duration = Duration::from_millis(5);

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
    let mut keeper = Keeper {
        ctrl,
        calls: JoinSet::new(),
        schedule: Schedule::default(),
        releases: Releases::default(),
    };
    loop {
        let wake = keeper.schedule.next_due();
        let flush = keeper.releases.due;
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(command) = queue.recv() => {
                // With the ones already queued (a bounded number): the
                // releases of requests that ended together join one batch.
                keeper.command(command).await;
                for _ in 1..MAX_COMMANDS_AT_ONCE {
                    let Ok(command) = queue.try_recv() else { break };
                    keeper.command(command).await;
                }
            }
            _ = sleep_until(flush), if flush.is_some() => keeper.flush().await,
            _ = sleep_until(wake), if wake.is_some() => keeper.renew_due(),
            Some(done) = keeper.calls.join_next(), if !keeper.calls.is_empty() => {
                keeper.schedule.apply(Some(done));
            }
        }
    }
    // Releases queued before the stop still go out, bounded by the client's
    // timeouts (a lease taken meanwhile is tracked, so that its release is too).
    queue.close();
    while let Some(command) = queue.recv().await {
        keeper.command(command).await;
    }
    keeper.flush().await;
    while keeper.calls.join_next().await.is_some() {}
}

/// The keeper task's state: the renewal schedule, the releases waiting for
/// their batch, and the calls in flight.
struct Keeper {
    ctrl: CtrlClient,
    calls: JoinSet<Option<(u64, Renewal)>>,
    schedule: Schedule,
    releases: Releases,
}

impl Keeper {
    async fn command(&mut self, command: Command) {
        match command {
            Command::Track { key, hold, epoch } => {
                self.schedule.track(key, hold, epoch, Instant::now());
            }
            Command::Release { key } => {
                let Some(hold) = self.schedule.untrack(key) else {
                    return;
                };
                if let Some(batch) = self.releases.add(hold, Instant::now()) {
                    self.send(batch).await;
                }
            }
        }
    }

    /// Starts the renewals that are due, as many as there is room for.
    fn renew_due(&mut self) {
        let room = MAX_CALLS.saturating_sub(self.calls.len()).max(1);
        for (key, hold, epoch) in self.schedule.take_due(Instant::now(), room) {
            let ctrl = self.ctrl.clone();
            self.calls
                .spawn(async move { Some((key, renew(ctrl, hold, epoch).await)) });
        }
    }

    /// Sends every waiting release.
    async fn flush(&mut self) {
        for batch in self.releases.take_all() {
            self.send(batch).await;
        }
    }

    /// Sends one holder's batch of releases, once fewer than [`MAX_CALLS`]
    /// are in flight.
    async fn send(&mut self, (holder, ids): (String, Vec<String>)) {
        if self.calls.len() >= MAX_CALLS {
            let done = self.calls.join_next().await;
            self.schedule.apply(done);
        }
        let ctrl = self.ctrl.clone();
        self.calls.spawn(async move {
            release(ctrl, holder, ids).await;
            None
        });
    }
}

async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at.into()).await;
    }
}

impl Schedule {
    /// Takes in the outcome of a finished call (a renewal's; a release has none).
    fn apply(&mut self, done: Option<Result<Option<(u64, Renewal)>, tokio::task::JoinError>>) {
        if let Some(Ok(Some((key, outcome)))) = done {
            self.renewed(key, outcome, Instant::now());
        }
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

/// Releases the holds `ids` on `holder`: in one `ReleaseMany` call, or one
/// by one for a single hold or a holder that predates the op.
async fn release(ctrl: CtrlClient, holder: String, ids: Vec<String>) {
    if ids.len() > 1 {
        match with_backoff(|| ctrl.release_many(&holder, &ids)).await {
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
        let outcome = with_backoff(|| ctrl.release(&holder, id)).await;
        count_release(&holder, outcome.as_ref().map(|was| *was));
    }
}

/// A release call, tried again after [`RELEASE_BACKOFF`]'s waits while it
/// fails for a reason that may pass: not a refused connection (the holder is
/// gone, and its holds with it), not an op the holder does not know.
async fn with_backoff<T, F, Fut>(mut call: F) -> Result<T, TransferError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TransferError>>,
{
    let mut backoff = RELEASE_BACKOFF.iter();
    loop {
        match call().await {
            Err(err) if !is_refused(&err) && !err.is_unknown_op() => match backoff.next() {
                Some(wait) => tokio::time::sleep(*wait).await,
                None => return Err(err),
            },
            outcome => return outcome,
        }
    }
}

/// One hold's release outcome, in `connex_holds_released_total`.
fn count_release(holder: &str, outcome: Result<bool, &TransferError>) {
    match outcome {
        Ok(was_held) => {
            crate::metrics::hold_released(if was_held { "released" } else { "gone" });
        }
        Err(err) => {
            tracing::debug!(%holder, %err, "hold release failed");
            crate::metrics::hold_released("failed");
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
    ) -> (String, Arc<std::sync::Mutex<Vec<(u8, Vec<String>)>>>) {
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
                        record.lock().expect("record").push((header.op, ids));
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
        seen: &std::sync::Mutex<Vec<(u8, Vec<String>)>>,
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
        let seen = seen.lock().expect("seen").clone();
        assert_eq!(
            seen,
            vec![(0x0B, vec!["t0".into(), "t1".into(), "t2".into()])]
        );
    }

    #[tokio::test]
    async fn a_holder_without_release_many_gets_each_release_alone() {
        let (addr, seen) = recording_holder(false).await;
        release_together(&addr, 3, &seen, 4).await;
        let seen = seen.lock().expect("seen").clone();
        assert_eq!(seen[0].0, 0x0B, "the batch first");
        let singles: Vec<(u8, Vec<String>)> = ["t0", "t1", "t2"]
            .iter()
            .map(|id| (0x02, vec![id.to_string()]))
            .collect();
        assert_eq!(seen[1..], singles[..]);
    }
}
