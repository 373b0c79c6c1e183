//! The state every handler shares.

use crate::config::RouterConfig;
use crate::holds::ReleaseQueue;
use crate::pd::flow::{Flow, RequestLimits};
use crate::pd::tokenizer::Tokenizers;
use crate::pd::upstream::HttpUpstream;
use crate::registry::Registry;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;

pub struct AppState {
    pub config: RouterConfig,
    /// The request flow's subsystems; handlers reach them through the state
    /// (`state.registry`, `state.journal`: see `Deref`).
    pub flow: Arc<Flow>,
    /// The client of the health probes and the admin's calls to engines
    /// (the flow's engine calls go through its `upstream`).
    pub client: reqwest::Client,
    pub metrics: Option<PrometheusHandle>,
    /// `/v1/models`: each model's entry as its engines last described it.
    pub models: crate::model_list::ModelCache,
}

/// The state is the flow plus what only the app has (its configuration, the
/// probes' client, the metrics handle), so the flow's fields read as the
/// state's own.
impl std::ops::Deref for AppState {
    type Target = Flow;

    fn deref(&self) -> &Flow {
        &self.flow
    }
}

impl AppState {
    /// The state, and the queue of hold releases that the router's keeper task
    /// takes.
    pub fn new(
        config: RouterConfig,
        registry: Registry,
        tokenizers: Tokenizers,
    ) -> Result<(Self, ReleaseQueue), reqwest::Error> {
        let client = crate::upstreams::client(&config)?;
        let upstream = Arc::new(HttpUpstream::new(
            crate::pd::upstream::engine_client(
                Duration::from_millis(config.connect_timeout_ms),
                crate::upstreams::ENGINE_POOL_IDLE_PER_HOST,
            ),
            RequestLimits::new(&config).upstream,
        ));
        let (flow, releases) = Flow::new(&config, registry, upstream);
        let flow = flow.with_tokenizers(tokenizers);
        let idle = (config.metrics_idle_timeout_s > 0)
            .then(|| Duration::from_secs(config.metrics_idle_timeout_s));
        let metrics = crate::metrics::install(idle);
        crate::registry::status::describe_metrics();
        crate::metrics::set_resume_causes(
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
            models: crate::model_list::ModelCache::default(),
            config,
        };
        Ok((state, releases))
    }
}
