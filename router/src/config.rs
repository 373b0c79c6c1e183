//! Router configuration: one clap struct is the single source of truth.
//!
//! Every flag can also be set by an env var `CONNEX_<FLAG>` and by a key of the
//! TOML file given with `--config` (snake_case flag names). Precedence: command
//! line, then environment, then file, then defaults.
//!
//! A duration takes its unit (`30s`, `250ms`, `5m`, `1h`); a bare number is in
//! the unit its flag had when its name said it (`--stall-timeout-ms` is now
//! `--stall-timeout`, and both `--stall-timeout-ms 500` and
//! `--stall-timeout 500ms` still mean half a second): the old flag names, env
//! vars and file keys are kept, so nothing a user wrote breaks.
//!
//! A leaf: it imports nothing from the crate, so that every subsystem can be
//! built and tested from its own small config (assembled in `lib.rs`).
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "connex-router",
    version,
    about = "P/D disaggregated LLM router with request resume"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once at start: the size of the `serve` variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI API, registration and admin routes.
    Serve(RouterConfig),
    /// Run an in-process demo cluster (router + 1 prefill + 2 decode mocks).
    Demo(DemoArgs),
}

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Tokens per demo request.
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u32,
}

/// `connex-router serve` flags.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct RouterConfig {
    /// TOML file with any of these settings (snake_case keys).
    #[arg(help_heading = "Listeners and logs", long, env = "CONNEX_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(
        help_heading = "Listeners and logs",
        long,
        env = "CONNEX_LISTEN",
        default_value = "127.0.0.1:8000"
    )]
    pub listen: SocketAddr,
    /// Host (IP address) of the client listener, as vLLM and vllm-router users
    /// type it; the port is --port's or --listen's default. Not with --listen.
    // No env var for --host and --port: Kubernetes sets CONNEX_PORT
    // (tcp://...) in every pod of a namespace with a Service named `connex`.
    #[arg(help_heading = "Listeners and logs", long, conflicts_with = "listen")]
    pub host: Option<IpAddr>,
    /// Port of the client listener (with --host, or on --listen's default
    /// host). Not with --listen.
    #[arg(help_heading = "Listeners and logs", long, conflicts_with = "listen")]
    pub port: Option<u16>,
    /// Log line format: `text` for people, `json` (one object a line) for log
    /// pipelines.
    #[arg(
        help_heading = "Listeners and logs",
        long,
        env = "CONNEX_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// What is logged: a level (`info`, `debug`...) or a tracing filter
    /// (`info,connex::access=off`). Unset: CONNEX_LOG, else `info`.
    #[arg(help_heading = "Listeners and logs", long, env = "CONNEX_LOG_LEVEL")]
    pub log_level: Option<String>,
    /// OTLP/HTTP collector (protobuf) the request spans are exported to, e.g.
    /// http://otel-collector:4318 (`/v1/traces` is added to a URL without a
    /// path). Unset: no export; trace context still reaches the engines.
    #[arg(
        help_heading = "Listeners and logs",
        long,
        env = "CONNEX_OTLP_ENDPOINT"
    )]
    pub otlp_endpoint: Option<String>,
    /// Bearer token for /admin routes. Without it the admin API refuses every call.
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Bearer token instances must send to register and heartbeat (open when unset).
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_REGISTER_TOKEN",
        hide_env_values = true
    )]
    pub register_token: Option<String>,
    /// Secret that the engines' KV holders require on their control listeners
    /// (the same CONNEX_TRANSFER_SECRET as theirs): the router needs it to
    /// renew, check and release holds.
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_TRANSFER_SECRET",
        hide_env_values = true
    )]
    pub transfer_secret: Option<String>,
    /// Policy choosing a prefill instance.
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_PREFILL_POLICY",
        value_enum,
        default_value = "round_robin"
    )]
    pub prefill_policy: PolicyKind,
    /// Policy choosing a decode instance.
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_DECODE_POLICY",
        value_enum,
        default_value = "least_loaded"
    )]
    pub decode_policy: PolicyKind,
    /// `cache_aware`: the prompt's cached fraction on the best instance past
    /// which that instance is chosen (below it, the least loaded is).
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_CACHE_THRESHOLD",
        default_value_t = 0.3
    )]
    pub cache_threshold: f64,
    /// `cache_aware`: load balancing overrides the cache when the most and
    /// least loaded candidates differ by more than this many requests...
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_BALANCE_ABS_THRESHOLD",
        default_value_t = 64.0
    )]
    pub balance_abs_threshold: f64,
    /// ...and the most loaded has more than this many times the least's load.
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_BALANCE_REL_THRESHOLD",
        default_value_t = 1.5
    )]
    pub balance_rel_threshold: f64,
    /// Most KV blocks indexed per instance from its KV events (the oldest are
    /// forgotten past it).
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_PREFIX_INDEX_BLOCKS",
        default_value_t = 16_384
    )]
    pub prefix_index_blocks: usize,
    /// Most KV blocks all instances' prefix indexes hold together (about 80
    /// bytes each): registrants cannot grow the router past it, however
    /// many register. An index past it forgets its own oldest blocks.
    #[arg(help_heading = "Routing", long, env = "CONNEX_PREFIX_INDEX_TOTAL_BLOCKS", default_value_t = 1 << 20)]
    pub prefix_index_total_blocks: usize,
    /// `cache_aware` with engines that send no KV events: the block size of
    /// the router's own record of the prompts it sent each one (an
    /// approximate index; an engine's first event replaces it).
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_KV_BLOCK_SIZE",
        default_value_t = 16
    )]
    pub kv_block_size: usize,
    /// Time limit of a call to an engine's tokenizer, in milliseconds: the
    /// `/tokenize` that gets a text prompt's token ids for `cache_aware`
    /// prefill choice (past it, the choice is by load alone), and the
    /// `/detokenize` calls that find which token of a merged chunk completed a
    /// stop string (past it, the chunk keeps all its tokens).
    #[arg(value_name = "DURATION", help_heading = "Routing", long, alias = "tokenize-timeout-ms", env = "CONNEX_TOKENIZE_TIMEOUT_MS", default_value = "2s", value_parser = millis)]
    pub tokenize_timeout: Duration,
    /// A tokenizer the router runs itself, `MODEL=PATH`: the model's Hugging
    /// Face `tokenizer.json`, the same file the engines load. Completions
    /// text prompts of that model are tokenized here for `cache_aware`
    /// instead of by an engine's `/tokenize` (chat prompts still are, for
    /// the chat template). Repeatable; in the environment, comma-separated.
    #[arg(
        help_heading = "Routing",
        long,
        env = "CONNEX_TOKENIZER",
        value_delimiter = ',',
        value_name = "MODEL=PATH"
    )]
    pub tokenizer: Vec<String>,
    /// Seconds without a heartbeat after which an instance gets no traffic.
    #[arg(value_name = "DURATION", help_heading = "Membership", long, alias = "heartbeat-ttl-s", env = "CONNEX_HEARTBEAT_TTL_S", default_value = "10s", value_parser = secs)]
    pub heartbeat_ttl: Duration,
    /// Largest accepted request body, in bytes (larger: 413).
    #[arg(help_heading = "Timeouts and bounds", long, env = "CONNEX_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Request body bytes all clients' requests may hold at once (a request
    /// holds its body until it ends: a resume sends it again); past it, 503
    /// with Retry-After before more is read. Bounds what client bodies can
    /// cost the router's memory (a body is kept once, at its size, shared by
    /// its engine calls).
    #[arg(help_heading = "Timeouts and bounds", long, env = "CONNEX_MAX_INFLIGHT_BODY_BYTES", default_value_t = 128 * 1024 * 1024)]
    pub max_inflight_body_bytes: usize,
    /// Time a client has to send a request's whole body, in milliseconds
    /// (past it: 408).
    #[arg(value_name = "DURATION", help_heading = "Timeouts and bounds", long, alias = "body-read-timeout-ms", env = "CONNEX_BODY_READ_TIMEOUT_MS", default_value = "60s", value_parser = millis)]
    pub body_read_timeout: Duration,
    /// Largest accepted max_tokens.
    #[arg(help_heading = "Timeouts and bounds", long, env = "CONNEX_MAX_TOKENS_LIMIT", default_value_t = 1 << 20)]
    pub max_tokens_limit: u64,
    /// Timeout for connecting to an engine, in milliseconds.
    #[arg(value_name = "DURATION", help_heading = "Timeouts and bounds", long, alias = "connect-timeout-ms", env = "CONNEX_CONNECT_TIMEOUT_MS", default_value = "2s", value_parser = millis)]
    pub connect_timeout: Duration,
    /// Timeout for a whole prefill call, in milliseconds.
    #[arg(value_name = "DURATION", help_heading = "Timeouts and bounds", long, alias = "prefill-timeout-ms", env = "CONNEX_PREFILL_TIMEOUT_MS", default_value = "600s", value_parser = millis)]
    pub prefill_timeout: Duration,
    /// A decoder that sends no event for this long after its first token is
    /// failed and the request resumed (before it: --first-token-timeout).
    #[arg(value_name = "DURATION", help_heading = "Timeouts and bounds", long, alias = "stall-timeout-ms", env = "CONNEX_STALL_TIMEOUT_MS", default_value = "10s", value_parser = millis)]
    pub stall_timeout: Duration,
    /// Most times one request moves to another decoder; then it fails with an error.
    #[arg(
        help_heading = "Resume",
        long,
        env = "CONNEX_MAX_RESUMES",
        default_value_t = 3
    )]
    pub max_resumes: u32,
    /// What a resume does when the prefill's hold is gone: prefill prompt +
    /// generated tokens again on a healthy prefill instance, or fail the request.
    #[arg(
        help_heading = "Resume",
        long,
        env = "CONNEX_ON_HOLD_LOST",
        value_enum,
        default_value = "reprefill"
    )]
    pub on_hold_lost: OnHoldLost,
    /// Time limit of each call to a holder's control listener (hold check,
    /// release, renew), in milliseconds.
    #[arg(value_name = "DURATION", help_heading = "Resume", long, alias = "ctrl-timeout-ms", env = "CONNEX_CTRL_TIMEOUT_MS", default_value = "1s", value_parser = millis)]
    pub ctrl_timeout: Duration,
    /// How long a resume waits for a decoder to become eligible when none is.
    #[arg(value_name = "DURATION", help_heading = "Resume", long, alias = "resume-wait-ms", env = "CONNEX_RESUME_WAIT_MS", default_value = "2s", value_parser = millis)]
    pub resume_wait: Duration,

    // --- Request path: timeouts and bounds (issue 13) ---
    /// How long a decoder may take to answer a decode request with its response
    /// headers, in milliseconds; past it the request resumes elsewhere (cause
    /// `no_headers`).
    #[arg(value_name = "DURATION", help_heading = "Timeouts and bounds", long, alias = "decode-open-timeout-ms", env = "CONNEX_DECODE_OPEN_TIMEOUT_MS", default_value = "10s", value_parser = millis)]
    pub decode_open_timeout: Duration,
    /// How long a decoder may take to send its first token, in milliseconds
    /// (it pulls the prompt's KV first: keep this above the connector's pull
    /// timeout, 30 s). The stall timeout applies after the first token.
    #[arg(value_name = "DURATION", help_heading = "Timeouts and bounds", long, alias = "first-token-timeout-ms", env = "CONNEX_FIRST_TOKEN_TIMEOUT_MS", default_value = "60s", value_parser = millis)]
    pub first_token_timeout: Duration,
    /// Largest SSE event accepted from a decoder, in bytes (larger: the decoder
    /// failed, cause `protocol`).
    #[arg(help_heading = "Timeouts and bounds", long, env = "CONNEX_MAX_SSE_EVENT_BYTES", default_value_t = 1024 * 1024)]
    pub max_sse_event_bytes: usize,
    /// Largest prefill answer read, in bytes (it carries the prompt's token ids).
    #[arg(help_heading = "Timeouts and bounds", long, env = "CONNEX_MAX_UPSTREAM_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_upstream_body_bytes: usize,
    /// How long new requests avoid a decoder after a connect to it failed, in
    /// milliseconds (at most half the decoders are avoided at once).
    #[arg(value_name = "DURATION", help_heading = "Routing", long, alias = "suspect-ms", env = "CONNEX_SUSPECT_MS", default_value = "5s", value_parser = millis)]
    pub suspect_for: Duration,

    // ---- The edge: listeners, who may get in, the registry's bounds, the
    // server's lifecycle (docs/security.md, docs/operations.md).
    /// Address of the internal listener: registration, admin and /metrics
    /// (the client listener serves only the OpenAI routes and the probes).
    #[arg(
        help_heading = "Listeners and logs",
        long,
        env = "CONNEX_INTERNAL_LISTEN",
        default_value = "127.0.0.1:8001"
    )]
    pub internal_listen: SocketAddr,
    /// File holding the admin token (instead of --admin-token).
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_ADMIN_TOKEN_FILE"
    )]
    pub admin_token_file: Option<PathBuf>,
    /// File holding the register token (instead of --register-token).
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_REGISTER_TOKEN_FILE"
    )]
    pub register_token_file: Option<PathBuf>,
    /// File holding the transfer secret (instead of --transfer-secret).
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_TRANSFER_SECRET_FILE"
    )]
    pub transfer_secret_file: Option<PathBuf>,
    /// Accept registrations without a register token on a non-loopback
    /// internal listener (anyone who reaches it can add an instance).
    #[arg(help_heading = "Secrets and access", long, env = "CONNEX_ALLOW_OPEN_REGISTRATION", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true")]
    pub allow_open_registration: bool,
    /// Most instances the registry holds (further registrations: 503).
    #[arg(
        help_heading = "Membership",
        long,
        env = "CONNEX_MAX_INSTANCES",
        default_value_t = 1024
    )]
    pub max_instances: usize,
    /// Seconds an expired (dead) instance stays listed before it is evicted.
    #[arg(value_name = "DURATION", help_heading = "Membership", long, alias = "dead-instance-grace-s", env = "CONNEX_DEAD_INSTANCE_GRACE_S", default_value = "1m", value_parser = secs)]
    pub dead_instance_grace: Duration,
    /// Send the serving instances' ids to clients (`x-connex-prefill`,
    /// `x-connex-decoder`).
    #[arg(help_heading = "Secrets and access", long, env = "CONNEX_EXPOSE_INSTANCE_HEADERS", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true")]
    pub expose_instance_headers: bool,
    /// Networks registered instances may live in (comma-separated CIDRs).
    /// Default: everything but link-local and cloud metadata addresses. The
    /// router's own listeners are always refused.
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_ALLOWED_UPSTREAMS"
    )]
    pub allowed_upstreams: Option<String>,
    /// On SIGTERM/SIGINT: seconds in-flight streams get to finish before they
    /// end with an error event.
    #[arg(value_name = "DURATION", help_heading = "Listeners and logs", long, alias = "shutdown-grace-s", env = "CONNEX_SHUTDOWN_GRACE_S", default_value = "30s", value_parser = secs)]
    pub shutdown_grace: Duration,
    /// Time a client has to send a request's headers, in milliseconds; it also
    /// bounds how long a kept-alive connection may idle between requests.
    #[arg(value_name = "DURATION", help_heading = "Listeners and logs", long, alias = "header-read-timeout-ms", env = "CONNEX_HEADER_READ_TIMEOUT_MS", default_value = "30s", value_parser = millis)]
    pub header_read_timeout: Duration,
    /// Most open client connections (further ones wait in the accept backlog).
    #[arg(
        help_heading = "Listeners and logs",
        long,
        env = "CONNEX_MAX_CONNECTIONS",
        default_value_t = 16_384
    )]
    pub max_connections: usize,
    /// A counter or histogram series not updated for this many seconds is
    /// dropped from /metrics (those of removed and evicted instances; 0:
    /// never). The per-instance gauges follow the membership at once.
    #[arg(value_name = "DURATION", help_heading = "Listeners and logs", long, alias = "metrics-idle-timeout-s", env = "CONNEX_METRICS_IDLE_TIMEOUT_S", default_value = "10m", value_parser = secs)]
    pub metrics_idle_timeout: Duration,
    /// Most OpenAI requests in flight; past it requests wait in per-tenant
    /// queues (--max-queued-per-tenant, --max-queue-wait), then 429 with
    /// Retry-After.
    #[arg(
        help_heading = "Tenants and admission",
        long,
        env = "CONNEX_MAX_CONCURRENT_REQUESTS",
        default_value_t = 10_000
    )]
    pub max_concurrent_requests: usize,
    /// Most requests of one tenant waiting for a slot (0: none wait, past the
    /// limit is 429 at once).
    #[arg(
        help_heading = "Tenants and admission",
        long,
        env = "CONNEX_MAX_QUEUED_PER_TENANT",
        default_value_t = 1024
    )]
    pub max_queued_per_tenant: usize,
    /// Longest a request waits for a slot before its 429, in milliseconds
    /// (0: none wait).
    #[arg(value_name = "DURATION", help_heading = "Tenants and admission", long, alias = "max-queue-wait-ms", env = "CONNEX_MAX_QUEUE_WAIT_MS", default_value = "10s", value_parser = millis)]
    pub max_queue_wait: Duration,
    /// The key clients must send on every client route but the probes
    /// (`Authorization: Bearer KEY`, or `x-api-key`), as vLLM's --api-key.
    /// Its tenant is `default`. Unset, and without --tenants-file: open.
    #[arg(
        help_heading = "Secrets and access",
        long,
        env = "CONNEX_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// File holding the API key (instead of --api-key).
    #[arg(help_heading = "Secrets and access", long, env = "CONNEX_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Tenants (TOML: `[[tenant]]` with name, keys, max_concurrent,
    /// tokens_per_minute, weight, priority, kv_cache; docs/operations.md). Read again
    /// on SIGHUP and when it changes; a bad file keeps the tenants in force.
    #[arg(help_heading = "Secrets and access", long, env = "CONNEX_TENANTS_FILE")]
    pub tenants_file: Option<PathBuf>,

    // --- Static instances (engines without the agent) ---
    /// A static prefill instance, `URL[,CTRL]` (CTRL: its KV holder's control
    /// address, as the agent would register it). Repeatable. Static instances
    /// send no heartbeats: they are kept until removed and out of rotation
    /// while their health probes fail.
    #[arg(help_heading = "Membership", long, value_name = "URL[,CTRL]")]
    pub prefill: Vec<String>,
    /// A static decode instance, `URL`. Repeatable.
    #[arg(help_heading = "Membership", long, value_name = "URL")]
    pub decode: Vec<String>,
    /// The model the static instances serve (`--prefill`, `--decode`).
    /// Without it, each is registered under the models its `/v1/models`
    /// lists, once it answers.
    #[arg(help_heading = "Membership", long, env = "CONNEX_STATIC_MODEL")]
    pub static_model: Option<String>,
    #[command(flatten, next_help_heading = "etcd")]
    pub etcd: EtcdArgs,
    #[command(flatten, next_help_heading = "Health checks")]
    pub health: HealthArgs,
    #[command(flatten, next_help_heading = "HTTP/2")]
    pub http2: Http2Args,
    #[command(flatten, next_help_heading = "Responses")]
    pub responses: ResponsesArgs,
}

/// Membership in etcd (`--etcd`, several router replicas), and how to reach it.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct EtcdArgs {
    /// etcd endpoints (comma-separated URLs, e.g. http://127.0.0.1:2379) holding
    /// the membership shared by router replicas. Unset: in-memory membership of
    /// this router alone. Needs a build with the `etcd` cargo feature.
    #[arg(long = "etcd", id = "etcd", value_name = "ETCD", env = "CONNEX_ETCD")]
    pub endpoints: Option<String>,
    /// Key prefix of this cluster's membership in etcd (replicas sharing a
    /// prefix share their instances).
    #[arg(
        long = "etcd-prefix",
        id = "etcd_prefix",
        value_name = "ETCD_PREFIX",
        env = "CONNEX_ETCD_PREFIX",
        default_value = "/connex"
    )]
    pub prefix: String,
    /// Timeout of each etcd call and connection attempt, in milliseconds.
    #[arg(long = "etcd-timeout", id = "etcd_timeout", value_name = "DURATION", alias = "etcd-timeout-ms", env = "CONNEX_ETCD_TIMEOUT_MS", default_value = "2s", value_parser = millis)]
    pub timeout: Duration,
    /// CA certificate (PEM) that etcd's server certificate must chain to (TLS).
    #[arg(
        long = "etcd-ca-file",
        id = "etcd_ca_file",
        value_name = "ETCD_CA_FILE",
        env = "CONNEX_ETCD_CA_FILE"
    )]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for etcd mutual TLS (with --etcd-key-file).
    #[arg(
        long = "etcd-cert-file",
        id = "etcd_cert_file",
        value_name = "ETCD_CERT_FILE",
        env = "CONNEX_ETCD_CERT_FILE"
    )]
    pub cert_file: Option<PathBuf>,
    /// Client key (PEM) for etcd mutual TLS.
    #[arg(
        long = "etcd-key-file",
        id = "etcd_key_file",
        value_name = "ETCD_KEY_FILE",
        env = "CONNEX_ETCD_KEY_FILE"
    )]
    pub key_file: Option<PathBuf>,
    /// etcd user (with --etcd-password-file or CONNEX_ETCD_PASSWORD).
    #[arg(
        long = "etcd-user",
        id = "etcd_user",
        value_name = "ETCD_USER",
        env = "CONNEX_ETCD_USER"
    )]
    pub user: Option<String>,
    /// etcd password (prefer CONNEX_ETCD_PASSWORD or --etcd-password-file).
    #[arg(
        long = "etcd-password",
        id = "etcd_password",
        value_name = "ETCD_PASSWORD",
        env = "CONNEX_ETCD_PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<String>,
    /// File holding the etcd password.
    #[arg(
        long = "etcd-password-file",
        id = "etcd_password_file",
        value_name = "ETCD_PASSWORD_FILE",
        env = "CONNEX_ETCD_PASSWORD_FILE"
    )]
    pub password_file: Option<PathBuf>,
}

/// The active `/health` probes of every ready instance (`health.rs`).
#[derive(Debug, Clone, Args, PartialEq)]
pub struct HealthArgs {
    /// How often the router probes every ready instance's `/health`, in
    /// milliseconds (0: no probes; heartbeats and stream errors only).
    #[arg(long = "health-check-interval", id = "health_check_interval", value_name = "DURATION", alias = "health-check-interval-ms", env = "CONNEX_HEALTH_CHECK_INTERVAL_MS", default_value = "1s", value_parser = millis)]
    pub interval: Duration,
    /// Time limit of one probe, in milliseconds.
    #[arg(long = "health-check-timeout", id = "health_check_timeout", value_name = "DURATION", alias = "health-check-timeout-ms", env = "CONNEX_HEALTH_CHECK_TIMEOUT_MS", default_value = "2s", value_parser = millis)]
    pub timeout: Duration,
    /// Failed probes in a row after which an instance is declared dead (its
    /// streams resume elsewhere; a probe that succeeds brings it back).
    #[arg(long = "health-check-failures", id = "health_check_failures", value_name = "HEALTH_CHECK_FAILURES",
        env = "CONNEX_HEALTH_CHECK_FAILURES",
        default_value_t = 3,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub failures: u32,
}

/// HTTP/2 on the client listener.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct Http2Args {
    /// Also speak HTTP/2 without TLS (h2c with prior knowledge, RFC 9113
    /// 3.3) on the client listener: a front proxy or client then carries many
    /// requests on one connection, one socket for many streams. HTTP/1.1
    /// clients are served as before.
    #[arg(long = "http2", id = "http2", value_name = "HTTP2", env = "CONNEX_HTTP2", num_args = 0..=1,
          default_value_t = false, default_missing_value = "true")]
    pub enabled: bool,
    /// Most requests in flight on one HTTP/2 connection (further ones are
    /// refused by the protocol until one ends).
    #[arg(long = "http2-max-streams", id = "http2_max_streams", value_name = "HTTP2_MAX_STREAMS", env = "CONNEX_HTTP2_MAX_STREAMS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams: u32,
    /// An HTTP/2 connection with no request in flight for this many seconds
    /// is closed (GOAWAY), as HTTP/1.1's idle wait is bounded by
    /// --header-read-timeout; its peer is also pinged this often and
    /// dropped when it does not answer within the same time.
    #[arg(long = "http2-idle-timeout", id = "http2_idle_timeout", value_name = "DURATION", alias = "http2-idle-timeout-s", env = "CONNEX_HTTP2_IDLE_TIMEOUT_S", default_value = "1m", value_parser = within_a_day)]
    pub idle_timeout: Duration,
}

/// Stored and background Responses, in memory or in the store every replica shares (`--response-store`).
#[derive(Debug, Clone, Args, PartialEq)]
pub struct ResponsesArgs {
    /// Most responses (`/v1/responses`, `store` not false) kept for
    /// `previous_response_id` and `GET /v1/responses/{id}`; past it the oldest go.
    #[arg(
        long = "max-stored-responses",
        id = "max_stored_responses",
        value_name = "MAX_STORED_RESPONSES",
        env = "CONNEX_MAX_STORED_RESPONSES",
        default_value_t = 10_000
    )]
    pub max_stored: usize,
    /// Most background responses (`background: true`) whose events are kept
    /// for readers (`GET ...?stream=true&starting_after=N`); those finished
    /// longest ago are forgotten first, and past it with all in progress a
    /// new one gets 429.
    #[arg(
        long = "max-background-responses",
        id = "max_background_responses",
        value_name = "MAX_BACKGROUND_RESPONSES",
        env = "CONNEX_MAX_BACKGROUND_RESPONSES",
        default_value_t = 1024
    )]
    pub max_background: usize,
    /// Most bytes of stored responses (their objects and conversations);
    /// past it the oldest go.
    #[arg(long = "max-stored-response-bytes", id = "max_stored_response_bytes", value_name = "MAX_STORED_RESPONSE_BYTES", env = "CONNEX_MAX_STORED_RESPONSE_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub max_stored_bytes: usize,
    /// Most stored responses one tenant keeps (a tenant's
    /// `max_stored_responses` in the tenants file overrides it); past it,
    /// that tenant's own oldest go. Without it: --max-stored-responses. Past
    /// the router's totals, the tenant holding the most gives up its oldest:
    /// one tenant never evicts another's responses while it holds more.
    #[arg(
        long = "max-stored-responses-per-tenant",
        id = "max_stored_responses_per_tenant",
        value_name = "MAX_STORED_RESPONSES_PER_TENANT",
        env = "CONNEX_MAX_STORED_RESPONSES_PER_TENANT"
    )]
    pub max_stored_per_tenant: Option<usize>,
    /// Most bytes of stored responses one tenant keeps (a tenant's
    /// `max_stored_bytes` overrides it). Without it: --max-stored-response-bytes.
    #[arg(
        long = "max-stored-response-bytes-per-tenant",
        id = "max_stored_response_bytes_per_tenant",
        value_name = "MAX_STORED_RESPONSE_BYTES_PER_TENANT",
        env = "CONNEX_MAX_STORED_RESPONSE_BYTES_PER_TENANT"
    )]
    pub max_stored_bytes_per_tenant: Option<usize>,
    /// Most background responses one tenant has kept, in progress or finished
    /// (a tenant's `max_background_responses` overrides it): past it its own
    /// finished ones are forgotten first, and with all in progress its next
    /// one gets 429, so that no tenant holds every slot.
    #[arg(
        long = "max-background-responses-per-tenant",
        id = "max_background_responses_per_tenant",
        value_name = "MAX_BACKGROUND_RESPONSES_PER_TENANT",
        env = "CONNEX_MAX_BACKGROUND_RESPONSES_PER_TENANT",
        default_value_t = 256
    )]
    pub max_background_per_tenant: usize,
    /// Most bytes of finished background responses' event logs (their
    /// events and response) kept for readers; past it, those finished
    /// longest ago of the tenant holding the most bytes are forgotten (the
    /// stored response stays).
    #[arg(long = "max-background-response-bytes", id = "max_background_response_bytes", value_name = "MAX_BACKGROUND_RESPONSE_BYTES", env = "CONNEX_MAX_BACKGROUND_RESPONSE_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub max_background_bytes: usize,
    /// Most bytes of one tenant's finished background responses' event logs
    /// (a tenant's `max_background_bytes` overrides it): past it, its own
    /// finished longest ago are forgotten.
    #[arg(long = "max-background-response-bytes-per-tenant", id = "max_background_response_bytes_per_tenant", value_name = "MAX_BACKGROUND_RESPONSE_BYTES_PER_TENANT", env = "CONNEX_MAX_BACKGROUND_RESPONSE_BYTES_PER_TENANT", default_value_t = 64 * 1024 * 1024)]
    pub max_background_bytes_per_tenant: usize,
    /// Redis that every replica shares for stored responses and background
    /// responses' events (`redis://HOST:PORT[/DB]`, `rediss://` for TLS), so
    /// that any replica serves them. Without it: this process's memory (one
    /// replica). The password goes in --response-store-password-file or
    /// CONNEX_RESPONSE_STORE_PASSWORD, never in the URL.
    #[arg(
        long = "response-store",
        id = "response_store",
        value_name = "RESPONSE_STORE",
        env = "CONNEX_RESPONSE_STORE"
    )]
    pub store: Option<String>,
    /// Password of the response store (prefer CONNEX_RESPONSE_STORE_PASSWORD
    /// or --response-store-password-file).
    #[arg(
        long = "response-store-password",
        id = "response_store_password",
        value_name = "RESPONSE_STORE_PASSWORD",
        env = "CONNEX_RESPONSE_STORE_PASSWORD",
        hide_env_values = true
    )]
    pub store_password: Option<String>,
    /// File holding the response store's password.
    #[arg(
        long = "response-store-password-file",
        id = "response_store_password_file",
        value_name = "RESPONSE_STORE_PASSWORD_FILE",
        env = "CONNEX_RESPONSE_STORE_PASSWORD_FILE"
    )]
    pub store_password_file: Option<PathBuf>,
    /// CA certificate (PEM) the response store's server certificate must
    /// chain to (rediss://; without it, the system's roots).
    #[arg(
        long = "response-store-ca-file",
        id = "response_store_ca_file",
        value_name = "RESPONSE_STORE_CA_FILE",
        env = "CONNEX_RESPONSE_STORE_CA_FILE"
    )]
    pub store_ca_file: Option<PathBuf>,
    /// Prefix of the response store's keys (the replicas of one cluster share it).
    #[arg(
        long = "response-store-prefix",
        id = "response_store_prefix",
        value_name = "RESPONSE_STORE_PREFIX",
        env = "CONNEX_RESPONSE_STORE_PREFIX",
        default_value = "connex:"
    )]
    pub store_prefix: String,
    /// Most bytes one response may hold in the response store: a stored
    /// response's object and conversation; a background response's events,
    /// request and checkpoint (docs/operations.md, "Bytes per response").
    /// A stored response over it is not stored there (logged, counted in
    /// connex_response_store_too_large_total); a background response that
    /// passes it fails (`response_too_large`) and its generation stops.
    #[arg(
        long = "response-store-max-response-bytes",
        id = "response_store_max_response_bytes",
        value_name = "BYTES",
        env = "CONNEX_RESPONSE_STORE_MAX_RESPONSE_BYTES",
        default_value_t = 16 * 1024 * 1024
    )]
    pub store_max_response_bytes: usize,
    /// Seconds a response lives in the response store (its keys expire then).
    #[arg(long = "response-store-ttl", id = "response_store_ttl", value_name = "DURATION", alias = "response-store-ttl-s", env = "CONNEX_RESPONSE_STORE_TTL_S", default_value = "168h", value_parser = secs)]
    pub store_ttl: Duration,
    /// Bound of each response store call and connection attempt, in
    /// milliseconds (past it the store counts as unavailable).
    #[arg(long = "response-store-timeout", id = "response_store_timeout", value_name = "DURATION", alias = "response-store-timeout-ms", env = "CONNEX_RESPONSE_STORE_TIMEOUT_MS", default_value = "1s", value_parser = millis)]
    pub store_timeout: Duration,
    /// How long a replica's claim on a background response it generates
    /// lasts without renewal, in milliseconds (renewed three times as
    /// often): past it, another replica sharing the response store takes the
    /// generation over from its last checkpoint. Lower: a quicker takeover
    /// after a crash, more renewals.
    #[arg(long = "response-lease", id = "response_lease", value_name = "DURATION", alias = "response-lease-ms", env = "CONNEX_RESPONSE_LEASE_MS", default_value = "3s", value_parser = millis)]
    pub lease: Duration,
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

/// Errors loading the configuration file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid TOML in {path}: {source}")]
    Toml {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("config key `{0}` is not a router setting")]
    UnknownKey(String),
    #[error(transparent)]
    Cli(#[from] clap::Error),
}

/// Parses the router's command line, merging the `--config` TOML file of
/// `serve` under the command line and the environment.
/// A duration with its unit (`250ms`, `30s`, `5m`, `1h`, or a sum such as
/// `1m30s`), or a bare number of `unit`s.
fn duration(text: &str, unit: Duration) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(count) = text.parse::<u64>() {
        return count
            .checked_mul(unit.as_millis() as u64)
            .map(Duration::from_millis)
            .ok_or_else(|| format!("{text} is too long a duration"));
    }
    let bad =
        || format!("`{text}` is not a duration: write it with a unit, as 250ms, 30s, 5m or 1h");
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let count: u64 = rest[..digits].parse().map_err(|_| bad())?;
        let after = &rest[digits..];
        let letters = after
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(after.len());
        let millis = match &after[..letters] {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return Err(bad()),
        };
        let part = count.checked_mul(millis).ok_or_else(bad)?;
        total = total
            .checked_add(Duration::from_millis(part))
            .ok_or_else(bad)?;
        rest = &after[letters..];
    }
    Ok(total)
}

/// A duration flag whose bare numbers are seconds (its old name ended `-s`).
fn secs(text: &str) -> Result<Duration, String> {
    duration(text, Duration::from_secs(1))
}

/// A duration flag whose bare numbers are milliseconds (its old name ended `-ms`).
fn millis(text: &str) -> Result<Duration, String> {
    duration(text, Duration::from_millis(1))
}

/// Seconds, from 1 s to a day (the HTTP/2 idle timeout).
fn within_a_day(text: &str) -> Result<Duration, String> {
    let value = secs(text)?;
    if value < Duration::from_secs(1) || value > Duration::from_secs(86_400) {
        return Err(format!("`{text}` is not between 1s and 24h"));
    }
    Ok(value)
}

/// The id of a file key: its flag's, or, for a duration flag's old name
/// (`stall_timeout_ms`), the flag it became (`stall_timeout`).
fn key_id(key: &str, serve: &ArgMatches) -> Option<String> {
    let id = key.replace('-', "_");
    if id != "config" && serve.try_get_raw(&id).is_ok() {
        return Some(id);
    }
    let renamed = RENAMED.iter().find(|(old, _)| *old == id)?.1;
    Some(renamed.to_string())
}

/// Flags renamed when durations took units: (old id, new id).
const RENAMED: &[(&str, &str)] = &[
    ("tokenize_timeout_ms", "tokenize_timeout"),
    ("heartbeat_ttl_s", "heartbeat_ttl"),
    ("body_read_timeout_ms", "body_read_timeout"),
    ("connect_timeout_ms", "connect_timeout"),
    ("prefill_timeout_ms", "prefill_timeout"),
    ("etcd_timeout_ms", "etcd_timeout"),
    ("stall_timeout_ms", "stall_timeout"),
    ("ctrl_timeout_ms", "ctrl_timeout"),
    ("resume_wait_ms", "resume_wait"),
    ("health_check_interval_ms", "health_check_interval"),
    ("health_check_timeout_ms", "health_check_timeout"),
    ("decode_open_timeout_ms", "decode_open_timeout"),
    ("first_token_timeout_ms", "first_token_timeout"),
    ("suspect_ms", "suspect_for"),
    ("dead_instance_grace_s", "dead_instance_grace"),
    ("shutdown_grace_s", "shutdown_grace"),
    ("header_read_timeout_ms", "header_read_timeout"),
    ("metrics_idle_timeout_s", "metrics_idle_timeout"),
    ("http2_idle_timeout_s", "http2_idle_timeout"),
    ("max_queue_wait_ms", "max_queue_wait"),
    ("response_store_ttl_s", "response_store_ttl"),
    ("response_store_timeout_ms", "response_store_timeout"),
    ("response_lease_ms", "response_lease"),
];

pub fn load(argv: Vec<OsString>) -> Result<Cli, ConfigError> {
    let command = Cli::command().args_override_self(true);
    let matches = command.clone().try_get_matches_from(&argv)?;
    let cli = Cli::from_arg_matches(&matches)?;
    let (Command::Serve(config), Some(serve)) = (&cli.command, matches.subcommand_matches("serve"))
    else {
        return Ok(cli);
    };
    let Some(path) = config.config.clone() else {
        return Ok(with_host_and_port(cli));
    };
    let file_args = file_arguments(&path, serve)?;
    // The file's settings go right after `serve`, so that any flag given on the
    // command line (later, and overriding) wins.
    let at = argv
        .iter()
        .position(|a| a == "serve")
        .map_or(argv.len(), |i| i + 1);
    let mut merged = argv;
    merged.splice(at..at, file_args.into_iter().map(OsString::from));
    let matches = command.try_get_matches_from(&merged)?;
    Ok(with_host_and_port(Cli::from_arg_matches(&matches)?))
}

/// Folds `--host`/`--port` into `listen`, the one address the router binds.
fn with_host_and_port(mut cli: Cli) -> Cli {
    if let Command::Serve(config) = &mut cli.command {
        if let Some(host) = config.host {
            config.listen.set_ip(host);
        }
        if let Some(port) = config.port {
            config.listen.set_port(port);
        }
    }
    cli
}

/// `--key=value` arguments for each key of the TOML file that the command line
/// and the environment left unset.
fn file_arguments(path: &PathBuf, serve: &ArgMatches) -> Result<Vec<String>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.clone(),
        source,
    })?;
    let table: toml::Table = text.parse().map_err(|source| ConfigError::Toml {
        path: path.clone(),
        source,
    })?;
    let mut args = Vec::new();
    for (key, value) in &table {
        let Some(id) = key_id(key, serve) else {
            return Err(ConfigError::UnknownKey(key.clone()));
        };
        if matches!(
            serve.value_source(&id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        // A list is a repeatable flag: one argument per item.
        let values = match value {
            toml::Value::Array(items) => items.iter().collect(),
            one => vec![one],
        };
        for value in values {
            let value = match value {
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            args.push(format!("--{}={value}", id.replace('_', "-")));
        }
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(args: &[&str]) -> Result<RouterConfig, ConfigError> {
        match load(args.iter().map(OsString::from).collect())?.command {
            Command::Serve(config) => Ok(config),
            Command::Demo(_) => panic!("expected serve"),
        }
    }

    #[test]
    fn file_sets_values_and_command_line_wins() {
        let dir = std::env::temp_dir().join(format!("connex-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("router.toml");
        std::fs::write(
            &path,
            "heartbeat_ttl_s = 3\ndecode_policy = \"power_of_two\"\nadmin_token = \"file\"\n",
        )
        .expect("write config");
        let path = path.to_string_lossy().to_string();
        let config = serve(&[
            "connex-router",
            "serve",
            "--config",
            &path,
            "--admin-token",
            "cli",
        ])
        .expect("parse");
        assert_eq!(config.heartbeat_ttl, Duration::from_secs(3));
        assert_eq!(config.decode_policy, PolicyKind::PowerOfTwo);
        assert_eq!(config.admin_token.as_deref(), Some("cli"));
    }

    #[test]
    fn host_and_port_set_the_client_listener() {
        let config = serve(&[
            "connex-router",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "9100",
        ])
        .expect("parse");
        assert_eq!(config.listen, "0.0.0.0:9100".parse().expect("addr"));
        let config = serve(&["connex-router", "serve", "--port", "9101"]).expect("parse");
        assert_eq!(config.listen, "127.0.0.1:9101".parse().expect("addr"));
        let config = serve(&["connex-router", "serve", "--host", "::1"]).expect("parse");
        assert_eq!(config.listen, "[::1]:8000".parse().expect("addr"));
    }

    #[test]
    fn host_or_port_with_listen_is_refused_by_name() {
        for flag in ["--host=0.0.0.0", "--port=9000"] {
            let err = serve(&["connex-router", "serve", "--listen", "127.0.0.1:1", flag])
                .expect_err("conflict");
            let ConfigError::Cli(err) = err else {
                panic!("not a command-line error: {err}");
            };
            assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
            let text = err.to_string();
            assert!(text.contains("--listen"), "{text}");
            assert!(
                text.contains(flag.split('=').next().unwrap_or(flag)),
                "{text}"
            );
        }
    }

    #[test]
    fn log_format_and_level_parse() {
        let config = serve(&["connex-router", "serve"]).expect("parse");
        assert_eq!(config.log_format, LogFormat::Text);
        assert_eq!(config.log_level, None);
        let config = serve(&[
            "connex-router",
            "serve",
            "--log-format",
            "json",
            "--log-level",
            "debug",
        ])
        .expect("parse");
        assert_eq!(config.log_format, LogFormat::Json);
        assert_eq!(config.log_level.as_deref(), Some("debug"));
        assert!(serve(&["connex-router", "serve", "--log-format", "xml"]).is_err());
    }

    #[test]
    fn http2_is_off_by_default_and_its_limits_are_checked() {
        let config = serve(&["connex-router", "serve"]).expect("parse");
        assert!(!config.http2.enabled);
        assert_eq!(
            (config.http2.max_streams, config.http2.idle_timeout),
            (256, Duration::from_secs(60))
        );
        let config = serve(&["connex-router", "serve", "--http2"]).expect("parse");
        assert!(config.http2.enabled);
        for bad in [
            ["--http2-max-streams", "0"],
            ["--http2-idle-timeout-s", "0"],
            ["--http2-idle-timeout", "500ms"],
            ["--http2-idle-timeout", "25h"],
            ["--http2-idle-timeout", "100000000000000000000"],
        ] {
            let mut args = vec!["connex-router", "serve"];
            args.extend(bad);
            assert!(serve(&args).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn static_instances_come_from_flags_or_a_file_list() {
        let dir = std::env::temp_dir().join(format!("connex-config-static-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("router.toml");
        std::fs::write(
            &path,
            "prefill = [\"http://10.0.0.1:8100,10.0.0.1:7000\"]\ndecode = [\"http://10.0.0.2:8200\", \"http://10.0.0.3:8200\"]\nstatic_model = \"m\"\n",
        )
        .expect("write config");
        let path = path.to_string_lossy().to_string();
        let config = serve(&["connex-router", "serve", "--config", &path]).expect("parse");
        assert_eq!(config.prefill, ["http://10.0.0.1:8100,10.0.0.1:7000"]);
        assert_eq!(
            config.decode,
            ["http://10.0.0.2:8200", "http://10.0.0.3:8200"]
        );
        assert_eq!(config.static_model.as_deref(), Some("m"));
        let config = serve(&[
            "connex-router",
            "serve",
            "--decode",
            "http://a:1",
            "--decode",
            "http://b:2",
        ])
        .expect("parse");
        assert_eq!(config.decode, ["http://a:1", "http://b:2"]);
    }

    #[test]
    fn durations_take_units_and_bare_numbers_keep_the_old_flags_unit() {
        let config = serve(&["connex-router", "serve"]).expect("parse");
        assert_eq!(config.stall_timeout, Duration::from_secs(10));
        assert_eq!(config.heartbeat_ttl, Duration::from_secs(10));
        assert_eq!(
            config.responses.store_ttl,
            Duration::from_secs(7 * 24 * 3600)
        );
        let config = serve(&[
            "connex-router",
            "serve",
            "--stall-timeout",
            "250ms",
            "--heartbeat-ttl",
            "1m30s",
            "--shutdown-grace",
            "2h",
        ])
        .expect("parse");
        assert_eq!(config.stall_timeout, Duration::from_millis(250));
        assert_eq!(config.heartbeat_ttl, Duration::from_secs(90));
        assert_eq!(config.shutdown_grace, Duration::from_secs(7200));
        // What a user wrote before durations took units means what it did:
        // the old names, a bare number in the unit the old name said.
        let config = serve(&[
            "connex-router",
            "serve",
            "--stall-timeout-ms",
            "500",
            "--heartbeat-ttl-s",
            "3",
            "--suspect-ms=40",
        ])
        .expect("parse");
        assert_eq!(config.stall_timeout, Duration::from_millis(500));
        assert_eq!(config.heartbeat_ttl, Duration::from_secs(3));
        assert_eq!(config.suspect_for, Duration::from_millis(40));
        for bad in [
            "10 parsecs",
            "ms",
            "5x",
            "-1s",
            "1.5s",
            "99999999999999999999h",
        ] {
            let flag = format!("--stall-timeout={bad}");
            let err = serve(&["connex-router", "serve", &flag]).expect_err("not a duration");
            assert!(err.to_string().contains("is not a duration"), "{err}");
        }
    }

    #[test]
    fn a_file_may_use_the_old_duration_keys_and_units() {
        let dir = std::env::temp_dir().join(format!("connex-config-units-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("router.toml");
        std::fs::write(
            &path,
            "stall_timeout_ms = 750\nresume_wait = \"3s\"\nshutdown_grace_s = 5\n",
        )
        .expect("write config");
        let path = path.to_string_lossy().to_string();
        let config = serve(&["connex-router", "serve", "--config", &path]).expect("parse");
        assert_eq!(config.stall_timeout, Duration::from_millis(750));
        assert_eq!(config.resume_wait, Duration::from_secs(3));
        assert_eq!(config.shutdown_grace, Duration::from_secs(5));
        // The command line still wins over the file, under either name.
        let config = serve(&[
            "connex-router",
            "serve",
            "--config",
            &path,
            "--stall-timeout",
            "1s",
        ])
        .expect("parse");
        assert_eq!(config.stall_timeout, Duration::from_secs(1));
    }

    #[test]
    fn unknown_file_key_is_an_error() {
        let dir = std::env::temp_dir().join(format!("connex-config-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("router.toml");
        std::fs::write(&path, "no_such_setting = 1\n").expect("write config");
        let path = path.to_string_lossy().to_string();
        let err = serve(&["connex-router", "serve", "--config", &path]).expect_err("must fail");
        assert!(matches!(err, ConfigError::UnknownKey(key) if key == "no_such_setting"));
    }
}
