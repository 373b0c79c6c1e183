//! The memory backend (the default): the local view is the whole membership of
//! this one router. Writes apply to the view at once; a reaper marks instances
//! whose heartbeats stopped for the TTL as dead.

use super::status::{Connectivity, StoreStatus};
use super::view::View;
use super::{Instance, Lifecycle, Registration, RegistryError, Store};
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
}

impl MemoryStore {
    pub fn new(view: Arc<View>, ttl: Duration, grace: Duration) -> Self {
        Self {
            view,
            ttl,
            grace,
            connectivity: Connectivity::new("memory", true),
        }
    }
}

impl Store for MemoryStore {
    fn register(&self, reg: Registration) -> BoxFuture<'_, Result<Arc<Instance>, RegistryError>> {
        let id = reg.id_or_new();
        let revision = self.view.next_revision();
        let instance = self.view.put(id, reg, Lifecycle::Ready, 0, revision);
        async move { Ok(instance) }.boxed()
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
        super::every(tasks, shutdown, super::sweep_period(self.ttl), move || {
            view.reap(grace)
        });
    }

    fn status(&self) -> StoreStatus {
        self.connectivity.status(false)
    }
}
