//! The renewal schedule: each tracked hold's next renewal, due at half its
//! lease, retried sooner after a failure but never past its expiry.

use super::calls::Renewal;
use super::hold::Hold;
use super::lease::LeaseState;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A leased hold the keeper renews.
pub(super) struct Tracked {
    pub(super) hold: Hold,
    pub(super) lease: Arc<LeaseState>,
    /// When the next renewal is due (its key in the schedule), `None` while one
    /// is waiting for its holder or in flight, or once renewing has stopped.
    pub(super) due: Option<Instant>,
    /// When the hold lapses unless renewed: its lease from when it was taken
    /// or from the start of its last successful renewal.
    pub(super) expires: Instant,
}

/// What to do with a renewal whose turn has come.
#[derive(Debug)]
pub(super) enum Turn {
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
pub(super) struct Schedule {
    pub(super) tracked: HashMap<u64, Tracked>,
    pub(super) order: BTreeSet<(Instant, u64)>,
}

impl Schedule {
    pub(super) fn track(&mut self, key: u64, hold: Hold, lease: Arc<LeaseState>, now: Instant) {
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

    pub(super) fn untrack(&mut self, key: u64) -> Option<Hold> {
        let tracked = self.tracked.remove(&key)?;
        if let Some(due) = tracked.due {
            self.order.remove(&(due, key));
        }
        Some(tracked.hold)
    }

    pub(super) fn next_due(&self) -> Option<Instant> {
        self.order.first().map(|(due, _)| *due)
    }

    /// The holds due at `now`, with their holders; no longer due until
    /// [`Schedule::renewed`].
    pub(super) fn take_due(&mut self, now: Instant, most: usize) -> Vec<(u64, String)> {
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
    pub(super) fn turn(&mut self, key: u64, now: Instant, attempt: Duration) -> Turn {
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
    pub(super) fn renewed(&mut self, key: u64, outcome: Renewal, started: Instant, now: Instant) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::atomic::{AtomicBool, AtomicU64};

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
}
