//! One engine instance as the router knows it: its registration, its
//! lifecycle (changed in place, so that a stream holding it sees the
//! change), its load and in-flight count, and its prefix index.

use super::load::{EngineLoad, Reported};
use super::machine::{Change, Machine, Verdict};
use super::registration::{credential_matches, Lifecycle, Registration, Role};
use crate::prefix::{BlockIndex, KvEventBatch};
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// One engine instance known to the router.
#[derive(Debug)]
pub struct Instance {
    pub id: String,
    pub role: Role,
    pub url: String,
    pub model: String,
    pub ctrl: Option<String>,
    /// Kept until removed, whatever its heartbeats (see [`Registration`]).
    pub persistent: bool,
    /// What its registrant must present to heartbeat, re-register or
    /// deregister under this id (`x-connex-credential`).
    pub(super) credential: String,
    /// Its state machine (stored state and this replica's verdict); every
    /// change goes through [`Instance::apply`].
    pub(super) machine: Mutex<Machine>,
    /// The machine's lifecycle as a watch, so that the streams running on the
    /// instance learn at once that it died or is being migrated away from.
    pub(super) lifecycle: watch::Sender<Lifecycle>,
    pub(super) last_heartbeat: Mutex<Instant>,
    /// The load its last heartbeat to this replica reported.
    pub(super) reported: Mutex<Option<Reported>>,
    /// The prompt blocks its KV cache holds, from the KV events its agent
    /// forwarded to this replica.
    pub(super) blocks: Mutex<BlockIndex>,
    pub(super) inflight: AtomicUsize,
    pub(super) served: AtomicU64,
    /// The etcd lease the instance's key is bound to (0: none, memory backend).
    pub(super) lease: AtomicI64,
    /// Revision of the membership record last applied (etcd mod_revision, or a
    /// local counter): older changes arriving late are ignored.
    pub(super) revision: AtomicI64,
    /// The view's membership generation, bumped by every lifecycle change so
    /// that the view's cached candidate lists are rebuilt.
    pub(super) generation: Arc<AtomicU64>,
}

impl Instance {
    pub(super) fn new(id: String, reg: Registration, generation: Arc<AtomicU64>) -> Self {
        Self {
            id,
            role: reg.role,
            url: reg.url.trim_end_matches('/').to_string(),
            model: reg.model,
            ctrl: reg.ctrl,
            persistent: reg.persistent,
            credential: reg.credential.unwrap_or_default(),
            machine: Mutex::new(Machine::new(Lifecycle::Ready)),
            lifecycle: watch::Sender::new(Lifecycle::Ready),
            last_heartbeat: Mutex::new(Instant::now()),
            reported: Mutex::new(None),
            blocks: Mutex::new(BlockIndex::default()),
            inflight: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            lease: AtomicI64::new(0),
            revision: AtomicI64::new(0),
            generation,
        }
    }

    pub fn lifecycle(&self) -> Lifecycle {
        *self.lifecycle.borrow()
    }

    /// Lifecycle changes from now on.
    pub fn subscribe(&self) -> watch::Receiver<Lifecycle> {
        self.lifecycle.subscribe()
    }

    /// Applies `event` to the instance's state machine; returns the lifecycle
    /// before and after. A change is published to the watchers and to the
    /// view's candidate cache.
    pub(super) fn apply(&self, event: Change) -> (Lifecycle, Lifecycle) {
        let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
        let before = machine.lifecycle();
        *machine = machine.next(event);
        let after = machine.lifecycle();
        // Published under the lock, so that watchers see changes in order.
        let changed = self.lifecycle.send_if_modified(|current| {
            let changed = *current != after;
            *current = after;
            changed
        });
        if changed {
            self.generation.fetch_add(1, Ordering::Release);
        }
        (before, after)
    }

    pub(super) fn verdict(&self) -> Verdict {
        self.machine
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .verdict()
    }

    /// Whether the health checks declared the instance dead (and still do).
    pub fn is_unhealthy(&self) -> bool {
        self.verdict() == Verdict::Unhealthy
    }

    /// Whether only a successful probe can bring the instance back: it fails
    /// its probes, or it is static (no heartbeat will ever revive it) and a
    /// connect found nothing listening.
    pub fn awaits_probe(&self) -> bool {
        match self.verdict() {
            Verdict::Unhealthy => true,
            Verdict::Unreachable(_) => self.persistent,
            _ => false,
        }
    }

    pub(super) fn touch(&self) {
        *self
            .last_heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    pub(super) fn heartbeat_age(&self) -> Duration {
        self.last_heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }

    /// Whether `given` is this instance's credential (constant time; an
    /// instance without one matches nothing).
    pub fn credential_matches(&self, given: Option<&str>) -> bool {
        credential_matches(&self.credential, given)
    }

    pub(crate) fn credential(&self) -> &str {
        &self.credential
    }

    /// The etcd lease of the instance's key (0 when none).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))] // etcd's only
    pub fn lease(&self) -> i64 {
        self.lease.load(Ordering::Relaxed)
    }

    pub(super) fn revision(&self) -> i64 {
        self.revision.load(Ordering::Relaxed)
    }

    /// Requests this router has in flight on the instance.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// The load the engine last reported to this replica, unless older than
    /// `max_age`.
    pub fn reported_load(&self, max_age: Duration) -> Option<EngineLoad> {
        self.reported
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .and_then(|r| r.fresh(max_age))
    }

    pub(super) fn report_load(&self, load: EngineLoad) {
        *self.reported.lock().unwrap_or_else(|e| e.into_inner()) = Some(Reported {
            load,
            at: Instant::now(),
        });
    }

    /// Runs `read` on the instance's prefix index.
    pub fn with_blocks<T>(&self, read: impl FnOnce(&BlockIndex) -> T) -> T {
        read(&self.blocks.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records a prompt the router sent here, for an engine that reports no
    /// KV events (see [`BlockIndex::remember`]).
    pub fn remember_prompt(
        &self,
        prompt: crate::prefix::hash::Prompt<'_>,
        block_size: usize,
        cap: usize,
    ) {
        self.blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remember(prompt, block_size, cap);
    }

    pub(super) fn apply_kv_events(&self, batch: &KvEventBatch, cap: usize) {
        let mut blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        for event in &batch.events {
            blocks.apply(event, cap);
        }
    }

    /// Whether new requests may go here now, given a local heartbeat TTL
    /// (which a static instance is not held to).
    pub fn is_eligible(&self, ttl: Duration) -> bool {
        self.lifecycle() == Lifecycle::Ready && (self.persistent || self.heartbeat_age() <= ttl)
    }

    /// Same role, URL, model and control address: the same incarnation, whose
    /// state changes are applied in place.
    pub(super) fn same_identity(&self, other: &Instance) -> bool {
        self.role == other.role
            && self.url == other.url
            && self.model == other.model
            && self.ctrl == other.ctrl
            && self.persistent == other.persistent
            && self.credential == other.credential
    }

    /// JSON view for the admin API. `last_heartbeat_ms_ago` is the last heartbeat
    /// *this* router received (with etcd, heartbeats may go to another replica;
    /// the etcd lease is what decides liveness there).
    pub fn view(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id, "role": self.role, "url": self.url, "model": self.model,
            "ctrl": self.ctrl, "persistent": self.persistent,
            "state": self.lifecycle(), "unhealthy": self.is_unhealthy(),
            "inflight": self.inflight(),
            "load": self.reported.lock().unwrap_or_else(|e| e.into_inner()).map(|r| serde_json::json!({
                "running": r.load.running, "waiting": r.load.waiting, "kv_usage": r.load.kv_usage,
                "reported_ms_ago": r.at.elapsed().as_millis() as u64,
            })),
            "served": self.served.load(Ordering::Relaxed),
            "prefix_index_blocks": self.with_blocks(BlockIndex::len),
            "prefix_index_source": self.with_blocks(|b| {
                if b.is_reported() { "kv_events" } else if b.is_empty() { "none" } else { "sent_prompts" }
            }),
            "last_heartbeat_ms_ago": self.heartbeat_age().as_millis() as u64,
        })
    }
}

/// Counts a request as in flight on an instance for as long as it lives.
#[derive(Debug)]
pub struct LoadGuard(Arc<Instance>);

impl LoadGuard {
    pub fn new(instance: Arc<Instance>) -> Self {
        instance.inflight.fetch_add(1, Ordering::Relaxed);
        instance.served.fetch_add(1, Ordering::Relaxed);
        Self(instance)
    }

    pub fn instance(&self) -> &Arc<Instance> {
        &self.0
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}
