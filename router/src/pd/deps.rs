//! The request flow's dependencies (`FlowDeps`): the subsystems its phases
//! call and the groups of flags they read. Every phase takes these (as
//! `deps`), not the whole application state, so that `pd` depends only on
//! the modules below it (the registry, the journal, the policies, the holds)
//! and its sessions are built and tested without the HTTP app, its metrics
//! recorder or its listeners.

use crate::config::{EngineArgs, RequestArgs, ResumeArgs, RouterConfig, RoutingArgs};
use crate::journal::Journal;
use crate::membership::Registry;
use crate::pd::holds::{Holds, ReleaseQueue};
use crate::pd::tokenizer::Tokenizers;
use crate::pd::upstream::Upstream;
use crate::policy::cache::Thresholds;
use crate::policy::outlier::Outliers;
use crate::policy::Selector;
use std::sync::Arc;
use tokio_util::task::TaskTracker;

/// What a request's phases use: the registry, the journal, the selectors,
/// the holds, the outliers, the [`Upstream`] seam and the flag groups they
/// read. (Not the app's state: that is `edge::app::AppState`, which holds
/// these as its `deps`.)
pub struct FlowDeps {
    pub registry: Arc<Registry>,
    pub journal: Arc<Journal>,
    pub prefill: Selector,
    pub decode: Selector,
    /// How the phases reach the engines.
    pub upstream: Arc<dyn Upstream>,
    /// Decoders new requests avoid, and which ones deliver tokens.
    pub outliers: Arc<Outliers>,
    pub holds: Holds,
    /// The groups of flags the phases read, as parsed (`config/groups.rs`).
    pub requests: RequestArgs,
    pub engines: EngineArgs,
    pub routing: RoutingArgs,
    pub resume: ResumeArgs,
    /// The tokenizers the router runs itself (`--tokenizer`).
    pub tokenizers: Tokenizers,
    /// The drains of finished decoder responses (each ends within
    /// `attempt::DRAIN_WAIT`), waited for when the router stops.
    pub drains: TaskTracker,
}

impl FlowDeps {
    /// The flow's dependencies over `registry`, reaching engines through
    /// `upstream`; and the queue of hold releases that the router's keeper task takes.
    pub fn new(
        config: &RouterConfig,
        registry: Registry,
        upstream: Arc<dyn Upstream>,
    ) -> (Self, ReleaseQueue) {
        let secret = config
            .access
            .transfer_secret
            .clone()
            .and_then(connex_transfer::Secret::new);
        let (holds, releases) = Holds::new(config.resume.ctrl_timeout, secret);
        let routing = &config.routing;
        let thresholds = Thresholds::of(routing);
        let ttl = config.membership.heartbeat_ttl;
        let deps = Self {
            registry: Arc::new(registry),
            journal: Arc::new(Journal::default()),
            prefill: Selector::new(routing.prefill_policy, ttl, thresholds),
            decode: Selector::new(routing.decode_policy, ttl, thresholds),
            upstream,
            outliers: Arc::new(Outliers::new(routing.suspect_for)),
            holds,
            requests: config.requests,
            engines: config.engines,
            routing: routing.clone(),
            resume: config.resume,
            tokenizers: Tokenizers::default(),
            drains: TaskTracker::new(),
        };
        (deps, releases)
    }

    /// The same, with the router's own tokenizers.
    pub fn with_tokenizers(mut self, tokenizers: Tokenizers) -> Self {
        self.tokenizers = tokenizers;
        self
    }
}
