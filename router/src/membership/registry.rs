//! The membership of one router, `Registry`: the local view every request
//! reads, and the store behind it that every write goes through.

#[cfg(feature = "etcd")]
use super::etcd;
use super::etcd_config::EtcdConfig;
use super::instance::Instance;
use super::load::EngineLoad;
use super::memory;
use super::registration::{new_credential, Lifecycle, Pick, Registration};
use super::status::StoreStatus;
use super::store::{Claim, RegistryError, Replace, Store};
use super::view::View;
use crate::config::MembershipArgs;
use crate::prefix::KvEventBatch;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The membership of one router: the local view plus the store behind it.
pub struct Registry {
    view: Arc<View>,
    store: Arc<dyn Store>,
    ttl: Duration,
    max_instances: usize,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("backend", &self.store.status().backend)
            .field("instances", &self.view.len())
            .finish()
    }
}

impl Registry {
    /// The in-memory membership of one router.
    pub fn new(args: &MembershipArgs) -> Self {
        let view = Arc::new(View::new(Some(args.heartbeat_ttl)));
        let store = Arc::new(memory::MemoryStore::new(
            view.clone(),
            args.heartbeat_ttl,
            args.dead_instance_grace,
        ));
        Self {
            view,
            store,
            ttl: args.heartbeat_ttl,
            max_instances: args.max_instances,
        }
    }

    /// The backend the configuration asks for: etcd when configured, else memory.
    pub async fn open(
        args: &MembershipArgs,
        etcd: Option<&EtcdConfig>,
    ) -> Result<Self, RegistryError> {
        let Some(etcd) = etcd else {
            return Ok(Self::new(args));
        };
        #[cfg(feature = "etcd")]
        {
            let view = Arc::new(View::new(None));
            let (ttl, max_instances) = (args.heartbeat_ttl, args.max_instances);
            let store = etcd::EtcdStore::connect(etcd, ttl, max_instances, view.clone()).await?;
            Ok(Self {
                view,
                store: Arc::new(store),
                ttl,
                max_instances,
            })
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = etcd;
            Err(RegistryError::Config(
                "--etcd needs a connex-router built with the `etcd` cargo feature \
                 (cargo build --release --features etcd)"
                    .into(),
            ))
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Starts the backend's background tasks (owned by the router).
    pub fn spawn(&self, tasks: &mut JoinSet<()>, shutdown: CancellationToken) {
        self.store.spawn(tasks, shutdown);
    }

    pub fn status(&self) -> StoreStatus {
        self.store.status()
    }

    /// Adds or re-registers an instance; returns it with its credential.
    ///
    /// An id held by a live instance is only re-registered by whoever presents
    /// its credential (it keeps it) or by the admin API (a new one is issued);
    /// anyone else gets [`RegistryError::Taken`]. A new or expired id gets a
    /// new credential.
    pub async fn register(
        &self,
        mut reg: Registration,
        claim: Claim<'_>,
    ) -> Result<(Arc<Instance>, String), RegistryError> {
        let known = reg
            .id
            .as_deref()
            .is_some_and(|id| self.view.get(id).is_some());
        if !known && self.view.len() >= self.max_instances {
            return Err(RegistryError::Full(self.max_instances));
        }
        let replace = match claim {
            Claim::Admin => Replace::Anything,
            Claim::Registrant(Some(given)) => Replace::Holder(given.to_string()),
            Claim::Registrant(None) => Replace::Vacant,
        };
        reg.credential = Some(new_credential());
        let instance = self.store.register(reg, replace).await?;
        let credential = instance.credential().to_string();
        // A registration is a (re)started engine: whatever it cached is gone.
        instance
            .blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        Ok((instance, credential))
    }

    /// Refreshes an instance's heartbeat, and keeps the `load` it reported (in
    /// this replica's view: with etcd, the replica its agent talks to). A dead
    /// instance that heartbeats again is ready again (memory backend); a
    /// draining one stays draining. `false` when unknown (the registrant should
    /// register again).
    pub async fn heartbeat(
        &self,
        id: &str,
        credential: Option<&str>,
        load: Option<EngineLoad>,
    ) -> Result<bool, RegistryError> {
        let instance = self.view.get(id);
        if let Some(instance) = &instance {
            if !instance.credential_matches(credential) {
                return Err(RegistryError::WrongCredential(id.to_string()));
            }
        }
        let known = self
            .store
            .heartbeat(id, credential.unwrap_or_default())
            .await?;
        if let (true, Some(instance), Some(load)) = (known, instance, load) {
            instance.report_load(load);
        }
        Ok(known)
    }

    /// Applies the KV events an instance's agent forwarded to its prefix index
    /// (at most `cap` blocks kept). `false` when unknown.
    pub fn kv_events(
        &self,
        id: &str,
        credential: Option<&str>,
        batch: &KvEventBatch,
        cap: usize,
    ) -> Result<bool, RegistryError> {
        let Some(instance) = self.registrant(id, credential)? else {
            return Ok(false);
        };
        instance.apply_kv_events(batch, cap);
        Ok(true)
    }

    /// The instance `id` if `credential` is its own; `None` when unknown. A
    /// handler asks before it reads a body, so that a caller without the
    /// credential costs no body read.
    pub fn registrant(
        &self,
        id: &str,
        credential: Option<&str>,
    ) -> Result<Option<Arc<Instance>>, RegistryError> {
        let Some(instance) = self.view.get(id) else {
            return Ok(None);
        };
        if !instance.credential_matches(credential) {
            return Err(RegistryError::WrongCredential(id.to_string()));
        }
        Ok(Some(instance))
    }

    /// Removes an instance on behalf of `claim`. `false` when unknown.
    pub async fn remove(&self, id: &str, claim: Claim<'_>) -> Result<bool, RegistryError> {
        let Some(instance) = self.view.get(id) else {
            return Ok(false);
        };
        if let Claim::Registrant(given) = claim {
            if !instance.credential_matches(given) {
                return Err(RegistryError::WrongCredential(id.to_string()));
            }
        }
        self.store.remove(id).await
    }

    /// Sets the lifecycle of an instance (drain / activate). `false` when unknown.
    pub async fn set_lifecycle(&self, id: &str, state: Lifecycle) -> Result<bool, RegistryError> {
        self.store.set_lifecycle(id, state).await
    }

    /// Marks an instance dead now, on proof that it is gone (nothing listens at
    /// its address). This replica's judgement, not written to etcd: with the
    /// memory backend its next heartbeat makes it ready again; with etcd, if its
    /// lease is still kept alive a TTL later (the key did not expire), it was not
    /// gone after all and gets its stored state back.
    pub fn mark_dead(&self, id: &str) {
        self.view.mark_dead(id);
    }

    /// Marks an instance dead because its health probes fail: it stays dead,
    /// whatever its heartbeats say, until [`Registry::mark_healthy`]. This
    /// replica's judgement, like `mark_dead`.
    pub fn mark_unhealthy(&self, id: &str) {
        self.view.mark_unhealthy(id);
    }

    /// A probe of an instance marked unhealthy succeeded: it gets its stored
    /// state back.
    pub fn mark_healthy(&self, id: &str) {
        self.view.mark_healthy(id);
    }

    pub fn get(&self, id: &str) -> Option<Arc<Instance>> {
        self.view.get(id)
    }

    /// Every instance, sorted by id.
    pub fn list(&self) -> Vec<Arc<Instance>> {
        self.view.list()
    }

    /// Instances that may take a new `phase` request for `model`, sorted by id so
    /// that round-robin is stable.
    pub fn eligible(&self, model: &str, pick: Pick) -> Vec<Arc<Instance>> {
        self.view.eligible(model, pick)
    }

    /// Whether any instance (in any state) serves `model`.
    pub fn knows_model(&self, model: &str) -> bool {
        self.view.knows_model(model)
    }

    /// Models served by at least one live instance.
    pub fn models(&self) -> Vec<String> {
        self.view.models()
    }

    /// Whether some model has both a prefill and a decode instance eligible.
    pub fn is_ready(&self) -> bool {
        self.view.is_ready()
    }
}
