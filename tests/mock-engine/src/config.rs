//! Command-line configuration of the mock engine, with its fault switches.

use clap::{Parser, ValueEnum};
use connex_transfer::{BackendKind, ReleaseMode};
use std::net::SocketAddr;

/// Which half of P/D an engine serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

/// What a crash fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashAction {
    /// Exit the process (the standalone binary): the closest thing to a SIGKILL.
    ExitProcess,
    /// Cut every connection and stop serving (an engine inside another process,
    /// as in the demo).
    StopServing,
}

/// `connex-mock-engine` flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "connex-mock-engine",
    about = "Deterministic mock of the vLLM OpenAI API for Connex"
)]
pub struct MockConfig {
    /// Address to listen on (port 0 picks a free one; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Role announced to the router.
    #[arg(long, value_enum, default_value = "both")]
    pub role: Role,
    /// Model name served.
    #[arg(long, default_value = "mock")]
    pub model: String,
    /// Router to register with, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub router: Option<String>,
    /// Instance id to register under (the router assigns one when absent).
    #[arg(long)]
    pub id: Option<String>,
    /// URL announced to the router (default: http://<bound address>).
    #[arg(long)]
    pub advertise_url: Option<String>,
    /// Bearer token sent with registration calls.
    #[arg(long)]
    pub register_token: Option<String>,
    /// File keeping the instance credential the router issued, so that a
    /// restarted engine re-registers its id at once (as an agent that kept it).
    #[arg(long)]
    pub credential_file: Option<std::path::PathBuf>,
    /// Answer like a model: each answer ends at an end-of-sequence token, its
    /// Nth (counted over the whole answer, a resumed one's continuation
    /// included), with `finish_reason: "stop"` (`"tool_calls"` on the chat
    /// route once it called a tool, as vLLM's), when `max_tokens` does not
    /// end it first. A chat whose last message is a tool's result is then
    /// answered in text (the model read the result), not with another call.
    #[arg(long)]
    pub eos_after_tokens: Option<u32>,
    /// Exit the process after emitting this many tokens of one request.
    #[arg(long)]
    pub crash_after_tokens: Option<u32>,
    /// Stop emitting (but keep the connection open) after this many tokens.
    #[arg(long)]
    pub stall_after_tokens: Option<u32>,
    /// The engine core dies after this many tokens of a decode stream, while the
    /// API server and its heartbeats live on: every stream stops emitting,
    /// `/health` and new requests answer 503 (as vLLM's do once its engine core
    /// is gone).
    #[arg(long)]
    pub engine_dead_after_tokens: Option<u32>,
    /// End each decode stream cleanly, without a finish_reason or `[DONE]`, after
    /// this many tokens.
    #[arg(long)]
    pub truncate_after_tokens: Option<u32>,
    /// Send an error event (code 500) and end each decode stream after this many
    /// tokens, as vLLM does when its engine fails mid-request.
    #[arg(long)]
    pub error_after_tokens: Option<u32>,
    /// Finish each decode stream with finish_reason "error" after this many
    /// tokens, as vLLM does for a request it could not run.
    #[arg(long)]
    pub finish_error_after_tokens: Option<u32>,
    /// Answer every generation request with this HTTP status.
    #[arg(long)]
    pub fail_status: Option<u16>,
    /// With --fail-status: the error body is this many bytes (streamed, never
    /// held in memory), to prove the router reads error bodies bounded.
    #[arg(long)]
    pub fail_body_bytes: Option<u64>,
    /// Answer generation requests with a 307 redirect to this URL.
    #[arg(long)]
    pub redirect_to: Option<String>,
    /// A decoder that accepts decode requests and never answers them (no
    /// response headers, ever).
    #[arg(long)]
    pub hang_before_headers: bool,
    /// After this many tokens, each decode stream trickles one byte of an
    /// event that never completes every 100 ms.
    #[arg(long)]
    pub trickle_after_tokens: Option<u32>,
    /// After this many tokens, each decode stream sends one chunk for choice
    /// index 7 (text " evil"), then goes on: a protocol violation.
    #[arg(long)]
    pub bad_chunk_after_tokens: Option<u32>,
    /// After this many tokens, each decode stream sends chunks of 512 KiB of
    /// text without token ids, without end (a decoder flooding its router).
    #[arg(long)]
    pub text_flood_after_tokens: Option<u32>,
    /// Writes the model's tokenizer (a Hugging Face tokenizer.json, for a
    /// router's `--tokenizer mock=PATH`) to this path and exits.
    #[arg(long)]
    pub write_tokenizer: Option<std::path::PathBuf>,
    /// Decode streams merge up to this many token chunks into one, as vLLM's
    /// API server does when it lags behind its engine.
    #[arg(long, default_value_t = 1)]
    pub tokens_per_chunk: usize,
    /// Serve vLLM's tokens API for routers (`/v1/chat/completions/render`,
    /// `/inference/v1/generate`, `/v1/chat/completions/derender`), as vLLM
    /// does only when started with `--enable-scale-out` (403 otherwise).
    #[arg(long)]
    pub enable_scale_out: bool,
    /// A prefill whose answers name this holder (`remote_ctrl`) instead of its
    /// own: a lying or compromised prefill.
    #[arg(long)]
    pub answer_remote_ctrl: Option<String>,
    /// Requests added to the `waiting` count this engine reports with its
    /// heartbeats: load from elsewhere (other routers' requests), so that a
    /// test can show a router steering around a busy engine.
    #[arg(long, default_value_t = 0)]
    pub report_waiting: u32,
    /// Prefix cache of this many full prompt blocks (0: none): a prefill
    /// computes (and pays --prefill-us-per-token for) only the tokens past
    /// the cached prefix, and the engine reports the blocks it stores and
    /// evicts to the router as KV events, as vLLM's agent forwards them.
    #[arg(long, default_value_t = 0)]
    pub prefix_cache_blocks: usize,
    /// Report the prefix cache's KV events to the router (`--kv-events
    /// false`: a cache the router must guess, as with an engine whose events
    /// are off).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub kv_events: bool,
    /// Also publish the prefix cache's KV events on this ZMQ endpoint (e.g.
    /// `tcp://127.0.0.1:5557`), in vLLM's wire format, as an engine started
    /// with `--kv-events-config '{"publisher": "zmq", ...}'` does: what
    /// vllm-router's `kv_aware` (`--pd-kv-events URL=ENDPOINT`) reads. Port 0
    /// picks a free one (printed).
    #[arg(long)]
    pub kv_events_publish: Option<String>,
    /// Tokens per KV block (vLLM's default is 16).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Simulated prefill cost per prompt token computed, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub prefill_us_per_token: u64,
    /// Simulated decode cost per generated token, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub decode_us_per_token: u64,
    /// Seconds a prefill's hold is kept (announced as `lease_s`).
    #[arg(long, default_value_t = 60)]
    pub retain_s: u64,
    /// Keep at most this many request records for /mock/stats.
    #[arg(long, default_value_t = 10_000)]
    pub max_records: usize,
    /// Record strings of a request body longer than this many bytes as
    /// `"<N bytes>"` (default: whole).
    #[arg(long)]
    pub max_recorded_string: Option<usize>,
    /// Bytes of KV per prompt token held by a prefill and pulled by a decoder.
    #[arg(long, default_value_t = 64)]
    pub kv_bytes_per_token: usize,
    /// When a hold is freed besides expiry: on_release | after_pull.
    #[arg(long, default_value = "on_release")]
    pub hold_release: ReleaseMode,
    /// Evict the oldest holds to keep held KV under this many bytes.
    #[arg(long)]
    pub hold_budget_bytes: Option<u64>,
    /// Most control connections the KV holder accepts from one IP address
    /// (connex-transfer's default 512). On one host every reader is
    /// 127.0.0.1: a benchmark with thousands of pulls at once raises it.
    #[arg(long, default_value_t = 512)]
    pub holder_max_connections_per_peer: usize,
    /// Port of the KV holder's control listener (what vLLM's `kv_port` is to
    /// the connector: TP rank 0's), on the engine's listen address; 0: any
    /// free port.
    #[arg(long, default_value_t = 0)]
    pub kv_port: u16,
    /// Transport for KV pulls: tcp | ucx | mooncake (the last two need the
    /// cargo features of connex-transfer).
    #[arg(long, default_value = "tcp")]
    pub transfer_backend: BackendKind,
    /// Secret of the holder's control listener, also sent by this engine's
    /// reader (the same for every engine and the router).
    #[arg(long, env = "CONNEX_TRANSFER_SECRET", hide_env_values = true)]
    pub transfer_secret: Option<String>,
}

impl MockConfig {
    /// Defaults for an engine of `role` serving `model`, registering with `router`.
    pub fn new(role: Role, model: &str, router: Option<String>) -> Self {
        let mut config = Self::parse_from(["connex-mock-engine"]);
        config.role = role;
        config.model = model.to_string();
        config.router = router;
        config
    }
}
