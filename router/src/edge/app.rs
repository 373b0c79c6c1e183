//! The state every handler shares, and the parts of it a handler can take
//! alone (axum's `FromRef`): a handler names what it needs (`State<Arc<Registry>>`
//! for the membership routes, `State<Arc<Journal>>` for the journal's), and only
//! the routes that run a request through the whole pipeline take `AppState`.

use crate::background::run::BackgroundState;
use crate::config::RouterConfig;
use crate::edge::body_budget::BodyBudget;
use crate::engines::addresses::{CtrlResolver, UpstreamPolicy};
use crate::engines::http::EngineClient;
use crate::engines::probe::ProbeClient;
use crate::journal::Journal;
use crate::membership::model_list::{ModelCache, ModelLists};
use crate::membership::Registry;
use crate::pd::deps::FlowDeps;
use crate::pd::holds::ReleaseQueue;
use crate::pd::tokenizer::Tokenizers;
use crate::pd::upstream::HttpUpstream;
use crate::store::redis::RedisStore;
use crate::store::ResponseStores;
use axum::extract::FromRef;
use connex_transfer::Resolver;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;

pub struct AppState {
    /// The request flow's dependencies (`state.deps.registry`,
    /// `state.deps.journal`): what a request's phases use, which they take
    /// without the rest of the app's state.
    pub deps: Arc<FlowDeps>,
    /// The client of the health probes and the admin's calls to engines
    /// (the flow's engine calls go through `deps.upstream`).
    pub client: crate::engines::probe::ProbeClient,
    pub metrics: Option<PrometheusHandle>,
    /// `/v1/models`: each model's entry as its engines last described it.
    pub models: Arc<ModelLists>,
    /// Request body bytes in flight, over all clients (`--max-inflight-body-bytes`).
    pub body_budget: BodyBudget,
    /// Stored and background responses (`/v1/responses`).
    pub responses: Arc<ResponseStores>,
}

impl AppState {
    /// The state, and the queue of hold releases that the router's keeper task
    /// takes.
    pub fn new(
        config: &RouterConfig,
        registry: Registry,
        tokenizers: Tokenizers,
        upstreams: Arc<UpstreamPolicy>,
        shared_responses: Option<Arc<RedisStore>>,
    ) -> (Self, ReleaseQueue) {
        // Every connect to an engine or a holder checks the addresses it
        // resolves against the upstream policy again (DNS rebinding).
        let engines = EngineClient::guarded(
            config.engines.connect_timeout,
            crate::engines::addresses::ENGINE_POOL_IDLE_PER_HOST,
            crate::pd::upstream::POOL_IDLE_TIMEOUT,
            upstreams.clone(),
        );
        // One engine client for every call to an engine: requests, probes
        // and model lists share its pool and its address checks.
        let client = ProbeClient::new(engines.clone());
        let upstream = Arc::new(HttpUpstream::new(engines, config.engines));
        crate::prefix::BlockBudget::process().set_cap(config.routing.prefix_index_total_blocks);
        let (mut deps, releases) = FlowDeps::new(config, registry, upstream);
        deps.holds = deps
            .holds
            .resolving_with(Resolver(Arc::new(CtrlResolver(upstreams))));
        let deps = deps.with_tokenizers(tokenizers);
        let metrics = crate::observe::metrics::install(config.observability.metrics_idle());
        crate::membership::status::describe_metrics();
        crate::observe::metrics::set_resume_causes(
            crate::pd::failure::Cause::ALL
                .into_iter()
                .filter(|c| c.reached_decoder())
                .map(|c| c.as_str())
                .collect(),
        );
        let deps = Arc::new(deps);
        let models = Arc::new(ModelLists {
            cache: ModelCache::default(),
            client: client.clone(),
            registry: deps.registry.clone(),
        });
        let state = Self {
            deps: deps.clone(),
            client,
            metrics,
            models,
            body_budget: BodyBudget::new(config.requests.max_inflight_body_bytes),
            responses: Arc::new(ResponseStores {
                stored: match &shared_responses {
                    Some(shared) => shared.clone(),
                    None => Arc::new(
                        crate::store::memory::MemoryResponseStore::with_tenant_default(
                            config.responses.max_stored_responses,
                            config.responses.max_stored_response_bytes,
                            crate::store::stored::TenantQuota {
                                max_count: config.responses.max_stored_responses_per_tenant,
                                max_bytes: config.responses.max_stored_response_bytes_per_tenant,
                            },
                        ),
                    ),
                },
                live: crate::store::live::LiveResponses::with_limits(
                    crate::store::live::LiveLimits {
                        max: config.responses.max_background_responses,
                        max_bytes: config.responses.max_background_response_bytes,
                        per_tenant: config.responses.max_background_responses_per_tenant,
                        per_tenant_bytes: config.responses.max_background_response_bytes_per_tenant,
                    },
                ),
                shared: shared_responses,
            }),
        };
        (state, releases)
    }

    /// The part background generations use (`background/`).
    pub fn background(&self) -> BackgroundState {
        BackgroundState {
            deps: self.deps.clone(),
            responses: self.responses.clone(),
        }
    }
}

/// The routes' state: the app's, behind one pointer, from which each handler
/// takes the part it needs (a type of this crate, so that the parts'
/// `FromRef` may be written here).
#[derive(Clone)]
pub struct HandlerState(pub Arc<AppState>);

impl FromRef<HandlerState> for Arc<AppState> {
    fn from_ref(HandlerState(state): &HandlerState) -> Self {
        state.clone()
    }
}

impl FromRef<HandlerState> for Arc<FlowDeps> {
    fn from_ref(HandlerState(state): &HandlerState) -> Self {
        state.deps.clone()
    }
}

impl FromRef<HandlerState> for Arc<Registry> {
    fn from_ref(HandlerState(state): &HandlerState) -> Self {
        state.deps.registry.clone()
    }
}

impl FromRef<HandlerState> for Arc<Journal> {
    fn from_ref(HandlerState(state): &HandlerState) -> Self {
        state.deps.journal.clone()
    }
}

impl FromRef<HandlerState> for Arc<ModelLists> {
    fn from_ref(HandlerState(state): &HandlerState) -> Self {
        state.models.clone()
    }
}

/// What `/metrics` renders beyond the membership: the recorder's series and
/// the body bytes in flight.
#[derive(Clone)]
pub struct Scrape {
    pub recorder: Option<PrometheusHandle>,
    pub body_budget: BodyBudget,
}

impl FromRef<HandlerState> for Scrape {
    fn from_ref(HandlerState(state): &HandlerState) -> Self {
        Self {
            recorder: state.metrics.clone(),
            body_budget: state.body_budget.clone(),
        }
    }
}

impl FromRef<HandlerState> for Arc<ResponseStores> {
    fn from_ref(HandlerState(state): &HandlerState) -> Self {
        state.responses.clone()
    }
}
