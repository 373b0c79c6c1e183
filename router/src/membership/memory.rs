//! The memory backend (the default): the local view is the whole membership of
//! this one router. Writes apply to the view at once; a reaper marks instances
//! whose heartbeats stopped for the TTL as dead.

use super::instance::Instance;
use super::registration::{Lifecycle, Registration};
use super::status::{Connectivity, StoreStatus};
use super::store::{every, sweep_period, RegistryError, Replace, Store};
use super::view::View;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub struct MemoryStore {
    view: Arc<View>,
    ttl: Duration,
    /// How long an expired instance stays listed.
    grace: Duration,
    connectivity: Connectivity,
    /// Serializes registrations (see [`Replace`]).
    registering: std::sync::Mutex<()>,
}

impl MemoryStore {
    pub fn new(view: Arc<View>, ttl: Duration, grace: Duration) -> Self {
        Self {
            view,
            ttl,
            grace,
            connectivity: Connectivity::new("memory", true),
            registering: std::sync::Mutex::new(()),
        }
    }
}

impl Store for MemoryStore {
    fn register(
        &self,
        mut reg: Registration,
        replace: Replace,
    ) -> BoxFuture<'_, Result<Arc<Instance>, RegistryError>> {
        let id = reg.id_or_new();
        // Check and write as one step: registrations are rare, a lock is cheap.
        let result = {
            let _one_at_a_time = self.registering.lock().unwrap_or_else(|p| p.into_inner());
            let held = self.view.get(&id).filter(|i| self.view.is_live(i));
            let fresh = reg.credential.clone().unwrap_or_default();
            match replace.resolve(held.as_deref().map(Instance::credential), &fresh) {
                Some(credential) => {
                    reg.credential = Some(credential);
                    let revision = self.view.next_revision();
                    Ok(self.view.put(id, reg, Lifecycle::Ready, 0, revision))
                }
                None => Err(RegistryError::Taken(id)),
            }
        };
        async move { result }.boxed()
    }

    fn heartbeat<'a>(
        &'a self,
        id: &'a str,
        _credential: &'a str,
    ) -> BoxFuture<'a, Result<bool, RegistryError>> {
        let known = self.view.heartbeat(id).is_some();
        async move { Ok(known) }.boxed()
    }

    fn set_lifecycle<'a>(
        &'a self,
        id: &'a str,
        state: Lifecycle,
    ) -> BoxFuture<'a, Result<bool, RegistryError>> {
        let known = self
            .view
            .set_lifecycle(id, state, self.view.next_revision());
        async move { Ok(known) }.boxed()
    }

    fn remove<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, RegistryError>> {
        let removed = self.view.remove(id, None, false);
        async move { Ok(removed) }.boxed()
    }

    fn spawn(&self, tasks: &mut JoinSet<()>, shutdown: CancellationToken) {
        let view = self.view.clone();
        let grace = self.grace;
        every(tasks, shutdown, sweep_period(self.ttl), move || {
            view.reap(grace)
        });
    }

    fn status(&self) -> StoreStatus {
        self.connectivity.status(false)
    }
}
