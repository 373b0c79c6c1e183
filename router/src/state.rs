//! The state every handler shares.

use crate::config::RouterConfig;
use crate::holds::{Holds, ReleaseQueue};
use crate::journal::Journal;
use crate::pd::attempt::StreamLimits;
use crate::pd::upstream::{HttpUpstream, Limits, Upstream};
use crate::policy::outlier::Outliers;
use crate::policy::Selector;
use crate::registry::Registry;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;

pub struct AppState {
    pub config: RouterConfig,
    pub registry: Arc<Registry>,
    pub journal: Arc<Journal>,
    pub prefill: Selector,
    pub decode: Selector,
    /// The client of the health probes (engine calls go through `upstream`).
    pub client: reqwest::Client,
    /// How the request flow reaches the engines.
    pub upstream: Arc<dyn Upstream>,
    /// Decoders new requests avoid, and which ones deliver tokens.
    pub outliers: Arc<Outliers>,
    pub limits: RequestLimits,
    pub holds: Holds,
    pub metrics: Option<PrometheusHandle>,
}

/// The request path's limits, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    pub stream: StreamLimits,
    pub upstream: Limits,
}

impl RequestLimits {
    pub fn new(config: &RouterConfig) -> Self {
        let ms = Duration::from_millis;
        Self {
            stream: StreamLimits {
                first_token: ms(config.first_token_timeout_ms),
                stall: ms(config.stall_timeout_ms),
                max_event: config.max_sse_event_bytes,
            },
            upstream: Limits {
                prefill_timeout: ms(config.prefill_timeout_ms),
                decode_open_timeout: ms(config.decode_open_timeout_ms),
                max_body: config.max_upstream_body_bytes,
            },
        }
    }
}

impl AppState {
    /// The state, and the queue of hold releases that the router's keeper task
    /// takes.
    pub fn new(
        config: RouterConfig,
        registry: Registry,
    ) -> Result<(Self, ReleaseQueue), reqwest::Error> {
        let client = upstream_client(&config)?;
        let upstream = Arc::new(HttpUpstream::new(
            engine_client(&config),
            RequestLimits::new(&config).upstream,
        ));
        Ok(Self::with_upstream(config, registry, client, upstream))
    }

    /// The state with engines reached through `upstream` (the tests' seam).
    pub fn with_upstream(
        config: RouterConfig,
        registry: Registry,
        client: reqwest::Client,
        upstream: Arc<dyn Upstream>,
    ) -> (Self, ReleaseQueue) {
        let secret = config
            .transfer_secret
            .clone()
            .and_then(connex_transfer::Secret::new);
        let (holds, releases) = Holds::new(Duration::from_millis(config.ctrl_timeout_ms), secret);
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
        let thresholds = crate::policy::cache::Thresholds {
            cache: config.cache_threshold,
            balance_abs: config.balance_abs_threshold,
            balance_rel: config.balance_rel_threshold,
        };
        let state = Self {
            registry: Arc::new(registry),
            holds,
            journal: Arc::new(Journal::default()),
            prefill: Selector::new(config.prefill_policy, config.heartbeat_ttl())
                .with_thresholds(thresholds),
            decode: Selector::new(config.decode_policy, config.heartbeat_ttl())
                .with_thresholds(thresholds),
            client,
            upstream,
            outliers: Arc::new(Outliers::new(Duration::from_millis(config.suspect_ms))),
            limits: RequestLimits::new(&config),
            metrics,
            config,
        };
        (state, releases)
    }
}

/// The client for engines' prefill and decode calls (`pd::upstream`).
pub fn engine_client(config: &RouterConfig) -> crate::pd::upstream::EngineClient {
    crate::pd::upstream::engine_client(
        Duration::from_millis(config.connect_timeout_ms),
        ENGINE_POOL_IDLE_PER_HOST,
    )
}

/// Idle connections kept per engine, for reuse by the next calls.
const ENGINE_POOL_IDLE_PER_HOST: usize = 1024;

/// The client for engines' probes and admin calls: registered URLs are
/// fetched as they are, so it follows no redirect (a registered engine must
/// not send the router, its requests or its probes elsewhere; hyper's client of
/// `pd::upstream` follows none either).
pub fn upstream_client(config: &RouterConfig) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
        .redirect(reqwest::redirect::Policy::none())
        .tcp_nodelay(true)
        .pool_max_idle_per_host(ENGINE_POOL_IDLE_PER_HOST)
        .build()
}
