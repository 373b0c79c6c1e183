//! The state every handler shares.

use crate::config::RouterConfig;
use crate::holds::{Holds, ReleaseQueue};
use crate::journal::Journal;
use crate::policy::Selector;
use crate::registry::Registry;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;

pub struct AppState {
    pub config: RouterConfig,
    pub registry: Registry,
    pub journal: Arc<Journal>,
    pub prefill: Selector,
    pub decode: Selector,
    pub client: reqwest::Client,
    pub holds: Holds,
    pub metrics: Option<PrometheusHandle>,
}

impl AppState {
    /// The state, and the queue of hold releases that the router's keeper task
    /// takes.
    pub fn new(
        config: RouterConfig,
        registry: Registry,
    ) -> Result<(Self, ReleaseQueue), reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .tcp_nodelay(true)
            .pool_max_idle_per_host(1024)
            .build()?;
        let secret = config
            .transfer_secret
            .clone()
            .and_then(connex_transfer::Secret::new);
        let (holds, releases) = Holds::new(Duration::from_millis(config.ctrl_timeout_ms), secret);
        let state = Self {
            registry,
            holds,
            journal: Arc::new(Journal::default()),
            prefill: Selector::new(config.prefill_policy),
            decode: Selector::new(config.decode_policy),
            client,
            metrics: crate::metrics::install(),
            config,
        };
        Ok((state, releases))
    }
}
