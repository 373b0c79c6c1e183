//! One instance's lifecycle as a state machine: what the membership store
//! decided (ready, draining, migrating), and on top of it this replica's own
//! verdict that the instance is dead for now (unreachable, failing its probes,
//! silent past its TTL) or gone for good. Every change of an instance's state
//! is a [`Change`] applied here; the effective [`Lifecycle`] is derived.

use super::registration::Lifecycle;
use std::time::{Duration, Instant};

/// This replica's judgement, overriding the stored state while it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// None: the stored state applies.
    None,
    /// A connect found nothing listening (since then). A heartbeat, or (etcd)
    /// a lease that outlives the mark, ends it.
    Unreachable(Instant),
    /// Its `/health` probes fail: only a probe that succeeds ends it (the agent
    /// that heartbeats can outlive the server it speaks for).
    Unhealthy,
    /// Its heartbeats stopped for the TTL: a heartbeat ends it.
    Expired,
    /// It left the membership (removed as dead, or replaced by a new
    /// incarnation): final.
    Gone,
}

/// A change of what is known about an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// The store's state (registration, drain, activate, an etcd record):
    /// it also ends a temporary verdict.
    Stored(Lifecycle),
    /// A connect to it was refused, at this instant.
    Unreachable(Instant),
    /// Its probes failed `--health-check-failures` times in a row.
    Unhealthy,
    /// A probe succeeded.
    Healthy,
    /// A heartbeat arrived.
    Heartbeat,
    /// Its heartbeats stopped for the TTL.
    Expired,
    /// A sweep at `now`: an `Unreachable` mark older than `after` ends (the
    /// instance is still in the store, so something keeps it alive).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))] // etcd's only
    Revive { now: Instant, after: Duration },
    /// It left the membership.
    Gone,
}

/// The state of one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    stored: Lifecycle,
    verdict: Verdict,
}

impl Machine {
    pub fn new(stored: Lifecycle) -> Self {
        Self {
            stored,
            verdict: Verdict::None,
        }
    }

    /// The lifecycle routing sees.
    pub fn lifecycle(&self) -> Lifecycle {
        match self.verdict {
            Verdict::None => self.stored,
            _ => Lifecycle::Dead,
        }
    }

    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// The state after `event`. Only ready instances get a new dead verdict:
    /// a drained one keeps its drain (nothing new goes there anyway).
    pub fn next(self, event: Change) -> Self {
        use Verdict as V;
        let verdict = match (self.verdict, event) {
            (V::Gone, _) => V::Gone,
            (_, Change::Gone) => V::Gone,
            (_, Change::Stored(stored)) => {
                return Self {
                    stored,
                    verdict: V::None,
                }
            }
            (V::None, Change::Unreachable(at)) if self.stored == Lifecycle::Ready => {
                V::Unreachable(at)
            }
            (V::None, Change::Unhealthy) if self.stored == Lifecycle::Ready => V::Unhealthy,
            (V::None, Change::Expired) => V::Expired,
            // A probe that succeeds ends a dead verdict it can contradict; the
            // health checker probes an unreachable instance only when nothing
            // else would revive it (a static one, which sends no heartbeats).
            (V::Unhealthy | V::Unreachable(_), Change::Healthy) => V::None,
            (V::Unreachable(_) | V::Expired, Change::Heartbeat) => V::None,
            (V::Unreachable(at), Change::Revive { now, after })
                if now.saturating_duration_since(at) > after =>
            {
                V::None
            }
            (verdict, _) => verdict,
        };
        Self { verdict, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Lifecycle::{Dead, Draining, Migrating, Ready};

    fn ready() -> Machine {
        Machine::new(Ready)
    }

    fn after(machine: Machine, events: &[Change]) -> Machine {
        events.iter().fold(machine, |m, e| m.next(*e))
    }

    #[test]
    fn stored_states_apply_and_end_temporary_verdicts() {
        for stored in [Ready, Draining, Migrating] {
            assert_eq!(ready().next(Change::Stored(stored)).lifecycle(), stored);
        }
        let now = Instant::now();
        for verdict in [Change::Unreachable(now), Change::Unhealthy, Change::Expired] {
            let dead = ready().next(verdict);
            assert_eq!(dead.lifecycle(), Dead, "{verdict:?}");
            let back = dead.next(Change::Stored(Draining));
            assert_eq!(back.lifecycle(), Draining);
            assert_eq!(back.verdict(), Verdict::None);
        }
    }

    #[test]
    fn only_ready_instances_are_judged_unreachable_or_unhealthy() {
        let now = Instant::now();
        let drained = Machine::new(Draining);
        assert_eq!(drained.next(Change::Unreachable(now)).lifecycle(), Draining);
        assert_eq!(drained.next(Change::Unhealthy).lifecycle(), Draining);
        // Silence past the TTL kills any state.
        assert_eq!(drained.next(Change::Expired).lifecycle(), Dead);
    }

    #[test]
    fn a_heartbeat_ends_unreachable_and_expired_but_not_unhealthy() {
        let now = Instant::now();
        for verdict in [Change::Unreachable(now), Change::Expired] {
            let back = after(Machine::new(Ready), &[verdict, Change::Heartbeat]);
            assert_eq!(back.lifecycle(), Ready, "{verdict:?}");
        }
        // A drained instance that expired comes back drained, not ready.
        let drained = after(
            Machine::new(Draining),
            &[Change::Expired, Change::Heartbeat],
        );
        assert_eq!(drained.lifecycle(), Draining);
        let sick = after(ready(), &[Change::Unhealthy, Change::Heartbeat]);
        assert_eq!(sick.lifecycle(), Dead);
        assert_eq!(sick.verdict(), Verdict::Unhealthy);
    }

    #[test]
    fn only_a_successful_probe_ends_unhealthy() {
        let now = Instant::now();
        let sick = ready().next(Change::Unhealthy);
        for event in [
            Change::Heartbeat,
            Change::Expired,
            Change::Unreachable(now),
            Change::Revive {
                now,
                after: Duration::ZERO,
            },
        ] {
            assert_eq!(sick.next(event).verdict(), Verdict::Unhealthy, "{event:?}");
        }
        assert_eq!(sick.next(Change::Healthy).lifecycle(), Ready);
        // A probe that succeeds does not undo other verdicts.
        assert_eq!(
            ready()
                .next(Change::Expired)
                .next(Change::Healthy)
                .lifecycle(),
            Dead
        );
    }

    #[test]
    fn an_unreachable_mark_ends_once_it_is_older_than_the_revive_delay() {
        let marked = Instant::now();
        let dead = ready().next(Change::Unreachable(marked));
        let early = dead.next(Change::Revive {
            now: marked + Duration::from_secs(1),
            after: Duration::from_secs(5),
        });
        assert_eq!(early.lifecycle(), Dead);
        let late = dead.next(Change::Revive {
            now: marked + Duration::from_secs(6),
            after: Duration::from_secs(5),
        });
        assert_eq!(late.lifecycle(), Ready);
        // Revive touches no other verdict.
        let expired = ready().next(Change::Expired).next(Change::Revive {
            now: marked + Duration::from_secs(60),
            after: Duration::ZERO,
        });
        assert_eq!(expired.lifecycle(), Dead);
    }

    #[test]
    fn gone_is_final() {
        let now = Instant::now();
        let gone = ready().next(Change::Gone);
        for event in [
            Change::Stored(Ready),
            Change::Heartbeat,
            Change::Healthy,
            Change::Revive {
                now,
                after: Duration::ZERO,
            },
        ] {
            assert_eq!(gone.next(event).lifecycle(), Dead, "{event:?}");
        }
    }

    #[test]
    fn repeated_verdicts_keep_the_first() {
        let first = Instant::now();
        let later = first + Duration::from_secs(3);
        let dead = after(
            ready(),
            &[Change::Unreachable(first), Change::Unreachable(later)],
        );
        assert_eq!(dead.verdict(), Verdict::Unreachable(first));
        let sick = after(ready(), &[Change::Unhealthy, Change::Expired]);
        assert_eq!(sick.verdict(), Verdict::Unhealthy);
    }
}
