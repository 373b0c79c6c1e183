//! Connex router: the cluster's OpenAI endpoint for prefill/decode disaggregated
//! vLLM serving, its control plane, and request resume.
//!
//! # Layout
//!
//! The folders are the layers; a request goes down through them, and no
//! module imports one above it: inside every folder as between folders, the
//! test `module_graph` (`module_graph.rs`) fails on any import cycle between
//! a folder's files, its sub-folders and its own `lib.rs`/`mod.rs`.
//!
//! - `edge/`: the listeners and the routes (`edge/server`, `edge/routes`),
//!   who may call what (`edge/secrets.rs`, `tenants/` for client keys), the
//!   request prologue every generating route starts with
//!   (`edge/routes/prologue.rs`) and the state the routes read
//!   (`edge/app.rs`, with `edge/body_budget.rs`: the request body bytes in
//!   flight); it parses, admits and answers.
//! - `background/`: generation apart from a request: the translation driver
//!   the translated routes feed (`TranslationDriver`), background responses
//!   run to their end, their mirror into the shared store, the takeover of
//!   another replica's; it takes only what it uses of the app
//!   (`BackgroundState`).
//! - `protocols/`: wire formats. SSE; OpenAI's chat and completions as the
//!   phases read and write them (`protocols/openai`: the client body, stop
//!   strings, chunk edits, output, assembly, the `TranslatedOutput` the relay
//!   feeds); the client protocols translated to and from a chat (Responses,
//!   Messages); a translated protocol's events (`client_event.rs`).
//! - `pd/`: a request's phases: tokens, prefill, decode, relay, resume,
//!   re-prefill, continuation, the engine calls they make (`pd/upstream.rs`),
//!   and the router's side of the KV holds (`pd/holds/`); every phase takes
//!   the flow's dependencies (`pd/deps.rs`: `FlowDeps`, as `deps`), never the
//!   app's state.
//! - `store/`: the router's own state: stored responses and background
//!   responses' logs, in memory or in the store every replica shares (Redis).
//! - `journal.rs` (every request in flight and its progress), `policy/`
//!   (choosing an instance; `policy/health.rs`, the probes that take an
//!   engine out of rotation), `prefix/` (which prefixes each engine caches),
//!   `tenants/` (keys, fair queueing, rate limits).
//! - `membership/`: which engines exist (its types, its registry),
//!   registration, static instances; memory or etcd.
//! - `engines/`: the one HTTP client toward engines, the address policy, the
//!   probes' client.
//! - `observe/`: logs, metrics, traces.
//! - `config/` (the flags, one group per concern), `error.rs` (the OpenAI
//!   error body), and here: [`Router`], which starts them all. The binaries
//!   (`bin/`) use the crate as any user would.
//!
//! Only what the binaries and the tests outside the crate use is exported;
//! `docs/architecture.md` is the longer map.

mod background;
pub mod config;
mod edge;
mod engines;
mod error;
mod journal;
mod membership;
#[cfg(test)]
mod module_graph;
mod observe;
mod pd;
mod policy;
mod prefix;
mod protocols;
mod store;
mod tenants;

pub use edge::routes::{route_list, route_table, Listener};
pub use edge::server::terminate_signal;
pub use observe::logs;
pub use pd::{DECODER_HEADER, PREFILL_HEADER};
pub use protocols::client_event::ClientEvent;
pub use protocols::sse::{SseParser, DONE as SSE_DONE};
pub use store::redis::{
    checkpoint_of, AppendError, CheckpointWrite, LogState, RedisSettings, RedisStore,
};
pub use store::stored::Stored;

use config::RouterConfig;
use edge::app::AppState;
use edge::gate::ExposeInstances;
use edge::routes::access::Access;
use edge::routes::Edge;
use edge::secrets;
use edge::server::{self as server, ServerLimits, Shutdown};
use engines::addresses::UpstreamPolicy;
use membership::{static_instances, EtcdConfig};
use observe::metrics;
use policy::health;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Errors starting the router.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("membership: {0}")]
    Registry(#[from] membership::RegistryError),
    #[error(transparent)]
    Secret(#[from] edge::secrets::SecretError),
    #[error(transparent)]
    Tenants(#[from] tenants::file::TenantsError),
    #[error(transparent)]
    Upstreams(#[from] engines::addresses::BadCidr),
    #[error(
        "the internal listener {0} is not on loopback and no register token is set: anyone \
         who reaches it could register an instance and receive requests. Set \
         --register-token-file (or CONNEX_REGISTER_TOKEN), or accept the risk with \
         --allow-open-registration"
    )]
    OpenRegistration(SocketAddr),
    #[error(transparent)]
    Static(#[from] membership::static_instances::StaticError),
    #[error(transparent)]
    Tokenizer(#[from] pd::tokenizer::TokenizerError),
    #[error(transparent)]
    ResponseStore(#[from] store::redis::RedisSetupError),
}

/// A running router: its addresses, its state and the tasks it owns.
pub struct Router {
    /// The client listener (OpenAI routes, probes).
    pub addr: SocketAddr,
    /// The internal listener (registration, admin, metrics).
    pub internal_addr: SocketAddr,
    pub(crate) state: Arc<AppState>,
    shutdown: Shutdown,
    grace: Duration,
    /// The two servers; they end once their connections have.
    servers: tokio::task::JoinSet<()>,
    /// Background tasks (membership, probes, holds), stopped after the servers.
    background: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let error = |source| StartError::Bind { addr, source };
    let listener = connex_transfer::net::listen(addr).map_err(error)?;
    let bound = listener.local_addr().map_err(error)?;
    Ok((listener, bound))
}

/// The response store every replica shares, when `--response-store` names one.
fn response_store(
    args: &config::ResponsesArgs,
) -> Result<Option<Arc<store::redis::RedisStore>>, StartError> {
    use store::redis::{RedisSettings, RedisStore};
    let Some(url) = &args.response_store else {
        return Ok(None);
    };
    let store = RedisStore::new(RedisSettings {
        url: url.clone(),
        password: args.response_store_password.clone(),
        ca_file: args.response_store_ca_file.clone(),
        prefix: args.response_store_prefix.clone(),
        ttl: args.response_store_ttl,
        timeout: args.response_store_timeout.max(Duration::from_millis(1)),
        lease: args.response_lease.max(Duration::from_millis(100)),
        max_bytes: args.max_stored_response_bytes,
        max_response_bytes: args.response_store_max_response_bytes.max(1),
        fallback_count: args.max_stored_responses,
    })?;
    tracing::info!(prefix = %args.response_store_prefix, "responses stored in the shared response store");
    Ok(Some(Arc::new(store)))
}

impl Router {
    /// Checks the configuration, binds both listeners and starts serving, with
    /// the membership's background tasks. Everything the router runs is
    /// assembled here.
    pub async fn start(mut config: RouterConfig) -> Result<Self, StartError> {
        secrets::resolve(&mut config)?;
        let internal_listen = config.listeners.internal_listen;
        let internal_ip = internal_listen.ip();
        if config.access.register_token.is_none() && !internal_ip.to_canonical().is_loopback() {
            if !config.access.allow_open_registration {
                return Err(StartError::OpenRegistration(internal_listen));
            }
            tracing::warn!(
                listen = %internal_listen,
                "registration is open to anyone who reaches the internal listener \
                 (--allow-open-registration without a register token)"
            );
        }
        let (listener, addr) = bind(config.listeners.listen).await?;
        let (internal_listener, internal_addr) = bind(internal_listen).await?;
        let upstreams = UpstreamPolicy::parse(config.access.allowed_upstreams.as_deref())?
            .with_own_listeners(&[addr, internal_addr]);
        let upstreams = Arc::new(upstreams);
        // The recorder first: the membership sets its gauges as it opens.
        metrics::install(config.observability.metrics_idle());
        let tokenizers = pd::tokenizer::Tokenizers::load(&config.routing.tokenizer)?;
        let statics = static_instances::instances(&config.membership, &upstreams).await?;
        let etcd = EtcdConfig::new(&config.etcd, &upstreams);
        let registry = membership::Registry::open(&config.membership, etcd.as_ref()).await?;
        // With --static-model they serve from the start; otherwise each is
        // registered once it says which models it serves (below).
        let (named, unnamed): (Vec<_>, Vec<_>) =
            statics.into_iter().partition(|s| s.model.is_some());
        for instance in named {
            let model = instance.model.clone().unwrap_or_default();
            static_instances::register(&registry, instance.registration(&model, true)).await?;
        }
        let tenants = Arc::new(tenants::Tenants::new(config.tenants.clone())?);
        if !tenants.keyed() {
            tracing::info!(
                listen = %config.listeners.listen,
                "the client routes take no API key (--api-key or --tenants-file): anyone who reaches them is served"
            );
        }
        let shutdown = Shutdown::default();
        let edge = Edge {
            access: Arc::new(Access {
                admin_token: config.access.admin_token.clone(),
                register_token: config.access.register_token.clone(),
                upstreams: (*upstreams).clone(),
            }),
            tenants: tenants.clone(),
            expose_instances: ExposeInstances(config.access.expose_instance_headers),
            shutdown: shutdown.clone(),
        };
        let limits = ServerLimits {
            header_read_timeout: config.listeners.header_read_timeout,
            max_connections: config.listeners.max_connections,
            http2: config.http2.http2.then_some(config.http2),
        };
        let grace = config.listeners.shutdown_grace;
        let shared_responses = response_store(&config.responses)?;
        let (state, releases) =
            AppState::new(&config, registry, tokenizers, upstreams, shared_responses);
        let state = Arc::new(state);
        let mut servers = tokio::task::JoinSet::new();
        for (listener, audience) in [
            (listener, Listener::Client),
            (internal_listener, Listener::Internal),
        ] {
            let app = edge::routes::routes(audience, state.clone(), &edge);
            // HTTP/2 is for clients; registration and admin speak HTTP/1.1.
            let limits = match audience {
                Listener::Client => limits,
                Listener::Internal => ServerLimits {
                    http2: None,
                    ..limits
                },
            };
            servers.spawn(server::serve(listener, app, limits, shutdown.clone()));
        }
        let background = CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        state.deps.registry.spawn(&mut tasks, background.clone());
        health::spawn(
            config.health,
            state.deps.registry.clone(),
            state.client.clone(),
            state.deps.outliers.clone(),
            &mut tasks,
            background.clone(),
        );
        state
            .deps
            .holds
            .spawn_keeper(releases, &mut tasks, background.clone());
        tenants::reload::spawn_reloader(&tenants, &mut tasks, background.clone());
        background::takeover::spawn(
            &state.background(),
            &tenants,
            &mut tasks,
            background.clone(),
        );
        if let Some(store) = state.responses.shared.clone() {
            store::renewal::spawn(store, &mut tasks, background.clone());
        }
        for instance in unnamed {
            let (state, stop) = (state.clone(), background.clone());
            tasks.spawn(async move {
                static_instances::discover(&state.deps.registry, &state.client, instance, stop)
                    .await;
            });
        }
        tracing::info!(%addr, %internal_addr, "connex-router listening");
        Ok(Self {
            addr,
            internal_addr,
            state,
            shutdown,
            grace,
            servers,
            background,
            tasks,
        })
    }

    /// The client listener's URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The internal listener's URL (registration, admin, metrics).
    pub fn internal_url(&self) -> String {
        format!("http://{}", self.internal_addr)
    }

    /// How many instances the membership holds (the demo waits for its
    /// engines to register).
    pub fn instance_count(&self) -> usize {
        self.state.deps.registry.list().len()
    }

    /// Shuts down gracefully: `/ready` 503 and no new connections at once;
    /// in-flight requests get the grace period (`--shutdown-grace`); streams
    /// still open then end with an error event; then the background tasks stop.
    pub async fn stop(mut self) {
        self.shutdown.draining.cancel();
        tracing::info!(grace = ?self.grace, "shutting down: no new connections; in-flight requests finish");
        let finished = async { while self.servers.join_next().await.is_some() {} };
        if tokio::time::timeout(self.grace, finished).await.is_err() {
            tracing::warn!("grace period over: ending the streams still open");
            self.shutdown.cut.cancel();
            // Non-stream requests still waiting on an engine are not waited
            // for past a short margin.
            let rest = async { while self.servers.join_next().await.is_some() {} };
            if tokio::time::timeout(Duration::from_secs(5), rest)
                .await
                .is_err()
            {
                self.servers.abort_all();
            }
        }
        // Background generations stop (their status says cancelled); the
        // drains of the last responses end within their bound.
        // With a shared store, another replica goes on with them.
        if self.state.responses.shared.is_some() {
            self.state.responses.live.hand_over_all();
        }
        self.state.responses.live.stop.cancel();
        self.state.deps.drains.close();
        self.state.deps.drains.wait().await;
        self.background.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}
