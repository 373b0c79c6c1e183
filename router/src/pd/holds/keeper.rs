//! The keeper task: takes the leases' commands, renews holds as they fall
//! due and sends releases in batches, never waiting on a holder itself.

use super::calls::{
    release, renew, CallLimits, Renewal, MAX_CALLS_PER_HOLDER, MAX_COMMANDS_AT_ONCE,
    MAX_WAITING_RELEASE_BATCHES,
};
use super::hold::Hold;
use super::lease::KeeperCommand;
use super::releases::Releases;
use super::schedule::{Schedule, Turn};
use connex_transfer::proto::MAX_RELEASE_BATCH;
use connex_transfer::CtrlClient;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Instant;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// One holder's calls: how many are in flight, and the work waiting for a
/// free call (renewals first: a late renewal loses a hold, a late release
/// only frees it later).
#[derive(Default)]
pub(super) struct HolderCalls {
    in_flight: usize,
    renewals: VecDeque<u64>,
    releases: VecDeque<Vec<String>>,
}

impl HolderCalls {
    pub(super) fn idle(&self) -> bool {
        self.in_flight == 0 && self.renewals.is_empty() && self.releases.is_empty()
    }
}

/// What a finished call reports: a renewal its key, outcome and start; a
/// release nothing.
pub(super) type CallDone = Option<(u64, Renewal, Instant)>;

/// The keeper task's state: the renewal schedule, the releases waiting for
/// their batch, and each holder's calls. Its loop never waits on a call: a
/// holder that never answers delays only its own calls.
pub(super) struct Keeper {
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
    pub(super) fn new(ctrl: CtrlClient, limits: CallLimits) -> Self {
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

    pub(super) async fn run(
        mut self,
        mut queue: mpsc::Receiver<KeeperCommand>,
        shutdown: CancellationToken,
    ) {
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
    pub(super) async fn stop(mut self, mut queue: mpsc::Receiver<KeeperCommand>) {
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

    pub(super) fn command(&mut self, command: KeeperCommand) {
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
    pub(super) fn release_later(&mut self, hold: Hold) {
        if let Some(batch) = self.releases.add(hold, Instant::now()) {
            self.queue_release(batch);
        }
    }

    /// Sends every waiting release batch (as its holder has room).
    pub(super) fn flush(&mut self) {
        for batch in self.releases.take_all() {
            self.queue_release(batch);
        }
    }

    /// Queues the renewals that are due on their holders, a bounded number a
    /// turn (the rest are still due at the next).
    pub(super) fn renew_due(&mut self) {
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
    pub(super) fn queue_release(&mut self, (holder, ids): (String, Vec<String>)) {
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
    pub(super) fn pump(&mut self, holder: &str) {
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

    pub(super) fn spawn(
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
    pub(super) fn finished(
        &mut self,
        done: Result<(tokio::task::Id, CallDone), tokio::task::JoinError>,
    ) {
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

pub(super) async fn sleep_until(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at.into()).await;
    }
}
