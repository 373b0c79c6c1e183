//! The local view of the membership: what the routing hot path reads.
//!
//! Both backends write into it: the memory store directly, the etcd store with
//! its own writes and with every change its watch sees. Each change carries a
//! revision; a change older than what an instance already reflects is ignored,
//! so that a local write and the watch echo of it (or a late event) can arrive
//! in any order. State changes update the instance's `Arc` in place.

use super::instance::Instance;
use super::machine::Change;
use super::registration::{Lifecycle, Pick, Registration};
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

#[derive(Debug)]
pub struct View {
    instances: DashMap<String, Arc<Instance>>,
    /// Local heartbeat TTL (memory backend). `None`: liveness is decided by
    /// the store (etcd leases), so the view does not age instances itself.
    expiry: Option<Duration>,
    /// Revisions for stores without their own (memory).
    clock: AtomicI64,
    /// Bumped by every change of membership or lifecycle.
    generation: Arc<AtomicU64>,
    /// Ready instances per (phase, model), sorted by id, as of a generation:
    /// the routing path filters and sorts a thousand instances once per change
    /// instead of twice per request.
    candidates: RwLock<Candidates>,
}

#[derive(Debug, Default)]
struct Candidates {
    generation: u64,
    /// Indexed by phase (prefill, decode), then model.
    lists: [HashMap<String, Arc<[Arc<Instance>]>>; 2],
}

fn slot(pick: Pick) -> usize {
    match pick {
        Pick::Prefill => 0,
        Pick::Decode => 1,
    }
}

impl View {
    pub fn new(expiry: Option<Duration>) -> Self {
        Self {
            instances: DashMap::new(),
            expiry,
            clock: AtomicI64::new(0),
            generation: Arc::new(AtomicU64::new(1)),
            candidates: RwLock::new(Candidates::default()),
        }
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// A fresh local revision (memory backend).
    pub fn next_revision(&self) -> i64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn len(&self) -> usize {
        self.instances.len()
    }

    /// Applies a registration (or a record of one) at `revision`: a new instance
    /// is added; the same incarnation (same role, URL, model, ctrl) is updated in
    /// place; a different one replaces it, and the old one is marked dead so that
    /// the streams still on it move. Returns the instance now in the view.
    pub fn put(
        &self,
        id: String,
        reg: Registration,
        lifecycle: Lifecycle,
        lease: i64,
        revision: i64,
    ) -> Arc<Instance> {
        let fresh = Instance::new(id.clone(), reg, self.generation.clone());
        match self.instances.entry(id) {
            Entry::Occupied(mut entry) => {
                let current = entry.get().clone();
                if revision <= current.revision() {
                    return current;
                }
                if current.same_identity(&fresh) {
                    current.revision.store(revision, Ordering::Relaxed);
                    current.lease.store(lease, Ordering::Relaxed);
                    current.touch();
                    if current.lifecycle() != lifecycle {
                        tracing::info!(id = %current.id, state = ?lifecycle, "instance state changed");
                    }
                    current.apply(Change::Stored(lifecycle));
                    return current;
                }
                tracing::info!(id = %current.id, url = %fresh.url, "instance re-registered as a new incarnation");
                let fresh = Arc::new(with_state(fresh, lifecycle, lease, revision));
                entry.insert(fresh.clone());
                current.apply(Change::Gone);
                self.changed();
                fresh
            }
            Entry::Vacant(entry) => {
                let fresh = Arc::new(with_state(fresh, lifecycle, lease, revision));
                tracing::info!(id = %fresh.id, role = ?fresh.role, url = %fresh.url, model = %fresh.model, "instance registered");
                entry.insert(fresh.clone());
                self.changed();
                fresh
            }
        }
    }

    /// Sets an instance's lifecycle in place. `false` when unknown.
    pub fn set_lifecycle(&self, id: &str, state: Lifecycle, revision: i64) -> bool {
        let Some(instance) = self.get(id) else {
            return false;
        };
        instance.revision.fetch_max(revision, Ordering::Relaxed);
        if state == Lifecycle::Ready {
            instance.touch();
        }
        instance.apply(Change::Stored(state));
        tracing::info!(%id, ?state, "instance state changed");
        true
    }

    /// This replica's own finding that a ready instance is gone (connect refused).
    pub fn mark_dead(&self, id: &str) {
        let Some(instance) = self.get(id) else {
            return;
        };
        let now = std::time::Instant::now();
        if instance.apply(Change::Unreachable(now)) == (Lifecycle::Ready, Lifecycle::Dead) {
            tracing::warn!(%id, "instance unreachable; marked dead");
        }
    }

    /// The health checker's finding that a ready instance's server fails its
    /// probes: dead until a probe succeeds again (see [`Instance::is_unhealthy`]).
    pub fn mark_unhealthy(&self, id: &str) {
        let Some(instance) = self.get(id) else {
            return;
        };
        if instance.apply(Change::Unhealthy) == (Lifecycle::Ready, Lifecycle::Dead) {
            tracing::warn!(%id, "instance fails its health checks; marked dead");
        }
    }

    /// A probe of an instance marked unhealthy succeeded: it gets its stored
    /// state back, unless something else declared it dead since.
    pub fn mark_healthy(&self, id: &str) {
        let Some(instance) = self.get(id) else {
            return;
        };
        let (before, after) = instance.apply(Change::Healthy);
        if before != after {
            tracing::info!(%id, state = ?after, "instance passes its health checks again");
        }
    }

    /// Gives instances marked dead by `mark_dead` more than `after` ago their
    /// stored state back (etcd: they are still in the view, so their lease is
    /// being kept alive by heartbeats; a dead one's key would have expired).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))] // etcd's only
    pub fn revive(&self, after: Duration) {
        let now = std::time::Instant::now();
        for entry in self.instances.iter() {
            let (before, state) = entry.apply(Change::Revive { now, after });
            if before != state {
                tracing::info!(id = %entry.id, ?state, "instance still heartbeats; back from a local dead mark");
            }
        }
    }

    /// Records a heartbeat this router received. A dead instance that heartbeats
    /// again is ready again, unless its health probes fail. `None` when unknown.
    pub fn heartbeat(&self, id: &str) -> Option<Arc<Instance>> {
        let instance = self.get(id)?;
        instance.touch();
        let (before, after) = instance.apply(Change::Heartbeat);
        if before != after {
            tracing::info!(%id, state = ?after, "instance is alive again");
        }
        Some(instance)
    }

    /// Removes an instance unless it changed after `revision` (`None`: always).
    /// With `dead`, its streams are told it died (lease expired, or vanished from
    /// the store); a deliberate deregistration lets in-flight streams finish.
    pub fn remove(&self, id: &str, revision: Option<i64>, dead: bool) -> bool {
        let removed = self
            .instances
            .remove_if(id, |_, i| revision.is_none_or(|r| i.revision() < r));
        let Some((_, instance)) = removed else {
            return false;
        };
        self.changed();
        if dead {
            tracing::warn!(%id, "instance is gone from the membership; marked dead");
            instance.apply(Change::Gone);
        } else {
            tracing::info!(%id, "instance removed");
        }
        true
    }

    /// After a full re-list at `revision`: instances the list did not have (and
    /// that did not change since) are gone, and marked dead.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))] // etcd's only
    pub fn retain_listed(&self, listed: &HashSet<String>, revision: i64) {
        let gone: Vec<String> = self
            .instances
            .iter()
            .filter(|e| !listed.contains(e.key()) && e.revision() <= revision)
            .map(|e| e.key().clone())
            .collect();
        for id in gone {
            self.remove(&id, Some(revision + 1), true);
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

    fn eligible_now(&self, instance: &Instance) -> bool {
        match self.expiry {
            Some(ttl) => instance.is_eligible(ttl),
            None => instance.lifecycle() == Lifecycle::Ready,
        }
    }

    /// Instances that may take a new `phase` request for `model`, sorted by id.
    pub fn eligible(&self, model: &str, pick: Pick) -> Vec<Arc<Instance>> {
        let ready = self.ready(model, pick);
        match self.expiry {
            // The local heartbeat TTL can lapse between two changes.
            Some(_) => ready
                .iter()
                .filter(|i| self.eligible_now(i))
                .cloned()
                .collect(),
            None => ready.to_vec(),
        }
    }

    /// Ready instances for (model, phase), from the cache when it is current.
    fn ready(&self, model: &str, pick: Pick) -> Arc<[Arc<Instance>]> {
        let generation = self.generation.load(Ordering::Acquire);
        {
            let cache = self.candidates.read().unwrap_or_else(|e| e.into_inner());
            if cache.generation == generation {
                if let Some(list) = cache.lists[slot(pick)].get(model) {
                    return list.clone();
                }
            }
        }
        let mut list: Vec<Arc<Instance>> = self
            .instances
            .iter()
            .filter(|e| {
                e.model == model && e.role.serves(pick) && e.lifecycle() == Lifecycle::Ready
            })
            .map(|e| e.value().clone())
            .collect();
        list.sort_by(|a, b| a.id.cmp(&b.id));
        let list: Arc<[Arc<Instance>]> = list.into();
        let mut cache = self.candidates.write().unwrap_or_else(|e| e.into_inner());
        if cache.generation < generation {
            *cache = Candidates {
                generation,
                ..Candidates::default()
            };
        }
        // A list computed before a newer change is returned but not cached.
        if cache.generation == generation {
            cache.lists[slot(pick)].insert(model.to_string(), list.clone());
        }
        list
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
            !self.eligible(m, Pick::Prefill).is_empty()
                && !self.eligible(m, Pick::Decode).is_empty()
        })
    }

    /// Whether an instance's registration still holds its id: its heartbeats
    /// are within the TTL (local TTL), or its key exists (the store decides,
    /// and the view holds only what the store has).
    pub fn is_live(&self, instance: &Instance) -> bool {
        instance.persistent
            || self
                .expiry
                .is_none_or(|ttl| instance.heartbeat_age() <= ttl)
    }

    /// Marks instances whose heartbeats stopped for the TTL as dead, and evicts
    /// those silent for the TTL plus `grace` (local TTL only): the registry
    /// stays bounded however many ids come and go.
    pub fn reap(&self, grace: Duration) {
        let Some(ttl) = self.expiry else {
            return;
        };
        let mut evicted = Vec::new();
        for entry in self.instances.iter().filter(|e| !e.persistent) {
            let age = entry.heartbeat_age();
            if age > ttl && entry.apply(Change::Expired).0 != Lifecycle::Dead {
                tracing::warn!(id = %entry.id, "instance missed heartbeats for its TTL; marked dead");
            }
            if age > ttl + grace {
                evicted.push(entry.id.clone());
            }
        }
        for id in evicted {
            let removed = self
                .instances
                .remove_if(&id, |_, i| !i.persistent && i.heartbeat_age() > ttl + grace);
            if removed.is_some() {
                tracing::info!(%id, "dead instance evicted");
                self.changed();
            }
        }
    }
}

fn with_state(instance: Instance, lifecycle: Lifecycle, lease: i64, revision: i64) -> Instance {
    instance.lease.store(lease, Ordering::Relaxed);
    instance.revision.store(revision, Ordering::Relaxed);
    instance.apply(Change::Stored(lifecycle));
    instance
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::membership::registration::Role;

    fn reg(url: &str) -> Registration {
        Registration {
            role: Role::Decode,
            url: url.into(),
            model: "m".into(),
            ctrl: None,
            id: None,
            persistent: false,
            credential: None,
        }
    }

    #[test]
    fn state_changes_update_the_same_arc_and_notify_watchers() {
        let view = View::new(None);
        let first = view.put("a".into(), reg("http://x"), Lifecycle::Ready, 7, 10);
        assert_eq!(view.eligible("m", Pick::Decode).len(), 1);
        let mut watcher = first.subscribe();
        let again = view.put("a".into(), reg("http://x"), Lifecycle::Migrating, 7, 11);
        assert!(Arc::ptr_eq(&first, &again));
        assert!(watcher.has_changed().unwrap());
        assert_eq!(*watcher.borrow_and_update(), Lifecycle::Migrating);
        assert!(view.eligible("m", Pick::Decode).is_empty());
    }

    #[test]
    fn cached_candidates_follow_every_change() {
        let view = View::new(None);
        let ids = |v: &View| -> Vec<String> {
            v.eligible("m", Pick::Decode)
                .iter()
                .map(|i| i.id.clone())
                .collect()
        };
        view.put("b".into(), reg("http://b"), Lifecycle::Ready, 1, 1);
        view.put("a".into(), reg("http://a"), Lifecycle::Ready, 2, 2);
        assert_eq!(ids(&view), ["a", "b"]);
        view.mark_dead("a");
        assert_eq!(ids(&view), ["b"]);
        view.revive(Duration::ZERO);
        assert_eq!(ids(&view), ["a", "b"]);
        view.put("c".into(), reg("http://c"), Lifecycle::Draining, 3, 3);
        view.set_lifecycle("c", Lifecycle::Ready, 4);
        assert_eq!(ids(&view), ["a", "b", "c"]);
        view.remove("b", None, false);
        assert_eq!(ids(&view), ["a", "c"]);
        assert!(view.eligible("m", Pick::Prefill).is_empty());
    }

    #[test]
    fn late_changes_are_ignored() {
        let view = View::new(None);
        let first = view.put("a".into(), reg("http://x"), Lifecycle::Draining, 7, 12);
        view.put("a".into(), reg("http://x"), Lifecycle::Ready, 7, 11);
        assert_eq!(first.lifecycle(), Lifecycle::Draining);
        assert!(!view.remove("a", Some(12), true));
        assert!(view.get("a").is_some());
        assert!(view.remove("a", Some(13), true));
        assert_eq!(first.lifecycle(), Lifecycle::Dead);
    }

    #[test]
    fn a_new_incarnation_replaces_and_kills_the_old_one() {
        let view = View::new(None);
        let old = view.put("a".into(), reg("http://x"), Lifecycle::Ready, 7, 1);
        let new = view.put("a".into(), reg("http://y"), Lifecycle::Ready, 8, 2);
        assert!(!Arc::ptr_eq(&old, &new));
        assert_eq!(old.lifecycle(), Lifecycle::Dead);
        assert_eq!(view.eligible("m", Pick::Decode).len(), 1);
    }

    #[test]
    fn a_local_dead_mark_ends_when_the_instance_outlives_it() {
        let view = View::new(None);
        let instance = view.put("a".into(), reg("http://x"), Lifecycle::Draining, 7, 1);
        view.mark_dead("a");
        assert_eq!(instance.lifecycle(), Lifecycle::Draining, "only ready ones");
        view.set_lifecycle("a", Lifecycle::Ready, 2);
        view.mark_dead("a");
        assert_eq!(instance.lifecycle(), Lifecycle::Dead);
        view.revive(Duration::from_secs(60));
        assert_eq!(instance.lifecycle(), Lifecycle::Dead, "too early");
        view.revive(Duration::ZERO);
        assert_eq!(instance.lifecycle(), Lifecycle::Ready);
    }

    #[test]
    fn an_unhealthy_instance_comes_back_by_a_probe_not_by_heartbeats() {
        let view = View::new(None);
        let instance = view.put("a".into(), reg("http://x"), Lifecycle::Ready, 7, 1);
        view.mark_unhealthy("a");
        assert_eq!(instance.lifecycle(), Lifecycle::Dead);
        assert!(view.eligible("m", Pick::Decode).is_empty());
        // Its agent still heartbeats; etcd would still hold its key.
        view.heartbeat("a");
        view.revive(Duration::ZERO);
        assert_eq!(instance.lifecycle(), Lifecycle::Dead);
        assert!(instance.is_unhealthy());
        view.mark_healthy("a");
        assert_eq!(instance.lifecycle(), Lifecycle::Ready);
        assert!(!instance.is_unhealthy());
        assert_eq!(view.eligible("m", Pick::Decode).len(), 1);
        // A drained instance keeps its drain: probes only take ready ones out.
        view.set_lifecycle("a", Lifecycle::Draining, 2);
        view.mark_unhealthy("a");
        assert_eq!(instance.lifecycle(), Lifecycle::Draining);
    }

    #[test]
    fn relist_drops_what_the_store_no_longer_has() {
        let view = View::new(None);
        let gone = view.put("a".into(), reg("http://x"), Lifecycle::Ready, 7, 3);
        view.put("b".into(), reg("http://y"), Lifecycle::Ready, 8, 4);
        // Written locally after the list was taken: kept.
        view.put("c".into(), reg("http://z"), Lifecycle::Ready, 9, 20);
        view.retain_listed(&HashSet::from(["b".to_string()]), 10);
        assert_eq!(gone.lifecycle(), Lifecycle::Dead);
        let ids: Vec<String> = view.list().iter().map(|i| i.id.clone()).collect();
        assert_eq!(ids, ["b", "c"]);
    }
}
