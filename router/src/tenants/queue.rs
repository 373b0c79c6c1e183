//! Admission to the router's slots (`--max-concurrent-requests`): at once
//! while one is free and nobody waits; otherwise in per-tenant queues, served
//! by priority (lower first), then by weighted fair share (virtual time: a
//! tenant's next request finishes at its last one's tag plus `1 / weight`,
//! a tenant that starts waiting starts at the clock, the lowest tag goes
//! first), each queue bounded in length and wait.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::oneshot;

/// Who asks for a slot, as the queue sees it.
#[derive(Debug, Clone)]
pub struct Share {
    pub tenant: Arc<str>,
    pub weight: u32,
    pub priority: i32,
}

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The tenant's queue is at its length (or queueing is off).
    QueueFull,
    /// The wait reached its bound.
    Waited,
}

#[derive(Debug)]
pub struct FairQueue {
    limit: usize,
    max_queued: usize,
    max_wait: Duration,
    inner: Mutex<QueueState>,
}

#[derive(Debug, Default)]
struct QueueState {
    in_flight: usize,
    /// The tag of the request admitted last from a queue.
    clock: f64,
    queues: HashMap<Arc<str>, TenantQueue>,
    queued: usize,
    next_ticket: u64,
}

/// One tenant's line in the fair queue (a "flow" in fair-queueing terms).
#[derive(Debug, Default)]
struct TenantQueue {
    waiting: VecDeque<(u64, oneshot::Sender<()>)>,
    /// The finish tag of the queue's last admitted request.
    finish: f64,
    weight: u32,
    priority: i32,
}

/// One admitted request's slot; given back (to the next in line) on drop.
#[derive(Debug)]
pub struct Slot {
    queue: Arc<FairQueue>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut inner = self.queue.lock();
        inner.in_flight = inner.in_flight.saturating_sub(1);
        dispatch(&mut inner, self.queue.limit);
    }
}

impl FairQueue {
    pub fn new(limit: usize, max_queued: usize, max_wait: Duration) -> Self {
        Self {
            limit: limit.max(1),
            max_queued,
            max_wait,
            inner: Mutex::new(QueueState::default()),
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests waiting now.
    #[cfg(test)]
    pub fn queued(&self) -> usize {
        self.lock().queued
    }

    /// A slot for `share`: at once, after a wait in its queue, or refused.
    pub async fn acquire(self: &Arc<Self>, share: &Share) -> Result<Slot, Refusal> {
        let (ticket, granted) = {
            let mut inner = self.lock();
            if inner.in_flight < self.limit && inner.queued == 0 {
                inner.in_flight += 1;
                return Ok(Slot {
                    queue: self.clone(),
                });
            }
            let id = inner.next_ticket;
            inner.next_ticket += 1;
            let clock = inner.clock;
            let tenant_queue = inner.queues.entry(share.tenant.clone()).or_default();
            if self.max_wait.is_zero() || tenant_queue.waiting.len() >= self.max_queued {
                return Err(Refusal::QueueFull);
            }
            tenant_queue.weight = share.weight.max(1);
            tenant_queue.priority = share.priority;
            // A tenant's queue that starts waiting starts at the clock: time
            // it spent idle is no credit.
            if tenant_queue.waiting.is_empty() {
                tenant_queue.finish = tenant_queue.finish.max(clock);
            }
            let (tx, rx) = oneshot::channel();
            tenant_queue.waiting.push_back((id, tx));
            inner.queued += 1;
            // A slot may have freed between the check above and now.
            dispatch(&mut inner, self.limit);
            (
                Ticket {
                    queue: self,
                    tenant: &share.tenant,
                    id,
                    open: true,
                },
                rx,
            )
        };
        let mut ticket = ticket;
        let waited = tokio::time::timeout(self.max_wait, granted).await;
        ticket.open = false;
        match waited {
            Ok(Ok(())) => Ok(Slot {
                queue: self.clone(),
            }),
            // Timed out: still queued (refused), or given a slot just now.
            _ => match self.withdraw(&share.tenant, ticket.id) {
                Withdrawn::WasQueued => Err(Refusal::Waited),
                Withdrawn::HadSlot => Ok(Slot {
                    queue: self.clone(),
                }),
            },
        }
    }

    /// Takes a waiting request out of its queue, or says it was given a slot.
    fn withdraw(&self, tenant: &Arc<str>, id: u64) -> Withdrawn {
        let mut inner = self.lock();
        let removed = inner.queues.get_mut(tenant).and_then(|tenant_queue| {
            let at = tenant_queue
                .waiting
                .iter()
                .position(|(ticket, _)| *ticket == id)?;
            tenant_queue.waiting.remove(at)
        });
        if removed.is_some() {
            inner.queued -= 1;
            forget_idle(&mut inner, tenant);
            Withdrawn::WasQueued
        } else {
            Withdrawn::HadSlot
        }
    }
}

enum Withdrawn {
    WasQueued,
    HadSlot,
}

/// A waiting request: a caller that goes away while it waits (its future
/// dropped) leaves the queue, and gives back a slot it was given meanwhile.
struct Ticket<'a> {
    queue: &'a Arc<FairQueue>,
    tenant: &'a Arc<str>,
    id: u64,
    open: bool,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if self.open {
            if let Withdrawn::HadSlot = self.queue.withdraw(self.tenant, self.id) {
                drop(Slot {
                    queue: self.queue.clone(),
                });
            }
        }
    }
}

/// A tenant's queue with no one waiting and a tag behind the clock carries
/// nothing a newcomer would not get: dropped, so that the map holds active tenants only.
fn forget_idle(inner: &mut QueueState, tenant: &Arc<str>) {
    let clock = inner.clock;
    if inner
        .queues
        .get(tenant)
        .is_some_and(|tenant_queue| tenant_queue.waiting.is_empty() && tenant_queue.finish <= clock)
    {
        inner.queues.remove(tenant);
    }
}

/// Gives free slots to the waiting requests, best first.
fn dispatch(inner: &mut QueueState, limit: usize) {
    while inner.in_flight < limit && inner.queued > 0 {
        let next = inner
            .queues
            .iter()
            .filter(|(_, tenant_queue)| !tenant_queue.waiting.is_empty())
            .map(|(tenant, tenant_queue)| {
                let start = tenant_queue.finish;
                (
                    tenant_queue.priority,
                    start + 1.0 / f64::from(tenant_queue.weight),
                    start,
                    tenant,
                )
            })
            .min_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        let Some((_, finish, start, tenant)) = next else {
            return;
        };
        let tenant = tenant.clone();
        let Some(tenant_queue) = inner.queues.get_mut(&tenant) else {
            return;
        };
        let Some((_, waiter)) = tenant_queue.waiting.pop_front() else {
            return;
        };
        tenant_queue.finish = finish;
        inner.queued -= 1;
        inner.clock = inner.clock.max(start);
        // A waiter whose caller is gone takes no slot.
        if waiter.send(()).is_ok() {
            inner.in_flight += 1;
        }
        forget_idle(inner, &tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::task::JoinHandle;

    fn share(tenant: &str, weight: u32, priority: i32) -> Share {
        Share {
            tenant: tenant.into(),
            weight,
            priority,
        }
    }

    /// A slot of `queue` taken at once by tenant `tenant`.
    async fn taken(queue: &Arc<FairQueue>, tenant: &str, weight: u32) -> Slot {
        queue
            .acquire(&share(tenant, weight, 0))
            .await
            .unwrap_or_else(|_| unreachable!())
    }

    /// A queue of one slot (at most `max_queued` callers waiting, each at
    /// most `max_wait`), that slot taken by tenant `a`, and a caller of
    /// `share` waiting for it (its outcome, the slot let go).
    async fn held_with_one_waiting(
        max_queued: usize,
        max_wait: Duration,
        share: Share,
    ) -> (Arc<FairQueue>, Slot, JoinHandle<Result<(), Refusal>>) {
        let queue = Arc::new(FairQueue::new(1, max_queued, max_wait));
        let held = taken(&queue, "a", 1).await;
        let waiter = tokio::spawn({
            let queue = queue.clone();
            async move { queue.acquire(&share).await.map(drop) }
        });
        until_queued(&queue, 1).await;
        (queue, held, waiter)
    }

    /// Until `callers` wait in `queue`.
    async fn until_queued(queue: &FairQueue, callers: usize) {
        while queue.queued() < callers {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn backlogged_tenants_are_served_by_weight() {
        let queue = Arc::new(FairQueue::new(1, 1000, Duration::from_secs(30)));
        let first = taken(&queue, "a", 3).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = tokio::task::JoinSet::new();
        for (tenant, weight) in [("a", 3), ("b", 1)] {
            for _ in 0..40 {
                let (queue, order) = (queue.clone(), order.clone());
                waiting.spawn(async move {
                    let slot = queue.acquire(&share(tenant, weight, 0)).await;
                    order.lock().unwrap_or_else(|e| e.into_inner()).push(tenant);
                    tokio::task::yield_now().await;
                    drop(slot);
                });
                tokio::task::yield_now().await;
            }
        }
        until_queued(&queue, 80).await;
        drop(first);
        while waiting.join_next().await.is_some() {}
        let order = order.lock().unwrap_or_else(|e| e.into_inner()).clone();
        // While both wait (the first 40 admissions), a gets three of every four.
        let a = order[..40].iter().filter(|t| **t == "a").count();
        assert!((28..=32).contains(&a), "{a} of 40: {order:?}");
    }

    #[tokio::test]
    async fn a_lower_priority_value_goes_first() {
        let (queue, first, low) =
            held_with_one_waiting(10, Duration::from_secs(30), share("batch", 100, 5)).await;
        let urgent = {
            let queue = queue.clone();
            tokio::spawn(async move {
                let slot = queue.acquire(&share("urgent", 1, -1)).await;
                (slot.is_ok(), queue.queued())
            })
        };
        until_queued(&queue, 2).await;
        drop(first);
        // Urgent was admitted while batch still waited.
        assert_eq!(urgent.await.ok(), Some((true, 1)));
        assert!(low.await.is_ok());
    }

    #[tokio::test]
    async fn queues_are_bounded_in_length_and_wait() {
        let (queue, _held, waiter) =
            held_with_one_waiting(1, Duration::from_millis(50), share("a", 1, 0)).await;
        assert_eq!(
            queue.acquire(&share("a", 1, 0)).await.map(drop),
            Err(Refusal::QueueFull)
        );
        assert_eq!(waiter.await.ok(), Some(Err(Refusal::Waited)));
        assert_eq!(queue.queued(), 0);
    }

    #[tokio::test]
    async fn a_caller_gone_while_waiting_takes_no_slot() {
        let (queue, held, gone) =
            held_with_one_waiting(10, Duration::from_secs(30), share("a", 1, 0)).await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(queue.queued(), 0);
        drop(held);
        // The slot is free again, not leaked to the caller that left.
        let again =
            tokio::time::timeout(Duration::from_secs(1), queue.acquire(&share("b", 1, 0))).await;
        assert!(matches!(again, Ok(Ok(_))));
    }
}
