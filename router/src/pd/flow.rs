//! What the request flow needs of the router: the subsystems its phases call
//! and the few settings they read. The flow takes this, not the whole
//! application state, so that `pd` depends only on the modules below it (the
//! registry, the journal, the policies, the holds) and its sessions are built
//! and tested without the HTTP app, its metrics recorder or its listeners.

use crate::config::{OnHoldLost, RouterConfig};
use crate::journal::Journal;
use crate::membership::Registry;
use crate::pd::attempt::StreamLimits;
use crate::pd::holds::{Holds, ReleaseQueue};
use crate::pd::tokenizer::Tokenizers;
use crate::pd::upstream::{Limits, Upstream};
use crate::policy::cache::Thresholds;
use crate::policy::outlier::Outliers;
use crate::policy::Selector;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;

pub struct Flow {
    pub registry: Arc<Registry>,
    pub journal: Arc<Journal>,
    pub prefill: Selector,
    pub decode: Selector,
    /// How the phases reach the engines.
    pub upstream: Arc<dyn Upstream>,
    /// Decoders new requests avoid, and which ones deliver tokens.
    pub outliers: Arc<Outliers>,
    pub limits: RequestLimits,
    pub holds: Holds,
    pub settings: Settings,
    /// The tokenizers the router runs itself (`--tokenizer`).
    pub tokenizers: Tokenizers,
    /// The drains of finished decoder responses (each ends within
    /// `attempt::DRAIN_WAIT`), waited for when the router stops.
    pub drains: TaskTracker,
}

/// The request path's limits, from the configuration.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    pub stream: StreamLimits,
    pub upstream: Limits,
}

impl RequestLimits {
    pub fn new(config: &RouterConfig) -> Self {
        Self {
            stream: StreamLimits {
                first_token: config.first_token_timeout,
                stall: config.stall_timeout,
                max_event: config.max_sse_event_bytes,
            },
            upstream: Limits {
                prefill_timeout: config.prefill_timeout,
                decode_open_timeout: config.decode_open_timeout,
                max_body: config.max_upstream_body_bytes,
            },
        }
    }
}

/// The settings the phases read (the rest of the configuration is the app's).
#[derive(Debug, Clone)]
pub struct Settings {
    /// `max_tokens` of a request that names none.
    pub max_tokens_limit: u64,
    /// Resumes one request may use (attempts that reached a decoder).
    pub max_resumes: u32,
    /// How long a resume waits for a decoder when none is eligible.
    pub resume_wait: Duration,
    /// What a resume does when the prompt's hold is gone.
    pub on_hold_lost: OnHoldLost,
    /// The engines' KV block size, for the prefix index's block hashes.
    pub kv_block_size: usize,
    /// Most blocks the prefix index keeps per instance.
    pub prefix_index_blocks: usize,
    /// How long the router waits for an engine's tokenizer (`/tokenize`, `/detokenize`).
    pub tokenize_timeout: Duration,
}

impl Settings {
    pub fn new(config: &RouterConfig) -> Self {
        Self {
            max_tokens_limit: config.max_tokens_limit,
            max_resumes: config.max_resumes,
            resume_wait: config.resume_wait,
            on_hold_lost: config.on_hold_lost,
            kv_block_size: config.kv_block_size,
            prefix_index_blocks: config.prefix_index_blocks,
            tokenize_timeout: config.tokenize_timeout,
        }
    }
}

impl Flow {
    /// The flow over `registry`, reaching engines through `upstream`; and the
    /// queue of hold releases that the router's keeper task takes.
    pub fn new(
        config: &RouterConfig,
        registry: Registry,
        upstream: Arc<dyn Upstream>,
    ) -> (Self, ReleaseQueue) {
        let secret = config
            .transfer_secret
            .clone()
            .and_then(connex_transfer::Secret::new);
        let (holds, releases) = Holds::new(config.ctrl_timeout, secret);
        let thresholds = Thresholds {
            cache: config.cache_threshold,
            balance_abs: config.balance_abs_threshold,
            balance_rel: config.balance_rel_threshold,
        };
        let flow = Self {
            registry: Arc::new(registry),
            journal: Arc::new(Journal::default()),
            prefill: Selector::new(config.prefill_policy, config.heartbeat_ttl)
                .with_thresholds(thresholds),
            decode: Selector::new(config.decode_policy, config.heartbeat_ttl)
                .with_thresholds(thresholds),
            upstream,
            outliers: Arc::new(Outliers::new(config.suspect_for)),
            limits: RequestLimits::new(config),
            holds,
            settings: Settings::new(config),
            tokenizers: Tokenizers::default(),
            drains: TaskTracker::new(),
        };
        (flow, releases)
    }

    /// The flow with the router's own tokenizers.
    pub fn with_tokenizers(mut self, tokenizers: Tokenizers) -> Self {
        self.tokenizers = tokenizers;
        self
    }
}
