//! Membership: which engine instances exist, their role, model, lifecycle and load;
//! how the router learns of them (self-registration, static instances
//! `static_instances.rs`, each engine's own model list `membership/model_list.rs`).
//!
//! One abstraction, two backends. Every router keeps a local [`view::View`] that
//! the routing hot path reads (never a network round trip per request); writes
//! (register, heartbeat, drain, activate, remove) go through a [`Store`]:
//! - [`memory`] (the default): the view *is* the membership of this one router;
//!   instances whose heartbeats stop for their TTL are marked dead by a reaper.
//! - `etcd` (`--etcd URL`, cargo feature `etcd`): each instance is a key under a
//!   prefix bound to an etcd lease (TTL = heartbeat TTL) that heartbeats to any
//!   replica refresh; a watch applies every change to the view of every replica.
//!
//! An instance's `Arc<Instance>` is updated in place when its state changes (never
//! swapped for a new one while its identity is the same), so that a stream holding
//! it sees the change through [`Instance::subscribe`]. In-flight counts are local
//! to each router.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod load;
pub mod machine;
pub mod memory;
pub mod model_list;
pub mod static_instances;
pub mod status;
pub mod view;

use crate::config::MembershipArgs;
use crate::prefix::{BlockIndex, KvEventBatch};
use futures_util::future::BoxFuture;
use load::{EngineLoad, Reported};
use machine::{Change, Machine, Verdict};
use serde::{Deserialize, Serialize};
use status::StoreStatus;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use view::View;

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
    pub fn serves(self, pick: Pick) -> bool {
        matches!(
            (self, pick),
            (Role::Both, _) | (Role::Prefill, Pick::Prefill) | (Role::Decode, Pick::Decode)
        )
    }
}

/// What an instance is picked for: the step of a request it will serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// Lifecycle of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Ready => "ready",
            Lifecycle::Draining => "draining",
            Lifecycle::Migrating => "migrating",
            Lifecycle::Dead => "dead",
        }
    }
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
    /// A static instance (an engine without the agent, `--prefill`/`--decode`
    /// or the admin API): it sends no heartbeats, so it never expires; it is
    /// kept until removed, out of rotation while its health probes fail.
    #[serde(default)]
    pub persistent: bool,
    /// The instance's credential: issued by the registry, never read from a
    /// registrant's body.
    #[serde(skip)]
    pub credential: Option<String>,
}

/// Whether `id` may name an instance: it goes into URL paths (heartbeat,
/// drain) and etcd keys unescaped. Registrations through the API and records
/// read from etcd are held to it alike.
pub fn valid_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

impl Registration {
    /// The id the instance asked for, or a new one.
    pub fn id_or_new(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("inst-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]))
    }
}

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
    credential: String,
    /// Its state machine (stored state and this replica's verdict); every
    /// change goes through [`Instance::apply`].
    machine: Mutex<Machine>,
    /// The machine's lifecycle as a watch, so that the streams running on the
    /// instance learn at once that it died or is being migrated away from.
    lifecycle: watch::Sender<Lifecycle>,
    last_heartbeat: Mutex<Instant>,
    /// The load its last heartbeat to this replica reported.
    reported: Mutex<Option<Reported>>,
    /// The prompt blocks its KV cache holds, from the KV events its agent
    /// forwarded to this replica.
    blocks: Mutex<BlockIndex>,
    inflight: AtomicUsize,
    served: AtomicU64,
    /// The etcd lease the instance's key is bound to (0: none, memory backend).
    lease: AtomicI64,
    /// Revision of the membership record last applied (etcd mod_revision, or a
    /// local counter): older changes arriving late are ignored.
    revision: AtomicI64,
    /// The view's membership generation, bumped by every lifecycle change so
    /// that the view's cached candidate lists are rebuilt.
    generation: Arc<AtomicU64>,
}

impl Instance {
    fn new(id: String, reg: Registration, generation: Arc<AtomicU64>) -> Self {
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
    fn apply(&self, event: Change) -> (Lifecycle, Lifecycle) {
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

    fn verdict(&self) -> Verdict {
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

    fn touch(&self) {
        *self
            .last_heartbeat
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    fn heartbeat_age(&self) -> Duration {
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

    fn revision(&self) -> i64 {
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

    fn report_load(&self, load: EngineLoad) {
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

    fn apply_kv_events(&self, batch: &KvEventBatch, cap: usize) {
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
    fn same_identity(&self, other: &Instance) -> bool {
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

/// Errors of membership writes.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The shared membership store (etcd) cannot be reached now: the write was
    /// not made. Routing goes on from the last view.
    #[error("membership store unreachable: {0}")]
    Unavailable(String),
    /// A record in the store that this router cannot read.
    #[error("invalid membership record for `{id}`: {message}")]
    Corrupt { id: String, message: String },
    #[error("invalid membership configuration: {0}")]
    Config(String),
    /// The id is held by a live instance whose credential was not presented.
    #[error("instance id `{0}` is taken by a live instance; present its credential or wait for its registration to expire")]
    Taken(String),
    /// A heartbeat or deregistration without the instance's credential.
    #[error("the credential presented is not that of instance `{0}`")]
    WrongCredential(String),
    /// `--max-instances` reached.
    #[error("the registry holds its maximum of {0} instances")]
    Full(usize),
}

/// Where membership writes go; reads always come from the local view.
pub trait Store: Send + Sync {
    /// Adds (or re-registers) an instance; it is `Ready` afterwards. What it
    /// may replace is checked in the same step as the write ([`Replace`]), so
    /// that two registrations of one id cannot both win; `reg.credential` is
    /// the fresh credential a vacant id gets.
    fn register(
        &self,
        reg: Registration,
        replace: Replace,
    ) -> BoxFuture<'_, Result<Arc<Instance>, RegistryError>>;
    /// Refreshes an instance's liveness. `false` when it is unknown (or its lease
    /// has expired): the instance should register again.
    /// The caller checked `credential` against the local view; a backend that
    /// looks the instance up elsewhere (etcd) checks it against what it finds.
    fn heartbeat<'a>(
        &'a self,
        id: &'a str,
        credential: &'a str,
    ) -> BoxFuture<'a, Result<bool, RegistryError>>;
    /// Drain, migrate, activate. `false` when unknown.
    fn set_lifecycle<'a>(
        &'a self,
        id: &'a str,
        state: Lifecycle,
    ) -> BoxFuture<'a, Result<bool, RegistryError>>;
    /// Forgets an instance. `false` when unknown.
    fn remove<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, RegistryError>>;
    /// Starts the tasks that keep the local view current (reaper, watch); they
    /// stop when `shutdown` is cancelled.
    fn spawn(&self, tasks: &mut JoinSet<()>, shutdown: CancellationToken);
    /// Backend name and connectivity, for `/ready` and the metrics.
    fn status(&self) -> StoreStatus;
}

/// How to reach etcd (`--etcd*`).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "etcd"), allow(dead_code))] // etcd's only
pub struct EtcdConfig {
    /// Comma-separated endpoint URLs (`https://` with TLS).
    pub endpoints: String,
    pub prefix: String,
    pub timeout: Duration,
    /// CA certificate (PEM) that the server's certificate must chain to.
    pub ca_file: Option<std::path::PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS.
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// User and password for etcd's own authentication.
    pub user: Option<(String, String)>,
    /// Where instances may live: a record in etcd that names another place is
    /// refused, as its registration through the API would have been.
    pub upstreams: crate::engines::addresses::UpstreamPolicy,
}

impl EtcdConfig {
    /// How to reach etcd, from its group of flags (None: no `--etcd`): the
    /// certificate and its key, the user and its password, each a pair or
    /// nothing; and `upstreams`, which the records read from etcd are held to.
    pub fn new(
        args: &crate::config::EtcdArgs,
        upstreams: &crate::engines::addresses::UpstreamPolicy,
    ) -> Option<Self> {
        let endpoints = args.etcd.clone()?;
        Some(Self {
            endpoints,
            prefix: args.etcd_prefix.clone(),
            timeout: args.etcd_timeout,
            ca_file: args.etcd_ca_file.clone(),
            identity: args.etcd_cert_file.clone().zip(args.etcd_key_file.clone()),
            user: args.etcd_user.clone().zip(args.etcd_password.clone()),
            upstreams: upstreams.clone(),
        })
    }
}

/// Who asks to (re-)register or remove an id.
#[derive(Debug, Clone, Copy)]
pub enum Claim<'a> {
    /// The admin API: may replace a live instance.
    Admin,
    /// A registrant, with the credential it was given, if any.
    Registrant(Option<&'a str>),
}

/// What a registration may replace under its id. The store decides in the
/// same step as its write (a lock for memory, an etcd transaction), because a
/// check followed by a write lets two first registrations of one id both
/// succeed, the later silently replacing the earlier.
#[derive(Debug, Clone)]
pub enum Replace {
    /// A vacant or expired id only (a registrant without a credential).
    Vacant,
    /// A vacant or expired id, or a live one holding this credential.
    Holder(String),
    /// Anything (the admin API); the instance gets a new credential.
    Anything,
}

impl Replace {
    /// The credential the registration writes, given the credential of the
    /// live record under its id (`None`: vacant or expired): the holder keeps
    /// its own, a vacant id gets `fresh`. `None` when it may not replace.
    pub(crate) fn resolve(&self, held: Option<&str>, fresh: &str) -> Option<String> {
        match (self, held) {
            (Replace::Anything, _) | (_, None) => Some(fresh.to_string()),
            (Replace::Holder(given), Some(held)) if credential_matches(held, Some(given)) => {
                Some(held.to_string())
            }
            _ => None,
        }
    }
}

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

/// Whether `given` is the credential `expected` (constant time; an empty
/// `expected` matches nothing).
pub(crate) fn credential_matches(expected: &str, given: Option<&str>) -> bool {
    use subtle::ConstantTimeEq;
    match given {
        Some(given) if !expected.is_empty() => {
            bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
        }
        _ => false,
    }
}

/// A new instance credential: 128 bits from the OS CSPRNG (rand's thread
/// RNG is a CSPRNG reseeded from it), hex.
fn new_credential() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl From<RegistryError> for crate::error::ApiError {
    fn from(err: RegistryError) -> Self {
        use crate::error::ApiError;
        match err {
            RegistryError::Taken(_) => ApiError::Conflict(err.to_string()),
            RegistryError::WrongCredential(_) => ApiError::Forbidden(err.to_string()),
            _ => ApiError::Unavailable(err.to_string()),
        }
    }
}

/// Runs `work` every `period` on `tasks` until `shutdown` (the sweeps both
/// stores run over their view: reaping missed heartbeats, reviving marks).
pub(crate) fn every(
    tasks: &mut JoinSet<()>,
    shutdown: CancellationToken,
    period: Duration,
    mut work: impl FnMut() + Send + 'static,
) {
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => work(),
            }
        }
    });
}

/// How often a store sweeps its view: a quarter of the heartbeat TTL.
pub(crate) fn sweep_period(ttl: Duration) -> Duration {
    (ttl / 4).max(Duration::from_millis(100))
}
