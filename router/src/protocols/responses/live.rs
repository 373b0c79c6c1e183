//! Background responses (`background: true`): each one's events, kept as its
//! generation makes them, so that any client may read them again from any
//! sequence number (`GET /v1/responses/{id}?stream=true&starting_after=N`)
//! and follow the rest live, or cancel it. Bounded: at most `max` responses,
//! those finished longest ago forgotten first (their stored response stays in
//! the store); a generation in progress is never forgotten.

use crate::protocols::event::Event;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
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
}

#[derive(Debug, Default)]
struct LiveState {
    events: Vec<Event>,
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
    pub events: Vec<Event>,
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
    pub fn push(&self, events: Vec<Event>, end: Option<Value>) {
        self.push_checkpointed(events, end, None);
    }

    /// `push`, with the checkpoint as of these events (kept as it was when
    /// None).
    pub fn push_checkpointed(
        &self,
        events: Vec<Event>,
        end: Option<Value>,
        checkpoint: Option<Value>,
    ) {
        let mut state = self.lock();
        // The response as its last event carries it (the end's is given).
        if end.is_none() {
            if let Some(response) = events.iter().rev().find_map(Event::response) {
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
    pub fn after(&self, after: Option<u64>) -> (Vec<Event>, bool) {
        let state = self.lock();
        let visible = state.durable.unwrap_or(usize::MAX).min(state.events.len());
        let from = Self::start(&state, after).min(visible);
        let ended = self.fenced() || (state.done && visible == state.events.len());
        (state.events[from..visible].to_vec(), ended)
    }

    /// From now on, readers get only the events the shared store has
    /// (`mark_durable`); those so far count as had.
    pub fn gate(&self) {
        let mut state = self.lock();
        state.durable = Some(state.events.len());
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

    /// The store cannot be written: readers get every event (the response
    /// is no longer durable; its replica's failure would end it).
    pub fn ungate(&self) {
        let mut state = self.lock();
        if state.durable.take().is_some() {
            drop(state);
            self.changed.send_modify(|n| *n += 1);
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

/// The background responses of this router.
#[derive(Debug)]
pub struct LiveResponses {
    max: usize,
    inner: Mutex<Inner>,
    /// Cancels every background generation (the router stopping).
    pub stop: CancellationToken,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<String, Arc<Live>>,
    order: VecDeque<String>,
}

impl LiveResponses {
    pub fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            inner: Mutex::new(Inner::default()),
            stop: CancellationToken::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new background response `id` of `tenant`, or None when `max` are
    /// in progress (none finished to forget).
    pub fn open(&self, id: &str, tenant: &str, first: Value) -> Option<Arc<Live>> {
        let mut inner = self.lock();
        while inner.map.len() >= self.max {
            let finished = inner
                .order
                .iter()
                .position(|id| inner.map.get(id).is_none_or(|live| live.done()))?;
            if let Some(old) = inner.order.remove(finished) {
                inner.map.remove(&old);
            }
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
        });
        inner.map.insert(id.to_string(), live.clone());
        inner.order.push_back(id.to_string());
        Some(live)
    }

    /// A background response taken over from another replica: its events so
    /// far, the response as it stands. None when `max` are in progress.
    pub fn adopt(
        &self,
        id: &str,
        tenant: &str,
        response: Value,
        events: Vec<Event>,
    ) -> Option<Arc<Live>> {
        let live = self.open(id, tenant, response.clone())?;
        live.push(events, None);
        live.lock().response = response;
        Some(live)
    }

    /// Marks every generation in progress as handed over (the router stops
    /// and another replica goes on with them), then stops them.
    pub fn hand_over_all(&self) {
        let lives: Vec<Arc<Live>> = self.lock().map.values().cloned().collect();
        for live in lives.iter().filter(|live| !live.done()) {
            live.fence();
        }
    }

    /// Background response `id`, if `tenant`'s.
    pub fn get(&self, id: &str, tenant: &str) -> Option<Arc<Live>> {
        self.lock()
            .map
            .get(id)
            .filter(|live| live.tenant == tenant)
            .cloned()
    }

    pub fn forget(&self, id: &str) {
        let mut inner = self.lock();
        inner.map.remove(id);
        inner.order.retain(|other| other != id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(n: u64) -> Event {
        Event::from_value(&json!({"type": "x", "sequence_number": n}))
    }

    #[test]
    fn events_are_read_from_any_number_and_finished_ones_go_first() {
        let lives = LiveResponses::new(2);
        let a = lives
            .open("a", "t", json!({}))
            .unwrap_or_else(|| unreachable!());
        a.push(vec![event(0), event(1), event(2)], None);
        assert_eq!(a.after(None).0.len(), 3);
        assert_eq!(a.after(Some(0)).0, vec![event(1), event(2)]);
        assert_eq!(a.after(Some(9)).0, Vec::<Event>::new());
        assert!(lives.get("a", "other tenant").is_none());
        let _b = lives
            .open("b", "t", json!({}))
            .unwrap_or_else(|| unreachable!());
        // Both in progress: no room.
        assert!(lives.open("c", "t", json!({})).is_none());
        a.push(vec![event(3)], Some(json!({"status": "completed"})));
        assert_eq!(a.response()["status"], "completed");
        assert!(lives.open("c", "t", json!({})).is_some());
        assert!(
            lives.get("a", "t").is_none(),
            "the finished one was forgotten"
        );
    }
}
