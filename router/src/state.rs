//! The state every handler shares.

use crate::config::RouterConfig;
use crate::engines::addresses::{CtrlResolver, ProbeClient, UpstreamPolicy};
use crate::engines::http::EngineClient;
use crate::hold_leases::ReleaseQueue;
use crate::membership::Registry;
use crate::pd::flow::{Flow, RequestLimits};
use crate::pd::tokenizer::Tokenizers;
use crate::pd::upstream::HttpUpstream;
use crate::protocols::responses::redis_store::RedisStore;
use connex_transfer::Resolver;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;

pub struct AppState {
    pub config: RouterConfig,
    /// The request flow's subsystems (`state.flow.registry`,
    /// `state.flow.journal`): what a request's phases use, which they take
    /// without the rest of the app's state.
    pub flow: Arc<Flow>,
    /// The client of the health probes and the admin's calls to engines
    /// (the flow's engine calls go through its `upstream`).
    pub client: crate::engines::addresses::ProbeClient,
    pub metrics: Option<PrometheusHandle>,
    /// `/v1/models`: each model's entry as its engines last described it.
    pub models: crate::membership::model_list::ModelCache,
    /// Request body bytes in flight, over all clients (`--max-inflight-body-bytes`).
    pub body_budget: crate::body_budget::BodyBudget,
    /// Stored responses (`/v1/responses`): the conversations behind
    /// `previous_response_id`, whatever engines serve the next turn.
    pub responses: Arc<dyn crate::protocols::responses::store::ResponseStore>,
    /// Background responses' event logs (`--max-background-responses`).
    pub live: crate::protocols::responses::live::LiveResponses,
    /// The store every replica shares (`--response-store`), which is also
    /// `responses`: other replicas' background responses are read there.
    pub shared_responses: Option<Arc<RedisStore>>,
}

impl AppState {
    /// The state, and the queue of hold releases that the router's keeper task
    /// takes.
    pub fn new(
        config: RouterConfig,
        registry: Registry,
        tokenizers: Tokenizers,
        upstreams: Arc<UpstreamPolicy>,
        shared_responses: Option<Arc<RedisStore>>,
    ) -> (Self, ReleaseQueue) {
        // Every connect to an engine or a holder checks the addresses it
        // resolves against the upstream policy again (DNS rebinding).
        let engines = EngineClient::guarded(
            config.connect_timeout,
            crate::engines::addresses::ENGINE_POOL_IDLE_PER_HOST,
            crate::pd::upstream::POOL_IDLE_TIMEOUT,
            upstreams.clone(),
        );
        // One engine client for every call to an engine: requests, probes
        // and model lists share its pool and its address checks.
        let client = ProbeClient::new(engines.clone());
        let upstream = Arc::new(HttpUpstream::new(
            engines,
            RequestLimits::new(&config).upstream,
        ));
        crate::prefix::BlockBudget::process().set_cap(config.prefix_index_total_blocks);
        let (mut flow, releases) = Flow::new(&config, registry, upstream);
        flow.holds = flow
            .holds
            .resolving_with(Resolver(Arc::new(CtrlResolver(upstreams))));
        let flow = flow.with_tokenizers(tokenizers);
        let idle = (!config.metrics_idle_timeout.is_zero()).then_some(config.metrics_idle_timeout);
        let metrics = crate::observe::metrics::install(idle);
        crate::membership::status::describe_metrics();
        crate::observe::metrics::set_resume_causes(
            crate::pd::attempt::Cause::ALL
                .into_iter()
                .filter(|c| c.reached_decoder())
                .map(|c| c.as_str())
                .collect(),
        );
        let state = Self {
            flow: Arc::new(flow),
            client,
            metrics,
            models: crate::membership::model_list::ModelCache::default(),
            body_budget: crate::body_budget::BodyBudget::new(config.max_inflight_body_bytes),
            responses: match &shared_responses {
                Some(shared) => shared.clone(),
                None => Arc::new(crate::protocols::responses::store::MemoryStore::new(
                    config.responses.max_stored,
                    config.responses.max_stored_bytes,
                )),
            },
            shared_responses,
            live: crate::protocols::responses::live::LiveResponses::new(
                config.responses.max_background,
            ),
            config,
        };
        (state, releases)
    }
}
