//! The `serve` flags, one `clap::Args` struct per concern, each under its own
//! help heading (set where `RouterConfig` flattens it). A subsystem is built
//! from, and keeps, the group it reads: the running code has no second copy
//! of a setting. Durations are `Duration`s parsed with their unit
//! (`units.rs`); a field's name is its flag's (`--max-body-bytes` is
//! `requests.max_body_bytes`), so its env var and file key follow from it.

use super::units::{millis, secs, within_a_day};
use clap::Args;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// The two listeners and the server's lifecycle.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct ListenerArgs {
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, env = "CONNEX_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Host (IP address) of the client listener, as vLLM and vllm-router users
    /// type it; the port is --port's or --listen's default. Not with --listen.
    // No env var for --host and --port: Kubernetes sets CONNEX_PORT
    // (tcp://...) in every pod of a namespace with a Service named `connex`.
    #[arg(long, conflicts_with = "listen")]
    pub host: Option<IpAddr>,
    /// Port of the client listener (with --host, or on --listen's default
    /// host). Not with --listen.
    #[arg(long, conflicts_with = "listen")]
    pub port: Option<u16>,
    /// Address of the internal listener: registration, admin and /metrics
    /// (the client listener serves only the OpenAI routes and the probes).
    #[arg(long, env = "CONNEX_INTERNAL_LISTEN", default_value = "127.0.0.1:8001")]
    pub internal_listen: SocketAddr,
    /// Time a client has to send a request's headers; it also bounds how long
    /// a kept-alive connection may idle between requests.
    #[arg(long, value_name = "DURATION", alias = "header-read-timeout-ms", env = "CONNEX_HEADER_READ_TIMEOUT", default_value = "30s", value_parser = millis)]
    pub header_read_timeout: Duration,
    /// Most open client connections (further ones wait in the accept backlog).
    #[arg(long, env = "CONNEX_MAX_CONNECTIONS", default_value_t = 16_384)]
    pub max_connections: usize,
    /// On SIGTERM/SIGINT: how long in-flight streams get to finish before
    /// they end with an error event.
    #[arg(long, value_name = "DURATION", alias = "shutdown-grace-s", env = "CONNEX_SHUTDOWN_GRACE", default_value = "30s", value_parser = secs)]
    pub shutdown_grace: Duration,
}

/// HTTP/2 on the client listener.
#[derive(Debug, Clone, Copy, Args, PartialEq)]
pub struct Http2Args {
    /// Also speak HTTP/2 without TLS (h2c with prior knowledge, RFC 9113
    /// 3.3) on the client listener: a front proxy or client then carries many
    /// requests on one connection, one socket for many streams. HTTP/1.1
    /// clients are served as before.
    #[arg(long, env = "CONNEX_HTTP2", num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub http2: bool,
    /// Most requests in flight on one HTTP/2 connection (further ones are
    /// refused by the protocol until one ends).
    #[arg(long, env = "CONNEX_HTTP2_MAX_STREAMS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub http2_max_streams: u32,
    /// An HTTP/2 connection with no request in flight for this long (1s to
    /// 24h) is closed (GOAWAY), as HTTP/1.1's idle wait is bounded by
    /// --header-read-timeout; its peer is also pinged this often and dropped
    /// when it does not answer within the same time.
    #[arg(long, value_name = "DURATION", alias = "http2-idle-timeout-s", env = "CONNEX_HTTP2_IDLE_TIMEOUT", default_value = "1m", value_parser = within_a_day)]
    pub http2_idle_timeout: Duration,
}

/// Logs, traces and metrics.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct ObservabilityArgs {
    /// Log line format: `text` for people, `json` (one object a line) for log
    /// pipelines.
    #[arg(long, env = "CONNEX_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// What is logged: a level (`info`, `debug`...) or a tracing filter
    /// (`info,connex::access=off`). Unset: CONNEX_LOG, else `info`.
    #[arg(long, env = "CONNEX_LOG_LEVEL")]
    pub log_level: Option<String>,
    /// OTLP/HTTP collector (protobuf) the request spans are exported to, e.g.
    /// http://otel-collector:4318 (`/v1/traces` is added to a URL without a
    /// path). Unset: no export; trace context still reaches the engines.
    #[arg(long, env = "CONNEX_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// A counter or histogram series not updated for this long is dropped
    /// from /metrics (those of removed and evicted instances; 0: never). The
    /// per-instance gauges follow the membership at once.
    #[arg(long, value_name = "DURATION", alias = "metrics-idle-timeout-s", env = "CONNEX_METRICS_IDLE_TIMEOUT", default_value = "10m", value_parser = secs)]
    pub metrics_idle_timeout: Duration,
}

impl ObservabilityArgs {
    /// How long an idle series stays on /metrics (None: forever).
    pub fn metrics_idle(&self) -> Option<Duration> {
        (!self.metrics_idle_timeout.is_zero()).then_some(self.metrics_idle_timeout)
    }
}

/// Who may call the admin and registration routes, which engines may
/// register, and the secret the engines' KV holders require.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct AccessArgs {
    /// Bearer token for /admin routes. Without it the admin API refuses every call.
    #[arg(long, env = "CONNEX_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// File holding the admin token (instead of --admin-token).
    #[arg(long, env = "CONNEX_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Bearer token instances must send to register and heartbeat (open when unset).
    #[arg(long, env = "CONNEX_REGISTER_TOKEN", hide_env_values = true)]
    pub register_token: Option<String>,
    /// File holding the register token (instead of --register-token).
    #[arg(long, env = "CONNEX_REGISTER_TOKEN_FILE")]
    pub register_token_file: Option<PathBuf>,
    /// Secret that the engines' KV holders require on their control listeners
    /// (the same CONNEX_TRANSFER_SECRET as theirs): the router needs it to
    /// renew, check and release holds.
    #[arg(long, env = "CONNEX_TRANSFER_SECRET", hide_env_values = true)]
    pub transfer_secret: Option<String>,
    /// File holding the transfer secret (instead of --transfer-secret).
    #[arg(long, env = "CONNEX_TRANSFER_SECRET_FILE")]
    pub transfer_secret_file: Option<PathBuf>,
    /// Accept registrations without a register token on a non-loopback
    /// internal listener (anyone who reaches it can add an instance).
    #[arg(long, env = "CONNEX_ALLOW_OPEN_REGISTRATION", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true")]
    pub allow_open_registration: bool,
    /// Networks registered instances may live in (comma-separated CIDRs).
    /// Default: everything but link-local and cloud metadata addresses. The
    /// router's own listeners are always refused.
    #[arg(long, env = "CONNEX_ALLOWED_UPSTREAMS")]
    pub allowed_upstreams: Option<String>,
    /// Send the serving instances' ids to clients (`x-connex-prefill`,
    /// `x-connex-decoder`).
    #[arg(long, env = "CONNEX_EXPOSE_INSTANCE_HEADERS", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true")]
    pub expose_instance_headers: bool,
}

/// Who may call the client routes, and how many requests are served at
/// once (`tenants/`).
#[derive(Debug, Clone, Args, PartialEq)]
pub struct TenantArgs {
    /// The key clients must send on every client route but the probes
    /// (`Authorization: Bearer KEY`, or `x-api-key`), as vLLM's --api-key.
    /// Its tenant is `default`. Unset, and without --tenants-file: open.
    #[arg(long, env = "CONNEX_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// File holding the API key (instead of --api-key).
    #[arg(long, env = "CONNEX_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Tenants (TOML: `[[tenant]]` with name, keys, max_concurrent,
    /// tokens_per_minute, weight, priority, kv_cache; docs/operations.md). Read again
    /// on SIGHUP and when it changes; a bad file keeps the tenants in force.
    #[arg(long, env = "CONNEX_TENANTS_FILE")]
    pub tenants_file: Option<PathBuf>,
    /// Most OpenAI requests in flight; past it requests wait in per-tenant
    /// queues (--max-queued-per-tenant, --max-queue-wait), then 429 with
    /// Retry-After.
    #[arg(long, env = "CONNEX_MAX_CONCURRENT_REQUESTS", default_value_t = 10_000)]
    pub max_concurrent_requests: usize,
    /// Most requests of one tenant waiting for a slot (0: none wait, past the
    /// limit is 429 at once).
    #[arg(long, env = "CONNEX_MAX_QUEUED_PER_TENANT", default_value_t = 1024)]
    pub max_queued_per_tenant: usize,
    /// Longest a request waits for a slot before its 429 (0: none wait).
    #[arg(long, value_name = "DURATION", alias = "max-queue-wait-ms", env = "CONNEX_MAX_QUEUE_WAIT", default_value = "10s", value_parser = millis)]
    pub max_queue_wait: Duration,
}

/// What one client request may be: its body, and the tokens it asks for.
#[derive(Debug, Clone, Copy, Args, PartialEq)]
pub struct RequestArgs {
    /// Largest accepted request body (larger: 413).
    #[arg(long, value_name = "BYTES", env = "CONNEX_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Request body bytes all clients' requests may hold at once (a request
    /// holds its body until it ends: a resume sends it again); past it, 503
    /// with Retry-After before more is read. Bounds what client bodies can
    /// cost the router's memory (a body is kept once, at its size, shared by
    /// its engine calls).
    #[arg(long, value_name = "BYTES", env = "CONNEX_MAX_INFLIGHT_BODY_BYTES", default_value_t = 128 * 1024 * 1024)]
    pub max_inflight_body_bytes: usize,
    /// Time a client has to send a request's whole body (past it: 408).
    #[arg(long, value_name = "DURATION", alias = "body-read-timeout-ms", env = "CONNEX_BODY_READ_TIMEOUT", default_value = "60s", value_parser = millis)]
    pub body_read_timeout: Duration,
    /// Largest accepted max_tokens (and the max_tokens of a request that
    /// names none).
    #[arg(long, env = "CONNEX_MAX_TOKENS_LIMIT", default_value_t = 1 << 20)]
    pub max_tokens_limit: u64,
}

/// The router's calls to the engines: how long each step may take, and how
/// much it may read.
#[derive(Debug, Clone, Copy, Args, PartialEq)]
pub struct EngineArgs {
    /// Time limit of connecting to an engine.
    #[arg(long, value_name = "DURATION", alias = "connect-timeout-ms", env = "CONNEX_CONNECT_TIMEOUT", default_value = "2s", value_parser = millis)]
    pub connect_timeout: Duration,
    /// Time limit of a whole prefill call.
    #[arg(long, value_name = "DURATION", alias = "prefill-timeout-ms", env = "CONNEX_PREFILL_TIMEOUT", default_value = "600s", value_parser = millis)]
    pub prefill_timeout: Duration,
    /// How long a decoder may take to answer a decode request with its
    /// response headers; past it the request resumes elsewhere (cause
    /// `no_headers`).
    #[arg(long, value_name = "DURATION", alias = "decode-open-timeout-ms", env = "CONNEX_DECODE_OPEN_TIMEOUT", default_value = "10s", value_parser = millis)]
    pub decode_open_timeout: Duration,
    /// How long a decoder may take to send its first token (it pulls the
    /// prompt's KV first: keep this above the connector's pull timeout, 30s).
    /// The stall timeout applies after the first token.
    #[arg(long, value_name = "DURATION", alias = "first-token-timeout-ms", env = "CONNEX_FIRST_TOKEN_TIMEOUT", default_value = "60s", value_parser = millis)]
    pub first_token_timeout: Duration,
    /// A decoder that sends no event for this long after its first token is
    /// failed and the request resumed (before it: --first-token-timeout).
    #[arg(long, value_name = "DURATION", alias = "stall-timeout-ms", env = "CONNEX_STALL_TIMEOUT", default_value = "10s", value_parser = millis)]
    pub stall_timeout: Duration,
    /// Largest SSE event accepted from a decoder (larger: the decoder failed,
    /// cause `protocol`).
    #[arg(long, value_name = "BYTES", env = "CONNEX_MAX_SSE_EVENT_BYTES", default_value_t = 1024 * 1024)]
    pub max_sse_event_bytes: usize,
    /// Largest prefill answer read (it carries the prompt's token ids).
    #[arg(long, value_name = "BYTES", env = "CONNEX_MAX_UPSTREAM_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_upstream_body_bytes: usize,
}

/// Which instance serves a request (`policy/`), and what the choice reads.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct RoutingArgs {
    /// Policy choosing a prefill instance.
    #[arg(
        long,
        env = "CONNEX_PREFILL_POLICY",
        value_enum,
        default_value = "round_robin"
    )]
    pub prefill_policy: PolicyKind,
    /// Policy choosing a decode instance.
    #[arg(
        long,
        env = "CONNEX_DECODE_POLICY",
        value_enum,
        default_value = "least_loaded"
    )]
    pub decode_policy: PolicyKind,
    /// `cache_aware`: the prompt's cached fraction on the best instance past
    /// which that instance is chosen (below it, the least loaded is).
    #[arg(long, env = "CONNEX_CACHE_THRESHOLD", default_value_t = 0.3)]
    pub cache_threshold: f64,
    /// `cache_aware`: load balancing overrides the cache when the most and
    /// least loaded candidates differ by more than this many requests...
    #[arg(long, env = "CONNEX_BALANCE_ABS_THRESHOLD", default_value_t = 64.0)]
    pub balance_abs_threshold: f64,
    /// ...and the most loaded has more than this many times the least's load.
    #[arg(long, env = "CONNEX_BALANCE_REL_THRESHOLD", default_value_t = 1.5)]
    pub balance_rel_threshold: f64,
    /// Most KV blocks indexed per instance from its KV events (the oldest are
    /// forgotten past it).
    #[arg(long, env = "CONNEX_PREFIX_INDEX_BLOCKS", default_value_t = 16_384)]
    pub prefix_index_blocks: usize,
    /// Most KV blocks all instances' prefix indexes hold together (about 80
    /// bytes each): registrants cannot grow the router past it, however
    /// many register. An index past it forgets its own oldest blocks.
    #[arg(long, env = "CONNEX_PREFIX_INDEX_TOTAL_BLOCKS", default_value_t = 1 << 20)]
    pub prefix_index_total_blocks: usize,
    /// `cache_aware` with engines that send no KV events: the block size of
    /// the router's own record of the prompts it sent each one (an
    /// approximate index; an engine's first event replaces it).
    #[arg(long, env = "CONNEX_KV_BLOCK_SIZE", default_value_t = 16)]
    pub kv_block_size: usize,
    /// Time limit of a call to an engine's tokenizer: the `/tokenize` that
    /// gets a text prompt's token ids for `cache_aware` prefill choice (past
    /// it, the choice is by load alone), and the `/detokenize` calls that find
    /// which token of a merged chunk completed a stop string (past it, the
    /// chunk keeps all its tokens).
    #[arg(long, value_name = "DURATION", alias = "tokenize-timeout-ms", env = "CONNEX_TOKENIZE_TIMEOUT", default_value = "2s", value_parser = millis)]
    pub tokenize_timeout: Duration,
    /// A tokenizer the router runs itself, `MODEL=PATH`: the model's Hugging
    /// Face `tokenizer.json`, the same file the engines load. Completions
    /// text prompts of that model are tokenized here for `cache_aware`
    /// instead of by an engine's `/tokenize` (chat prompts still are, for
    /// the chat template). Repeatable; in the environment, comma-separated.
    #[arg(
        long,
        env = "CONNEX_TOKENIZER",
        value_delimiter = ',',
        value_name = "MODEL=PATH"
    )]
    pub tokenizer: Vec<String>,
    /// How long new requests avoid a decoder after a connect to it failed (at
    /// most half the decoders are avoided at once).
    #[arg(long, value_name = "DURATION", alias = "suspect-ms", env = "CONNEX_SUSPECT_FOR", default_value = "5s", value_parser = millis)]
    pub suspect_for: Duration,
}

/// What a request does when its decoder fails (`pd/resume.rs`).
#[derive(Debug, Clone, Copy, Args, PartialEq)]
pub struct ResumeArgs {
    /// Most times one request moves to another decoder; then it fails with an error.
    #[arg(long, env = "CONNEX_MAX_RESUMES", default_value_t = 3)]
    pub max_resumes: u32,
    /// What a resume does when the prefill's hold is gone: prefill prompt +
    /// generated tokens again on a healthy prefill instance, or fail the request.
    #[arg(
        long,
        env = "CONNEX_ON_HOLD_LOST",
        value_enum,
        default_value = "reprefill"
    )]
    pub on_hold_lost: OnHoldLost,
    /// Time limit of each call to a holder's control listener (hold check,
    /// release, renew).
    #[arg(long, value_name = "DURATION", alias = "ctrl-timeout-ms", env = "CONNEX_CTRL_TIMEOUT", default_value = "1s", value_parser = millis)]
    pub ctrl_timeout: Duration,
    /// How long a resume waits for a decoder to become eligible when none is.
    #[arg(long, value_name = "DURATION", alias = "resume-wait-ms", env = "CONNEX_RESUME_WAIT", default_value = "2s", value_parser = millis)]
    pub resume_wait: Duration,
}

/// The membership (`membership/`): how long an instance lives without a
/// heartbeat, how many there may be, and the static ones.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct MembershipArgs {
    /// Time without a heartbeat after which an instance gets no traffic.
    #[arg(long, value_name = "DURATION", alias = "heartbeat-ttl-s", env = "CONNEX_HEARTBEAT_TTL", default_value = "10s", value_parser = secs)]
    pub heartbeat_ttl: Duration,
    /// Most instances the registry holds (further registrations: 503).
    #[arg(long, env = "CONNEX_MAX_INSTANCES", default_value_t = 1024)]
    pub max_instances: usize,
    /// How long an expired (dead) instance stays listed before it is evicted.
    #[arg(long, value_name = "DURATION", alias = "dead-instance-grace-s", env = "CONNEX_DEAD_INSTANCE_GRACE", default_value = "1m", value_parser = secs)]
    pub dead_instance_grace: Duration,
    /// A static prefill instance, `URL[,CTRL]` (CTRL: its KV holder's control
    /// address, as the agent would register it). Repeatable. Static instances
    /// send no heartbeats: they are kept until removed and out of rotation
    /// while their health probes fail.
    #[arg(long, value_name = "URL[,CTRL]")]
    pub prefill: Vec<String>,
    /// A static decode instance, `URL`. Repeatable.
    #[arg(long, value_name = "URL")]
    pub decode: Vec<String>,
    /// The model the static instances serve (`--prefill`, `--decode`).
    /// Without it, each is registered under the models its `/v1/models`
    /// lists, once it answers.
    #[arg(long, env = "CONNEX_STATIC_MODEL")]
    pub static_model: Option<String>,
}

impl MembershipArgs {
    /// The defaults with a heartbeat TTL of `ttl` and no static instances, for tests.
    #[cfg(test)]
    pub fn with_ttl(ttl: Duration) -> Self {
        Self {
            heartbeat_ttl: ttl,
            max_instances: 1024,
            dead_instance_grace: Duration::from_secs(60),
            prefill: Vec::new(),
            decode: Vec::new(),
            static_model: None,
        }
    }
}

/// Membership in etcd (`--etcd`, several router replicas), and how to reach it.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct EtcdArgs {
    /// etcd endpoints (comma-separated URLs, e.g. http://127.0.0.1:2379) holding
    /// the membership shared by router replicas. Unset: in-memory membership of
    /// this router alone. Needs a build with the `etcd` cargo feature.
    #[arg(long, env = "CONNEX_ETCD")]
    pub etcd: Option<String>,
    /// Key prefix of this cluster's membership in etcd (replicas sharing a
    /// prefix share their instances).
    #[arg(long, env = "CONNEX_ETCD_PREFIX", default_value = "/connex")]
    pub etcd_prefix: String,
    /// Time limit of each etcd call and connection attempt.
    #[arg(long, value_name = "DURATION", alias = "etcd-timeout-ms", env = "CONNEX_ETCD_TIMEOUT", default_value = "2s", value_parser = millis)]
    pub etcd_timeout: Duration,
    /// CA certificate (PEM) that etcd's server certificate must chain to (TLS).
    #[arg(long, env = "CONNEX_ETCD_CA_FILE")]
    pub etcd_ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for etcd mutual TLS (with --etcd-key-file).
    #[arg(long, env = "CONNEX_ETCD_CERT_FILE")]
    pub etcd_cert_file: Option<PathBuf>,
    /// Client key (PEM) for etcd mutual TLS.
    #[arg(long, env = "CONNEX_ETCD_KEY_FILE")]
    pub etcd_key_file: Option<PathBuf>,
    /// etcd user (with --etcd-password-file or CONNEX_ETCD_PASSWORD).
    #[arg(long, env = "CONNEX_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// etcd password (prefer CONNEX_ETCD_PASSWORD or --etcd-password-file).
    #[arg(long, env = "CONNEX_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,
    /// File holding the etcd password.
    #[arg(long, env = "CONNEX_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

/// The active `/health` probes of every ready instance (`health.rs`).
#[derive(Debug, Clone, Copy, Args, PartialEq)]
pub struct HealthArgs {
    /// How often the router probes every ready instance's `/health` (0: no
    /// probes; heartbeats and stream errors only).
    #[arg(long, value_name = "DURATION", alias = "health-check-interval-ms", env = "CONNEX_HEALTH_CHECK_INTERVAL", default_value = "1s", value_parser = millis)]
    pub health_check_interval: Duration,
    /// Time limit of one probe.
    #[arg(long, value_name = "DURATION", alias = "health-check-timeout-ms", env = "CONNEX_HEALTH_CHECK_TIMEOUT", default_value = "2s", value_parser = millis)]
    pub health_check_timeout: Duration,
    /// Failed probes in a row after which an instance is declared dead (its
    /// streams resume elsewhere; a probe that succeeds brings it back).
    #[arg(long, env = "CONNEX_HEALTH_CHECK_FAILURES", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_check_failures: u32,
}

/// Stored and background Responses, in memory or in the store every replica shares (`--response-store`).
#[derive(Debug, Clone, Args, PartialEq)]
pub struct ResponsesArgs {
    /// Most responses (`/v1/responses`, `store` not false) kept for
    /// `previous_response_id` and `GET /v1/responses/{id}`; past it the oldest go.
    #[arg(long, env = "CONNEX_MAX_STORED_RESPONSES", default_value_t = 10_000)]
    pub max_stored_responses: usize,
    /// Most background responses (`background: true`) whose events are kept
    /// for readers (`GET ...?stream=true&starting_after=N`); those finished
    /// longest ago are forgotten first, and past it with all in progress a
    /// new one gets 429.
    #[arg(long, env = "CONNEX_MAX_BACKGROUND_RESPONSES", default_value_t = 1024)]
    pub max_background_responses: usize,
    /// Most bytes of stored responses (their objects and conversations);
    /// past it the oldest go.
    #[arg(long, value_name = "BYTES", env = "CONNEX_MAX_STORED_RESPONSE_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub max_stored_response_bytes: usize,
    /// Most stored responses one tenant keeps (a tenant's
    /// `max_stored_responses` in the tenants file overrides it); past it,
    /// that tenant's own oldest go. Without it: --max-stored-responses. Past
    /// the router's totals, the tenant holding the most gives up its oldest:
    /// one tenant never evicts another's responses while it holds more.
    #[arg(long, env = "CONNEX_MAX_STORED_RESPONSES_PER_TENANT")]
    pub max_stored_responses_per_tenant: Option<usize>,
    /// Most bytes of stored responses one tenant keeps (a tenant's
    /// `max_stored_bytes` overrides it). Without it: --max-stored-response-bytes.
    #[arg(
        long,
        value_name = "BYTES",
        env = "CONNEX_MAX_STORED_RESPONSE_BYTES_PER_TENANT"
    )]
    pub max_stored_response_bytes_per_tenant: Option<usize>,
    /// Most background responses one tenant has kept, in progress or finished
    /// (a tenant's `max_background_responses` overrides it): past it its own
    /// finished ones are forgotten first, and with all in progress its next
    /// one gets 429, so that no tenant holds every slot.
    #[arg(
        long,
        env = "CONNEX_MAX_BACKGROUND_RESPONSES_PER_TENANT",
        default_value_t = 256
    )]
    pub max_background_responses_per_tenant: usize,
    /// Most bytes of finished background responses' event logs (their
    /// events and response) kept for readers; past it, those finished
    /// longest ago of the tenant holding the most bytes are forgotten (the
    /// stored response stays).
    #[arg(long, value_name = "BYTES", env = "CONNEX_MAX_BACKGROUND_RESPONSE_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub max_background_response_bytes: usize,
    /// Most bytes of one tenant's finished background responses' event logs
    /// (a tenant's `max_background_bytes` overrides it): past it, its own
    /// finished longest ago are forgotten.
    #[arg(long, value_name = "BYTES", env = "CONNEX_MAX_BACKGROUND_RESPONSE_BYTES_PER_TENANT", default_value_t = 64 * 1024 * 1024)]
    pub max_background_response_bytes_per_tenant: usize,
    /// Redis that every replica shares for stored responses and background
    /// responses' events (`redis://HOST:PORT[/DB]`, `rediss://` for TLS), so
    /// that any replica serves them. Without it: this process's memory (one
    /// replica). The password goes in --response-store-password-file or
    /// CONNEX_RESPONSE_STORE_PASSWORD, never in the URL.
    #[arg(long, env = "CONNEX_RESPONSE_STORE")]
    pub response_store: Option<String>,
    /// Password of the response store (prefer CONNEX_RESPONSE_STORE_PASSWORD
    /// or --response-store-password-file).
    #[arg(long, env = "CONNEX_RESPONSE_STORE_PASSWORD", hide_env_values = true)]
    pub response_store_password: Option<String>,
    /// File holding the response store's password.
    #[arg(long, env = "CONNEX_RESPONSE_STORE_PASSWORD_FILE")]
    pub response_store_password_file: Option<PathBuf>,
    /// CA certificate (PEM) the response store's server certificate must
    /// chain to (rediss://; without it, the system's roots).
    #[arg(long, env = "CONNEX_RESPONSE_STORE_CA_FILE")]
    pub response_store_ca_file: Option<PathBuf>,
    /// Prefix of the response store's keys (the replicas of one cluster share it).
    #[arg(long, env = "CONNEX_RESPONSE_STORE_PREFIX", default_value = "connex:")]
    pub response_store_prefix: String,
    /// Most bytes one response may hold in the response store: a stored
    /// response's object and conversation; a background response's events,
    /// request and checkpoint (docs/operations.md, "Bytes per response").
    /// A stored response over it is not stored there (logged, counted in
    /// connex_response_store_too_large_total); a background response that
    /// passes it fails (`response_too_large`) and its generation stops.
    #[arg(long, value_name = "BYTES", env = "CONNEX_RESPONSE_STORE_MAX_RESPONSE_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub response_store_max_response_bytes: usize,
    /// How long a response lives in the response store (its keys expire then).
    #[arg(long, value_name = "DURATION", alias = "response-store-ttl-s", env = "CONNEX_RESPONSE_STORE_TTL", default_value = "168h", value_parser = secs)]
    pub response_store_ttl: Duration,
    /// Time limit of each response store call and connection attempt (past
    /// it the store counts as unavailable).
    #[arg(long, value_name = "DURATION", alias = "response-store-timeout-ms", env = "CONNEX_RESPONSE_STORE_TIMEOUT", default_value = "1s", value_parser = millis)]
    pub response_store_timeout: Duration,
    /// How long a replica's claim on a background response it generates
    /// lasts without renewal (renewed three times as often): past it,
    /// another replica sharing the response store takes the generation over
    /// from its last checkpoint. Lower: a quicker takeover after a crash,
    /// more renewals.
    #[arg(long, value_name = "DURATION", alias = "response-lease-ms", env = "CONNEX_RESPONSE_LEASE", default_value = "3s", value_parser = millis)]
    pub response_lease: Duration,
}

/// A selection policy (`--prefill-policy`, `--decode-policy`), set separately
/// for prefill and decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PolicyKind {
    RoundRobin,
    /// Fewest requests in flight from this router.
    LeastLoaded,
    /// The less loaded of two random candidates.
    PowerOfTwo,
    /// Least loaded by the engines' own reports (running, waiting, KV usage;
    /// sent with heartbeats) and this router's in-flight count together.
    LoadAware,
    /// The instance whose KV cache holds the longest prefix of the prompt (from
    /// its KV events), unless load is imbalanced past the balance thresholds
    /// or the hit is under --cache-threshold: then `load_aware`.
    CacheAware,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum LogFormat {
    Text,
    Json,
}

/// `--on-hold-lost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum OnHoldLost {
    Reprefill,
    Fail,
}
