//! Background responses (`background: true`): each one's events, kept as its
//! generation makes them, so that any client may read them again from any
//! sequence number (`GET /v1/responses/{id}?stream=true&starting_after=N`)
//! and follow the rest live, or cancel it. Bounded per tenant and in total,
//! in count (in progress or finished) and in bytes (finished ones): past a
//! tenant's bounds its own finished ones go, those finished longest ago
//! first; past the totals, those of the tenant holding the most (their
//! stored response stays in the store). A generation in progress is never
//! forgotten: a tenant with all of its own in progress is refused a new one,
//! so that no tenant holds every slot.

use super::stored::Stored;
use crate::protocols::client_event::ClientEvent;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// One background response.
#[derive(Debug)]
pub struct Live {
    pub tenant: String,
    state: Mutex<LiveState>,
    /// Bumped at every change, for followers.
    changed: watch::Sender<u64>,
    /// Cancelled by `POST .../cancel` (and when the router stops).
    pub cancel: CancellationToken,
    /// Set when the generation goes on elsewhere (another replica took it
    /// over, or this one hands it over as it stops): it stops here without
    /// a last event, and this replica's readers are let go (they read the
    /// rest from any replica).
    fenced: std::sync::atomic::AtomicBool,
    /// Whether a writer copies it into the shared store now (`mirror.rs`):
    /// this replica's takeover never claims it then.
    mirrored: std::sync::atomic::AtomicBool,
    /// Where it is counted, told when it is done.
    kept: Kept,
}

/// A background response's place in its `LiveResponses`.
#[derive(Debug)]
struct Kept {
    logs: Weak<LiveLogs>,
    id: String,
}

#[derive(Debug, Default)]
struct LiveState {
    events: Vec<ClientEvent>,
    /// The response as it stands (its last event's, or the first one's).
    response: Value,
    done: bool,
    /// What another replica needs to go on (with a shared store;
    /// `mirror.rs`), as of the event it was taken at: the store gets the
    /// events up to there, never past the checkpoint.
    checkpoint: Option<Checkpointed>,
    /// With a shared store: the events written there, the only ones readers
    /// get (an event a reader had that the store lacks could be generated
    /// differently by the replica that takes over). None: all of them.
    durable: Option<usize>,
    /// With a shared store: until when the generation may go on here, by
    /// this replica's clock (its lease, renewed by each write, runs out
    /// later: `mirror.rs`); past it, it pauses. None: no bound.
    until: Option<tokio::time::Instant>,
    /// With a shared store: the stored response its end made, which its
    /// writer stores under its lease (`mirror.rs`), with its last events.
    kept: Option<Arc<Stored>>,
}

#[derive(Debug)]
struct Checkpointed {
    value: Value,
    /// Events it covers (the first `through`).
    through: usize,
    response: Value,
    done: bool,
}

/// Events of a background response after some sequence number up to its
/// last checkpoint, with its state and the checkpoint as of then.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub events: Vec<ClientEvent>,
    pub response: Value,
    pub done: bool,
    pub checkpoint: Option<Value>,
    /// Events the checkpoint covers (it changes with every checkpoint).
    pub through: usize,
}

impl Live {
    fn lock(&self) -> MutexGuard<'_, LiveState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends events (each with its sequence number); `end`: the response
    /// is done, as it ended.
    pub fn push(&self, events: Vec<ClientEvent>, end: Option<Value>) {
        self.push_checkpointed(events, end, None);
    }

    /// `push`, with the checkpoint as of these events (kept as it was when
    /// None).
    pub fn push_checkpointed(
        &self,
        events: Vec<ClientEvent>,
        end: Option<Value>,
        checkpoint: Option<Value>,
    ) {
        let mut state = self.lock();
        let ends = end.is_some();
        // The response as its last event carries it (the end's is given).
        if end.is_none() {
            if let Some(response) = events.iter().rev().find_map(ClientEvent::response) {
                state.response = response;
            }
        }
        state.events.extend(events);
        if let Some(whole) = end {
            state.response = whole;
            state.done = true;
        }
        if let Some(value) = checkpoint {
            state.checkpoint = Some(Checkpointed {
                value,
                through: state.events.len(),
                response: state.response.clone(),
                done: state.done,
            });
        }
        drop(state);
        self.changed.send_modify(|n| *n += 1);
        if ends {
            self.settle();
        }
    }

    /// Counts it, done, in its tenant's bytes (which may forget it or older
    /// ones past the bounds).
    fn settle(&self) {
        if let Some(logs) = self.kept.logs.upgrade() {
            logs.settle(&self.kept.id);
        }
    }

    /// What it keeps: its events' frames and its response's JSON.
    pub fn kept_bytes(&self) -> usize {
        let state = self.lock();
        let events: usize = state.events.iter().map(ClientEvent::frame_len).sum();
        events + json_len(&state.response)
    }

    /// Bytes of its events' JSON (what the shared store keeps of them).
    pub fn event_bytes(&self) -> usize {
        self.lock().events.iter().map(|e| e.json().len()).sum()
    }

    /// Whether events came since the last checkpoint.
    pub fn unchecked(&self) -> bool {
        let state = self.lock();
        state
            .checkpoint
            .as_ref()
            .is_none_or(|c| c.through < state.events.len())
    }

    /// Stops the generation here, leaving its end to another replica.
    pub fn fence(&self) {
        self.fenced
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.lock().done = true;
        self.changed.send_modify(|n| *n += 1);
        self.cancel.cancel();
        self.settle();
    }

    pub fn fenced(&self) -> bool {
        self.fenced.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The response as it stands.
    pub fn response(&self) -> Value {
        self.lock().response.clone()
    }

    pub fn done(&self) -> bool {
        self.lock().done
    }

    /// The events after sequence number `after` (all, without one) that
    /// readers may have, and whether they have all of them and the response
    /// is done (or goes on elsewhere).
    pub fn after(&self, after: Option<u64>) -> (Vec<ClientEvent>, bool) {
        let state = self.lock();
        let visible = state.durable.unwrap_or(usize::MAX).min(state.events.len());
        let from = Self::start(&state, after).min(visible);
        let ended = self.fenced() || (state.done && visible == state.events.len());
        (state.events[from..visible].to_vec(), ended)
    }

    /// From now on, readers get only the events the shared store has
    /// (`mark_durable`), those so far counted as had (whether the store
    /// can be written or not: an event a reader had that the store lacks
    /// could be generated differently by a replica taking over); and the
    /// generation goes on here until `until` only (its writer, `mirror.rs`,
    /// moves it on with each write).
    pub fn gate(&self, until: tokio::time::Instant) {
        let mut state = self.lock();
        state.durable = Some(state.events.len());
        state.until = Some(until);
        drop(state);
        self.set_mirrored(true);
    }

    /// The store has the first `through` events.
    pub fn mark_durable(&self, through: usize) {
        let mut state = self.lock();
        if let Some(durable) = state.durable.as_mut() {
            if through > *durable {
                *durable = through;
                drop(state);
                self.changed.send_modify(|n| *n += 1);
            }
        }
    }

    /// Whether readers get only what a shared store has (`gate`).
    pub fn is_shared(&self) -> bool {
        self.lock().durable.is_some()
    }

    /// The generation may go on here until `until` (its writer's lease
    /// renewed).
    pub fn hold_until(&self, until: tokio::time::Instant) {
        self.lock().until = Some(until);
        self.changed.send_modify(|n| *n += 1);
    }

    /// Until when the generation may go on here (None: no bound).
    pub fn until(&self) -> Option<tokio::time::Instant> {
        self.lock().until
    }

    /// Keeps the stored response of the end, for the writer to store.
    pub fn keep(&self, stored: Stored) {
        self.lock().kept = Some(Arc::new(stored));
    }

    /// The stored response of the end, if the generation kept one.
    pub fn kept(&self) -> Option<Arc<Stored>> {
        self.lock().kept.clone()
    }

    /// Whether a writer copies it into the shared store now.
    pub fn mirrored(&self) -> bool {
        self.mirrored.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Its writer starts (true) or ended (false); its logs knows it
    /// apart from the logs it keeps (a finished one may be forgotten while
    /// its writer still waits for the store: its replica's takeover must
    /// leave it alone all the same).
    pub fn set_mirrored(&self, mirrored: bool) {
        self.mirrored
            .store(mirrored, std::sync::atomic::Ordering::Relaxed);
        if let Some(logs) = self.kept.logs.upgrade() {
            let mut writing = logs.writing.lock().unwrap_or_else(|e| e.into_inner());
            if mirrored {
                writing.insert(self.kept.id.clone());
            } else {
                writing.remove(&self.kept.id);
            }
        }
    }

    /// The events after `after` up to the last checkpoint, with the
    /// response and the checkpoint as of then: one consistent view (under one
    /// lock) for the mirror. Empty before the first checkpoint.
    pub fn snapshot(&self, after: Option<u64>) -> Snapshot {
        let state = self.lock();
        let Some(checkpoint) = &state.checkpoint else {
            return Snapshot::default();
        };
        let through = checkpoint.through.min(state.events.len());
        let from = Self::start(&state, after).min(through);
        Snapshot {
            events: state.events[from..through].to_vec(),
            response: checkpoint.response.clone(),
            done: checkpoint.done,
            checkpoint: Some(checkpoint.value.clone()),
            through,
        }
    }

    /// Events the last checkpoint covers (0 before the first), and whether
    /// the response was done then: what changes with every checkpoint.
    pub fn checkpoint_mark(&self) -> (usize, bool) {
        self.lock()
            .checkpoint
            .as_ref()
            .map_or((0, false), |c| (c.through, c.done))
    }

    /// The index of the first event after sequence number `after`.
    fn start(state: &LiveState, after: Option<u64>) -> usize {
        match after {
            None => 0,
            Some(n) => state
                .events
                .iter()
                .position(|e| e.sequence().is_some_and(|s| s > n))
                .unwrap_or(state.events.len()),
        }
    }

    /// A receiver that wakes at every change.
    pub fn follow(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// The length of `value`'s JSON, without writing it.
pub fn json_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// What the router keeps of background responses, in total and per tenant
/// (a tenant's own, where its tenants file entry says).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveLimits {
    /// Responses kept, in progress or finished.
    pub max: usize,
    /// Bytes of the finished ones.
    pub max_bytes: usize,
    pub per_tenant: usize,
    pub per_tenant_bytes: usize,
}

/// A tenant's own bounds (None: the router's per-tenant default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LiveQuota {
    pub max: Option<usize>,
    pub max_bytes: Option<usize>,
}

/// Why a background response could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LiveRefusal {
    #[error(
        "tenant `{tenant}` has its limit of {max} background responses in progress; retry later"
    )]
    Tenant { tenant: String, max: usize },
    #[error("the router has its limit of {max} background responses in progress; retry later")]
    Full { max: usize },
}

/// The background responses of this router.
#[derive(Debug)]
pub struct LiveResponses {
    logs: Arc<LiveLogs>,
    /// Cancels every background generation (the router stopping).
    pub stop: CancellationToken,
    /// Responses this replica claimed and is taking over (until their
    /// writer starts): its own too.
    taking: Mutex<std::collections::HashSet<String>>,
}

#[derive(Debug)]
struct LiveLogs {
    limits: LiveLimits,
    inner: Mutex<LogsState>,
    /// Responses whose writer copies them into the shared store now, kept
    /// or not among the logs (`Live::set_mirrored`).
    writing: Mutex<std::collections::HashSet<String>>,
}

#[derive(Debug, Default)]
struct LogsState {
    map: HashMap<String, LogEntry>,
    /// Ids, oldest first.
    order: VecDeque<String>,
    tenants: HashMap<String, TenantLives>,
    /// Bytes of the finished ones.
    bytes: usize,
}

#[derive(Debug)]
struct LogEntry {
    live: Arc<Live>,
    /// Its bytes, counted once it is done.
    counted: Option<usize>,
    /// Its tenant's bytes bound.
    max_bytes: usize,
}

/// One tenant's background responses.
#[derive(Debug, Default)]
struct TenantLives {
    count: usize,
    /// Bytes of its finished ones.
    bytes: usize,
}

impl LogsState {
    fn forget(&mut self, id: &str) -> Option<Arc<Live>> {
        let entry = self.map.remove(id)?;
        self.order.retain(|other| other != id);
        let counted = entry.counted.unwrap_or(0);
        self.bytes -= counted;
        if let Some(lives) = self.tenants.get_mut(&entry.live.tenant) {
            lives.count -= 1;
            lives.bytes -= counted;
            if lives.count == 0 {
                self.tenants.remove(&entry.live.tenant);
            }
        }
        Some(entry.live)
    }

    /// The finished one of `tenant` (any tenant's with None) opened longest
    /// ago, whose writer is done with it (one still waiting for the store
    /// stays: its memory is held by the writer anyway, and its readers here
    /// get the rest once it is written).
    fn oldest_finished(&self, tenant: Option<&str>) -> Option<String> {
        self.order
            .iter()
            .find(|id| {
                self.map.get(*id).is_some_and(|entry| {
                    entry.live.done()
                        && !entry.live.mirrored()
                        && tenant.is_none_or(|t| entry.live.tenant == t)
                })
            })
            .cloned()
    }

    /// The tenant that gives up its oldest finished one past the totals: the
    /// one holding the most (`by_bytes`: finished bytes, else count) among
    /// those with one finished.
    fn largest_with_finished(&self, by_bytes: bool) -> Option<String> {
        let mut tenants: Vec<(&String, &TenantLives)> = self.tenants.iter().collect();
        tenants.sort_by_key(|(_, lives)| {
            std::cmp::Reverse(if by_bytes { lives.bytes } else { lives.count })
        });
        tenants
            .into_iter()
            .map(|(tenant, _)| tenant)
            .find(|tenant| self.oldest_finished(Some(tenant)).is_some())
            .cloned()
    }
}

impl LiveLogs {
    fn lock(&self) -> MutexGuard<'_, LogsState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts `id`'s bytes once it is done, then holds its tenant and the
    /// total to their bytes.
    fn settle(&self, id: &str) {
        let mut forgotten = Vec::new();
        let mut inner = self.lock();
        let Some(entry) = inner.map.get_mut(id) else {
            return;
        };
        if entry.counted.is_some() {
            return;
        }
        let bytes = entry.live.kept_bytes();
        let (tenant, tenant_max) = (entry.live.tenant.clone(), entry.max_bytes);
        if bytes > tenant_max.min(self.limits.max_bytes) {
            // Alone past its bound: its log goes (its stored response stays).
            forgotten.extend(inner.forget(id));
            drop(inner);
            return;
        }
        entry.counted = Some(bytes);
        inner.bytes += bytes;
        if let Some(lives) = inner.tenants.get_mut(&tenant) {
            lives.bytes += bytes;
        }
        while inner
            .tenants
            .get(&tenant)
            .is_some_and(|l| l.bytes > tenant_max)
        {
            let Some(oldest) = inner.oldest_finished(Some(&tenant)) else {
                break;
            };
            forgotten.extend(inner.forget(&oldest));
        }
        while inner.bytes > self.limits.max_bytes {
            let Some(oldest) = inner
                .largest_with_finished(true)
                .and_then(|tenant| inner.oldest_finished(Some(&tenant)))
            else {
                break;
            };
            forgotten.extend(inner.forget(&oldest));
        }
        drop(inner);
        drop(forgotten);
    }
}

impl LiveResponses {
    /// At most `max` in all, without per-tenant or byte bounds (tests).
    pub fn new(max: usize) -> Self {
        Self::with_limits(LiveLimits {
            max,
            max_bytes: usize::MAX,
            per_tenant: max,
            per_tenant_bytes: usize::MAX,
        })
    }

    pub fn with_limits(limits: LiveLimits) -> Self {
        let limits = LiveLimits {
            max: limits.max.max(1),
            per_tenant: limits.per_tenant.max(1),
            ..limits
        };
        Self {
            logs: Arc::new(LiveLogs {
                limits,
                inner: Mutex::new(LogsState::default()),
                writing: Mutex::new(std::collections::HashSet::new()),
            }),
            stop: CancellationToken::new(),
            taking: Mutex::new(std::collections::HashSet::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LogsState> {
        self.logs.lock()
    }

    /// A new background response `id` of `tenant`, or why not: its tenant
    /// (or the router) has its limit in progress, none finished to forget.
    pub fn open(
        &self,
        id: &str,
        tenant: &str,
        quota: LiveQuota,
        first: Value,
    ) -> Result<Arc<Live>, LiveRefusal> {
        let limits = &self.logs.limits;
        let per_tenant = quota.max.unwrap_or(limits.per_tenant).clamp(1, limits.max);
        let max_bytes = quota.max_bytes.unwrap_or(limits.per_tenant_bytes);
        let mut forgotten = Vec::new();
        let mut inner = self.lock();
        while inner
            .tenants
            .get(tenant)
            .is_some_and(|l| l.count >= per_tenant)
        {
            let Some(oldest) = inner.oldest_finished(Some(tenant)) else {
                return Err(LiveRefusal::Tenant {
                    tenant: tenant.to_string(),
                    max: per_tenant,
                });
            };
            forgotten.extend(inner.forget(&oldest));
        }
        while inner.map.len() >= limits.max {
            let Some(oldest) = inner
                .largest_with_finished(false)
                .and_then(|tenant| inner.oldest_finished(Some(&tenant)))
            else {
                return Err(LiveRefusal::Full { max: limits.max });
            };
            forgotten.extend(inner.forget(&oldest));
        }
        let live = Arc::new(Live {
            tenant: tenant.to_string(),
            state: Mutex::new(LiveState {
                response: first,
                ..LiveState::default()
            }),
            changed: watch::channel(0).0,
            cancel: self.stop.child_token(),
            fenced: std::sync::atomic::AtomicBool::new(false),
            mirrored: std::sync::atomic::AtomicBool::new(false),
            kept: Kept {
                logs: Arc::downgrade(&self.logs),
                id: id.to_string(),
            },
        });
        inner.forget(id);
        inner.map.insert(
            id.to_string(),
            LogEntry {
                live: live.clone(),
                counted: None,
                max_bytes,
            },
        );
        inner.order.push_back(id.to_string());
        inner.tenants.entry(tenant.to_string()).or_default().count += 1;
        drop(inner);
        drop(forgotten);
        Ok(live)
    }

    /// A background response taken over from another replica: its events so
    /// far, the response as it stands, counted under its tenant's `quota`.
    /// None when its tenant or the router has its limit in progress.
    pub fn adopt(
        &self,
        id: &str,
        tenant: &str,
        quota: LiveQuota,
        response: Value,
        events: Vec<ClientEvent>,
    ) -> Option<Arc<Live>> {
        let live = self.open(id, tenant, quota, response.clone()).ok()?;
        live.push(events, None);
        live.lock().response = response;
        Some(live)
    }

    /// Marks every generation in progress as handed over (the router stops
    /// and another replica goes on with them), then stops them.
    pub fn hand_over_all(&self) {
        let lives: Vec<Arc<Live>> = self.lock().map.values().map(|e| e.live.clone()).collect();
        for live in lives.iter().filter(|live| !live.done()) {
            live.fence();
        }
    }

    /// Background response `id`, if `tenant`'s and generated here (one
    /// handed over goes on elsewhere: its readers read the shared store).
    pub fn get(&self, id: &str, tenant: &str) -> Option<Arc<Live>> {
        self.lock()
            .map
            .get(id)
            .filter(|entry| entry.live.tenant == tenant && !entry.live.fenced())
            .map(|entry| entry.live.clone())
    }

    /// The ids of the responses this replica writes into the shared store
    /// now: its own generations, which its takeover never claims (their
    /// lease may have run out in the store while it was unreachable; their
    /// writer goes on, or finds itself fenced, when it is back).
    pub fn mirrored(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .logs
            .writing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        let taking = self.taking.lock().unwrap_or_else(|e| e.into_inner());
        let more: Vec<String> = taking
            .iter()
            .filter(|id| !ids.contains(id))
            .cloned()
            .collect();
        ids.extend(more);
        ids
    }

    /// This replica claimed `id` and takes it over (`true`), or is done
    /// with that (`false`: its writer started, or it could not go on): its
    /// own generation meanwhile, however long its continuation takes to
    /// start (past the lease it claimed, its next look would claim it again).
    pub fn taking(&self, id: &str, taking: bool) {
        let mut set = self.taking.lock().unwrap_or_else(|e| e.into_inner());
        if taking {
            set.insert(id.to_string());
        } else {
            set.remove(id);
        }
    }

    pub fn forget(&self, id: &str) {
        let forgotten = self.lock().forget(id);
        drop(forgotten);
    }

    /// Responses kept and bytes of the finished ones.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.map.len(), inner.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(n: u64) -> ClientEvent {
        ClientEvent::from_value(&json!({"type": "x", "sequence_number": n}))
    }

    #[test]
    fn events_are_read_from_any_number_and_finished_ones_go_first() {
        let lives = LiveResponses::new(2);
        let a = lives
            .open("a", "t", LiveQuota::default(), json!({}))
            .unwrap_or_else(|_| unreachable!());
        a.push(vec![event(0), event(1), event(2)], None);
        assert_eq!(a.after(None).0.len(), 3);
        assert_eq!(a.after(Some(0)).0, vec![event(1), event(2)]);
        assert_eq!(a.after(Some(9)).0, Vec::<ClientEvent>::new());
        assert!(lives.get("a", "other tenant").is_none());
        let _b = lives
            .open("b", "t", LiveQuota::default(), json!({}))
            .unwrap_or_else(|_| unreachable!());
        // Both in progress: no room.
        assert!(lives
            .open("c", "t", LiveQuota::default(), json!({}))
            .is_err());
        a.push(vec![event(3)], Some(json!({"status": "completed"})));
        assert_eq!(a.response()["status"], "completed");
        assert!(lives
            .open("c", "t", LiveQuota::default(), json!({}))
            .is_ok());
        assert!(
            lives.get("a", "t").is_none(),
            "the finished one was forgotten"
        );
    }

    /// At most `max` responses, a tenant's finished ones at most `bytes`.
    fn tenant_bytes_bounded(max: usize, bytes: usize) -> LiveResponses {
        LiveResponses::with_limits(LiveLimits {
            max,
            max_bytes: usize::MAX,
            per_tenant: max,
            per_tenant_bytes: bytes,
        })
    }

    fn open(lives: &LiveResponses, id: &str, tenant: &str) -> Result<Arc<Live>, LiveRefusal> {
        lives.open(id, tenant, LiveQuota::default(), json!({}))
    }

    #[test]
    fn a_tenant_cannot_hold_every_slot() {
        let lives = LiveResponses::with_limits(LiveLimits {
            max: 4,
            max_bytes: usize::MAX,
            per_tenant: 2,
            per_tenant_bytes: usize::MAX,
        });
        let a1 = open(&lives, "a1", "a");
        assert!(a1.is_ok() && open(&lives, "a2", "a").is_ok());
        assert!(matches!(
            open(&lives, "a3", "a"),
            Err(LiveRefusal::Tenant { max: 2, .. })
        ));
        assert!(open(&lives, "b1", "b").is_ok(), "b still has room");
        // One of a's done: a's next takes its place, not b's.
        if let Ok(a1) = a1 {
            a1.push(vec![event(0)], Some(json!({"status": "completed"})));
        }
        assert!(open(&lives, "a3", "a").is_ok());
        assert!(lives.get("a1", "a").is_none() && lives.get("b1", "b").is_some());
    }

    #[test]
    fn finished_logs_are_bounded_in_bytes() {
        let lives = LiveResponses::with_limits(LiveLimits {
            max: 100,
            max_bytes: 10_000,
            per_tenant: 100,
            per_tenant_bytes: 4_000,
        });
        let big = json!({"text": "x".repeat(1000)});
        let b = open(&lives, "b0", "b").unwrap_or_else(|_| unreachable!());
        b.push(vec![event(0)], Some(big.clone()));
        for n in 0..20 {
            let a = open(&lives, &format!("a{n}"), "a").unwrap_or_else(|_| unreachable!());
            a.push(vec![event(0), event(1)], Some(big.clone()));
            let (_, bytes) = lives.held();
            assert!(bytes <= 10_000, "{bytes}");
        }
        assert!(lives.get("a19", "a").is_some() && lives.get("a10", "a").is_none());
        assert!(lives.get("b0", "b").is_some(), "b's log stays");
        // One larger than its tenant's bound is not kept.
        let huge = open(&lives, "b1", "b").unwrap_or_else(|_| unreachable!());
        huge.push(vec![], Some(json!({"text": "x".repeat(5000)})));
        assert!(lives.get("b1", "b").is_none() && lives.get("b0", "b").is_some());
    }

    #[test]
    fn readers_get_only_what_the_store_has_and_a_handed_over_one_is_read_elsewhere() {
        let lives = LiveResponses::new(4);
        let a = open(&lives, "a", "t").unwrap_or_else(|_| unreachable!());
        a.gate(tokio::time::Instant::now());
        assert!(a.mirrored() && lives.mirrored() == vec!["a".to_string()]);
        a.push(vec![event(0), event(1)], None);
        // Not in the store yet: nothing for readers, however long.
        assert_eq!(a.after(None), (Vec::new(), false));
        a.mark_durable(1);
        assert_eq!(a.after(None), (vec![event(0)], false));
        a.set_mirrored(false);
        assert!(lives.mirrored().is_empty());
        // Handed over: its readers are let go, and read the store instead.
        a.fence();
        assert!(a.after(Some(0)).1);
        assert!(lives.get("a", "t").is_none());
    }

    /// A response finished here while the store was down: its writer still
    /// waits to write its end. Neither a new response's room nor its own
    /// bytes bound may make this replica's takeover see it as another's.
    #[test]
    fn a_finished_response_still_being_written_is_never_anothers() {
        let lives = tenant_bytes_bounded(1, 100);
        let a = open(&lives, "a", "t").unwrap_or_else(|_| unreachable!());
        a.gate(tokio::time::Instant::now());
        a.push(vec![event(0)], Some(json!({"status": "completed"})));
        // Its log is not given up for a new one while it is written.
        assert!(open(&lives, "b", "t").is_err());
        assert!(lives.get("a", "t").is_some());
        assert_eq!(lives.mirrored(), vec!["a".to_string()]);
        // Larger than its tenant's bound: its log goes, its writer not.
        let lives = tenant_bytes_bounded(4, 100);
        let big = open(&lives, "big", "t").unwrap_or_else(|_| unreachable!());
        big.gate(tokio::time::Instant::now());
        big.push(vec![], Some(json!({"text": "x".repeat(500)})));
        assert!(lives.get("big", "t").is_none());
        assert_eq!(lives.mirrored(), vec!["big".to_string()]);
        // Its writer done: no longer this replica's.
        big.set_mirrored(false);
        assert!(lives.mirrored().is_empty());
    }
}
