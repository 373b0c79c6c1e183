//! Membership: which engine instances exist, their role, model, lifecycle and load.
//!
//! This is the in-memory backend (one router). Instances register themselves and
//! heartbeat; one that misses heartbeats for its TTL is no longer eligible and is
//! marked dead by the reaper.

use dashmap::DashMap;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Which half of P/D an instance serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    /// Whether an instance of this role can serve `phase`.
    pub fn serves(self, phase: Phase) -> bool {
        matches!(
            (self, phase),
            (Role::Both, _) | (Role::Prefill, Phase::Prefill) | (Role::Decode, Phase::Decode)
        )
    }
}

/// The step of a request an instance is chosen for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Prefill,
    Decode,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

/// Lifecycle of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Lifecycle {
    Ready,
    /// No new requests; in-flight ones finish.
    Draining,
    /// Draining, and its live decode streams are moved to other decoders now
    /// (`drain?migrate=true`).
    Migrating,
    /// Heartbeats stopped for longer than the TTL.
    Dead,
}

/// What an instance sends to register.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub role: Role,
    pub url: String,
    pub model: String,
    #[serde(default)]
    pub ctrl: Option<String>,
    #[serde(default)]
    pub id: Option<String>,
}

/// One engine instance known to the router.
#[derive(Debug)]
pub struct Instance {
    pub id: String,
    pub role: Role,
    pub url: String,
    pub model: String,
    pub ctrl: Option<String>,
    /// A watch, so that the streams running on the instance learn at once that
    /// it died or is being migrated away from.
    lifecycle: watch::Sender<Lifecycle>,
    last_heartbeat: Mutex<Instant>,
    inflight: AtomicUsize,
    served: AtomicU64,
}

impl Instance {
    fn new(id: String, reg: Registration) -> Self {
        Self {
            id,
            role: reg.role,
            url: reg.url.trim_end_matches('/').to_string(),
            model: reg.model,
            ctrl: reg.ctrl,
            lifecycle: watch::Sender::new(Lifecycle::Ready),
            last_heartbeat: Mutex::new(Instant::now()),
            inflight: AtomicUsize::new(0),
            served: AtomicU64::new(0),
        }
    }

    pub fn lifecycle(&self) -> Lifecycle {
        *self.lifecycle.borrow()
    }

    /// Lifecycle changes from now on.
    pub fn subscribe(&self) -> watch::Receiver<Lifecycle> {
        self.lifecycle.subscribe()
    }

    fn set_lifecycle(&self, state: Lifecycle) {
        self.lifecycle.send_replace(state);
    }

    fn heartbeat_age(&self) -> Duration {
        self.last_heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }

    /// Requests this router has in flight on the instance.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Whether new requests may go here now.
    pub fn is_eligible(&self, ttl: Duration) -> bool {
        self.lifecycle() == Lifecycle::Ready && self.heartbeat_age() <= ttl
    }

    /// JSON view for the admin API.
    pub fn view(&self) -> serde_json::Value {
        serde_json::json!({
            "id": self.id, "role": self.role, "url": self.url, "model": self.model,
            "ctrl": self.ctrl, "state": self.lifecycle(), "inflight": self.inflight(),
            "served": self.served.load(Ordering::Relaxed),
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
        crate::metrics::instance_inflight(&instance.id, instance.inflight());
        Self(instance)
    }

    pub fn instance(&self) -> &Arc<Instance> {
        &self.0
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
        crate::metrics::instance_inflight(&self.0.id, self.0.inflight());
    }
}

/// The in-memory membership of one router.
#[derive(Debug)]
pub struct Registry {
    instances: DashMap<String, Arc<Instance>>,
    ttl: Duration,
}

impl Registry {
    pub fn new(ttl: Duration) -> Self {
        Self {
            instances: DashMap::new(),
            ttl,
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Adds or replaces an instance; returns it.
    pub fn register(&self, reg: Registration) -> Arc<Instance> {
        let id = reg.id.clone().unwrap_or_else(|| {
            format!("inst-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
        });
        let instance = Arc::new(Instance::new(id.clone(), reg));
        tracing::info!(id = %instance.id, role = ?instance.role, url = %instance.url, model = %instance.model, "instance registered");
        self.instances.insert(id, instance.clone());
        instance
    }

    /// Refreshes an instance's heartbeat. A dead instance that heartbeats again is
    /// ready again; a draining one stays draining. `false` when unknown.
    pub fn heartbeat(&self, id: &str) -> bool {
        let Some(instance) = self.instances.get(id) else {
            return false;
        };
        *instance
            .last_heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Instant::now();
        if instance.lifecycle() == Lifecycle::Dead {
            tracing::info!(%id, "instance is alive again");
            instance.set_lifecycle(Lifecycle::Ready);
        }
        true
    }

    pub fn remove(&self, id: &str) -> bool {
        let removed = self.instances.remove(id).is_some();
        if removed {
            tracing::info!(%id, "instance removed");
        }
        removed
    }

    /// Sets the lifecycle of an instance (drain / activate). `false` when unknown.
    pub fn set_lifecycle(&self, id: &str, state: Lifecycle) -> bool {
        let Some(instance) = self.instances.get(id) else {
            return false;
        };
        instance.set_lifecycle(state);
        if state == Lifecycle::Ready {
            *instance
                .last_heartbeat
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
        tracing::info!(%id, ?state, "instance state changed");
        true
    }

    /// Marks an instance dead now, on proof that it is gone (nothing listens at
    /// its address). Its next heartbeat makes it ready again.
    pub fn mark_dead(&self, id: &str) {
        if let Some(instance) = self.instances.get(id) {
            if instance.lifecycle() == Lifecycle::Ready {
                tracing::warn!(%id, "instance unreachable; marked dead");
                instance.set_lifecycle(Lifecycle::Dead);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Instance>> {
        self.instances.get(id).map(|i| i.clone())
    }

    /// Every instance, sorted by id.
    pub fn list(&self) -> Vec<Arc<Instance>> {
        let mut all: Vec<_> = self.instances.iter().map(|e| e.value().clone()).collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        all
    }

    /// Instances that may take a new `phase` request for `model`, sorted by id so
    /// that round-robin is stable.
    pub fn eligible(&self, model: &str, phase: Phase) -> Vec<Arc<Instance>> {
        let mut out: Vec<_> = self
            .instances
            .iter()
            .filter(|e| e.model == model && e.role.serves(phase) && e.is_eligible(self.ttl))
            .map(|e| e.value().clone())
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Whether any instance (in any state) serves `model`.
    pub fn knows_model(&self, model: &str) -> bool {
        self.instances.iter().any(|e| e.model == model)
    }

    /// Models served by at least one live instance.
    pub fn models(&self) -> Vec<String> {
        let mut models: Vec<String> = self
            .instances
            .iter()
            .filter(|e| e.lifecycle() != Lifecycle::Dead)
            .map(|e| e.model.clone())
            .collect();
        models.sort();
        models.dedup();
        models
    }

    /// Whether some model has both a prefill and a decode instance eligible.
    pub fn is_ready(&self) -> bool {
        self.models().iter().any(|m| {
            !self.eligible(m, Phase::Prefill).is_empty()
                && !self.eligible(m, Phase::Decode).is_empty()
        })
    }

    /// Marks instances whose heartbeats stopped for the TTL as dead.
    pub fn reap(&self) {
        for entry in self.instances.iter() {
            if entry.lifecycle() != Lifecycle::Dead && entry.heartbeat_age() > self.ttl {
                tracing::warn!(id = %entry.id, "instance missed heartbeats for its TTL; marked dead");
                entry.set_lifecycle(Lifecycle::Dead);
            }
        }
    }
}
