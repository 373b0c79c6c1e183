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
//!
//! Modules: `hold.rs` (a hold as the prefill names it), `lease.rs` (a
//! request's `HoldLease`), `keeper.rs` (the keeper task), `schedule.rs` (when
//! each renewal is due), `releases.rs` (releases batched by holder),
//! `calls.rs` (the calls to holders and their bounds); here, `Holds`, the
//! handle every request leases through.

mod calls;
mod hold;
mod keeper;
mod lease;
mod releases;
mod schedule;

pub use hold::{Hold, HoldState};
pub use lease::HoldLease;

use calls::CallLimits;
use connex_transfer::{CtrlClient, Secret, TransferError};
use keeper::Keeper;
use lease::{KeeperCommand, LeaseState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

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

#[cfg(test)]
mod tests {
    use super::calls::MAX_CALLS_PER_HOLDER;
    use super::*;
    use std::time::Instant;

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
