//! The engine's HTTP surface: the vLLM OpenAI subset plus `/mock/stats`.

use crate::config::{CrashAction, MockConfig, Role};
use crate::merge;
use crate::model::{self, ContextHash};
use crate::shape::Shape;
use crate::stats::{Outcome, RequestLog, RequestRecord};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

/// The `system_fingerprint` of the last chunk of a stream and of a whole answer.
const SYSTEM_FINGERPRINT: &str = "fp_connex_mock";

/// Shared state of one engine.
pub struct EngineState {
    pub config: MockConfig,
    pub addr: SocketAddr,
    pub engine_id: String,
    pub log: RequestLog,
    pub inflight: AtomicU64,
    /// `GET /v1/models` calls answered (the router's model list reads them).
    pub model_list_calls: AtomicU64,
    /// Tokens-API calls answered: render and (streaming) derender.
    pub render_calls: AtomicU64,
    pub derender_calls: AtomicU64,
    /// The body of the last render call (what a continuation renders).
    pub last_render: std::sync::Mutex<Option<Value>>,
    /// Prompt KV: held as a prefill, pulled as a decoder (see [`crate::kv`]).
    pub kv: crate::kv::KvState,
    /// Set by [`crate::MockEngine::crash_now`]: the next token of every decode
    /// stream crashes the engine, as a kill would.
    pub crash_now: std::sync::atomic::AtomicBool,
    /// `--prefix-cache-blocks`: the prompt blocks this engine has computed.
    pub prefix: Option<std::sync::Mutex<crate::prefix::PrefixCache>>,
    /// Woken when the prefix cache has events to forward.
    pub events_ready: tokio::sync::Notify,
    /// Woken when the prefix cache has events to publish over ZMQ.
    pub published_ready: tokio::sync::Notify,
    /// Set by `--engine-dead-after-tokens`: the engine core is gone.
    engine_dead: std::sync::atomic::AtomicBool,
    crash: CrashAction,
    shutdown: CancellationToken,
}

impl EngineState {
    pub fn new(
        config: MockConfig,
        addr: SocketAddr,
        crash: CrashAction,
        shutdown: CancellationToken,
        kv: crate::kv::KvState,
    ) -> Self {
        let prefix = (config.prefix_cache_blocks > 0).then(|| {
            std::sync::Mutex::new(crate::prefix::PrefixCache::new(
                config.block_size,
                config.prefix_cache_blocks,
                config.kv_events_publish.is_some(),
            ))
        });
        Self {
            engine_id: format!("mock-{}", uuid::Uuid::new_v4().simple()),
            config,
            addr,
            log: RequestLog::default(),
            inflight: AtomicU64::new(0),
            model_list_calls: AtomicU64::new(0),
            render_calls: AtomicU64::new(0),
            derender_calls: AtomicU64::new(0),
            last_render: std::sync::Mutex::new(None),
            prefix,
            events_ready: tokio::sync::Notify::new(),
            published_ready: tokio::sync::Notify::new(),
            kv,
            crash_now: std::sync::atomic::AtomicBool::new(false),
            engine_dead: std::sync::atomic::AtomicBool::new(false),
            crash,
            shutdown,
        }
    }

    /// Runs a local prefill of `ids` through the prefix cache: the tokens
    /// to compute (all without a cache; at least one, as vLLM recomputes the
    /// last token of a fully cached prompt).
    pub fn tokens_to_compute(&self, ids: &[u32], salt: Option<&str>) -> usize {
        let Some(prefix) = &self.prefix else {
            return ids.len();
        };
        let cached = prefix
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .prefill(ids, salt);
        self.events_ready.notify_one();
        self.published_ready.notify_one();
        ids.len().saturating_sub(cached).max(ids.len().min(1))
    }

    /// Fraction of its KV memory in use, as a vLLM engine reports it: the
    /// held prompt KV against `--hold-budget-bytes` (0 without a budget).
    pub fn kv_usage(&self) -> f64 {
        match self.config.hold_budget_bytes {
            Some(budget) if budget > 0 => {
                (self.kv.stats().held_bytes as f64 / budget as f64).clamp(0.0, 1.0)
            }
            _ => 0.0,
        }
    }

    /// The URL announced to the router.
    pub fn url(&self) -> String {
        self.config
            .advertise_url
            .clone()
            .unwrap_or_else(|| format!("http://{}", self.addr))
    }
}

/// Every route of the engine.
pub fn routes(state: Arc<EngineState>) -> Router {
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route(crate::tokens::RENDER_PATH, post(crate::tokens::render))
        .route(crate::tokens::GENERATE_PATH, post(tokens_generate))
        .route(crate::tokens::DERENDER_PATH, post(crate::tokens::derender))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/mock/stats", get(stats));
    // /tokenize is served with the other non-generation routes (pooling.rs).
    // vLLM takes bodies of any size (a prompt of a million token ids): so
    // does the mock, up to what a router forwards.
    crate::pooling::routes(router)
        .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
        .with_state(state)
}

async fn health(State(state): State<Arc<EngineState>>) -> Response {
    if state.engine_dead.load(Ordering::Relaxed) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine core is dead");
    }
    "ok".into_response()
}

async fn models(State(state): State<Arc<EngineState>>) -> Json<Value> {
    state.model_list_calls.fetch_add(1, Ordering::Relaxed);
    Json(
        json!({"object":"list","data":[{"id":state.config.model,"object":"model","created":0,
            "owned_by":"connex-mock","root":state.config.model,"parent":null,
            "max_model_len":crate::pooling::MAX_MODEL_LEN}]}),
    )
}

async fn stats(State(state): State<Arc<EngineState>>) -> Json<Value> {
    Json(json!({
        "engine_id": state.engine_id,
        "role": state.config.role,
        "ctrl": state.kv.ctrl_addr(),
        "holds": state.kv.stats(),
        "prefix_cache": state.prefix.as_ref().map(|p| {
            let p = p.lock().unwrap_or_else(|e| e.into_inner());
            json!({"blocks": p.len(), "hit_tokens": p.hit_tokens})
        }),
        "requests": state.log.snapshot(),
        "model_list_calls": state.model_list_calls.load(Ordering::Relaxed),
        "render_calls": state.render_calls.load(Ordering::Relaxed),
        "derender_calls": state.derender_calls.load(Ordering::Relaxed),
        "last_render": state.last_render.lock().unwrap_or_else(|e| e.into_inner()).clone(),
    }))
}

async fn completions(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, Kind::Completion, &headers, body).await
}

async fn chat_completions(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, Kind::Chat, &headers, body).await
}

/// `POST /inference/v1/generate`: token ids in, token ids out (streamed).
async fn tokens_generate(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = crate::tokens::refused(&state) {
        return refused;
    }
    generate(state, Kind::Tokens, &headers, body).await
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
    /// vLLM's tokens API (`/inference/v1/generate`).
    Tokens,
}

/// An error answer of `bytes` bytes of `x`, streamed in 64 KiB pieces.
fn huge_body(status: StatusCode, bytes: u64) -> Response {
    const PIECE: u64 = 64 * 1024;
    let piece = Bytes::from(vec![b'x'; PIECE as usize]);
    let pieces = futures_util::stream::unfold(bytes, move |left| {
        let piece = piece.clone();
        async move {
            (left > 0).then(|| {
                let len = left.min(PIECE);
                (
                    Ok::<_, std::convert::Infallible>(piece.slice(..len as usize)),
                    left - len,
                )
            })
        }
    });
    Response::builder()
        .status(status)
        .header("content-type", "text/plain")
        .body(Body::from_stream(pieces))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

pub(crate) fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({"error":{"message":message,"type":"BadRequestError","param":null,"code":status.as_u16()}});
    (status, Json(body)).into_response()
}

/// Prompt token ids of a completions `prompt` (one prompt only).
fn completion_prompt(prompt: &Value) -> Option<Vec<u32>> {
    match prompt {
        Value::String(text) => Some(model::tokenize(text)),
        Value::Array(items) if items.iter().all(Value::is_u64) => items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect(),
        Value::Array(items) if items.len() == 1 => completion_prompt(&items[0]),
        _ => None,
    }
}

/// Everything one generation needs, decided before the first token.
struct Plan {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_ids: Vec<u32>,
    max_tokens: u32,
    /// `--eos-after-tokens`: the token of this run that is the answer's
    /// end-of-sequence token (counted after what a continued answer had).
    eos_at: Option<u32>,
    /// Choices per request (`n`): greedy, so every choice has the same tokens.
    n: usize,
    include_usage: bool,
    return_token_ids: bool,
    /// What the tokens become besides text (logprobs, tool calls, ...).
    shape: Shape,
    /// Set for a prefill request: the params its response carries.
    kv_out: Option<Value>,
    /// Prompt tokens to "compute" (the rest came from a hold).
    computed_prompt: usize,
    /// Decoder: the `kv_transfer_params` to pull the prompt KV with.
    kv_pull: Option<Value>,
    /// Decoder: prompt tokens its prefix cache had (their blocks not pulled).
    cached_prompt: usize,
    /// Decoder: the hold it pulled, released when the request finishes.
    pulled: Option<crate::kv::Pulled>,
}

/// A header's value, when it is text.
pub(crate) fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn generate(
    state: Arc<EngineState>,
    kind: Kind,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    // Off the runtime's workers: parsing (and recording) a body of tens of MB
    // held both of them for seconds under load, and the engine's heartbeats
    // and `/health` answers, which run there too, stopped until the router
    // gave it up as dead.
    let max_recorded = state.config.max_recorded_string;
    let parsed = tokio::task::spawn_blocking(move || {
        serde_json::from_slice::<Value>(&body).map(|request| {
            let recorded = crate::stats::recorded(&request, max_recorded);
            (request, recorded)
        })
    })
    .await;
    let Ok(Ok((request, recorded))) = parsed else {
        return error(StatusCode::BAD_REQUEST, "invalid JSON body");
    };
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let index = state.log.push(
        RequestRecord {
            path: match kind {
                Kind::Completion => "/v1/completions".into(),
                Kind::Chat => "/v1/chat/completions".into(),
                Kind::Tokens => crate::tokens::GENERATE_PATH.into(),
            },
            request_id: request_id.clone(),
            traceparent: header(headers, "traceparent"),
            tracestate: header(headers, "tracestate"),
            body: recorded,
            outcome: Outcome::Running,
            tokens_emitted: 0,
            computed_prompt_tokens: 0,
            pulled_bytes: 0,
        },
        state.config.max_records,
    );
    if state.engine_dead.load(Ordering::Relaxed) {
        state.log.update(index, |r| r.outcome = Outcome::Failed);
        return error(StatusCode::SERVICE_UNAVAILABLE, "engine core is dead");
    }
    if let Some(status) = state.config.fail_status {
        state.log.update(index, |r| r.outcome = Outcome::Failed);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if let Some(bytes) = state.config.fail_body_bytes {
            return huge_body(status, bytes);
        }
        return error(status, "injected failure (--fail-status)");
    }
    if let Some(location) = &state.config.redirect_to {
        state.log.update(index, |r| r.outcome = Outcome::Failed);
        return Response::builder()
            .status(StatusCode::TEMPORARY_REDIRECT)
            .header("location", location.as_str())
            .body(Body::empty())
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    let mut plan = match plan(&state, kind, &request, request_id) {
        Ok(plan) => plan,
        Err(message) => {
            state.log.update(index, |r| r.outcome = Outcome::Failed);
            return error(StatusCode::BAD_REQUEST, message);
        }
    };
    if let Some(params) = &plan.kv_pull {
        match state
            .kv
            .load(params, &plan.prompt_ids, plan.cached_prompt)
            .await
        {
            Ok(pulled) => {
                state.log.update(index, |r| r.pulled_bytes = pulled.bytes);
                plan.pulled = Some(pulled);
            }
            Err(reason) => {
                state.log.update(index, |r| r.outcome = Outcome::Failed);
                let message = format!("kv load failed: {reason}");
                return error(StatusCode::SERVICE_UNAVAILABLE, &message);
            }
        }
    }
    if state.config.hang_before_headers && plan.kv_out.is_none() {
        std::future::pending::<()>().await;
    }
    if let (Some(ctrl), Some(kv)) = (&state.config.answer_remote_ctrl, &mut plan.kv_out) {
        kv["remote_ctrl"] = json!(ctrl);
    }
    state
        .log
        .update(index, |r| r.computed_prompt_tokens = plan.computed_prompt);
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let run = Run::new(state, plan, index);
    if stream {
        let body = futures_util::stream::unfold(run, |mut run| async move {
            run.next_merged().await.map(|event| (event, run))
        });
        Response::builder()
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(Body::from_stream(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    } else {
        Body::from_stream(futures_util::stream::once(run.whole())).into_response_json()
    }
}

trait IntoJsonResponse {
    fn into_response_json(self) -> Response;
}

impl IntoJsonResponse for Body {
    fn into_response_json(self) -> Response {
        Response::builder()
            .header("content-type", "application/json")
            .body(self)
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    }
}

fn plan(
    state: &EngineState,
    kind: Kind,
    request: &Value,
    request_id: Option<String>,
) -> Result<Plan, &'static str> {
    let prompt_ids = match kind {
        Kind::Completion => completion_prompt(request.get("prompt").ok_or("missing prompt")?)
            .ok_or("prompt must be a string or a list of token ids")?,
        Kind::Chat => crate::tokens::chat_prompt(request)?,
        Kind::Tokens => completion_prompt(request.get("token_ids").ok_or("missing token_ids")?)
            .ok_or("token_ids must be a list of token ids")?,
    };
    if kind == Kind::Tokens && request.get("stream").and_then(Value::as_bool) != Some(true) {
        return Err("this mock serves /inference/v1/generate streamed only");
    }
    if prompt_ids.is_empty() {
        // As vLLM refuses it.
        return Err("Either prompt or prompt_embeds must be provided and non-empty.");
    }
    let max_tokens = match kind {
        Kind::Tokens => request
            .pointer("/sampling_params/max_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(16),
        _ => crate::tokens::max_tokens(request),
    };
    let max_tokens = u32::try_from(max_tokens).map_err(|_| "max_tokens too large")?;
    let kv_in = request.get("kv_transfer_params");
    let flag = |key: &str| {
        kv_in
            .and_then(|kv| kv.get(key))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    // A decoder's prompt tokens already in its prefix cache (not pulled).
    let mut cached_prompt = 0;
    let salt = request.get("cache_salt").and_then(Value::as_str);
    let (kv_out, computed_prompt) = if flag("do_remote_decode") {
        if state.config.role == Role::Decode {
            return Err("this engine is a decoder and cannot prefill for remote decode");
        }
        let params = state
            .kv
            .hold(&prompt_ids, &state.engine_id)
            .map_err(|err| {
                tracing::warn!(%err, "could not hold the prompt KV");
                "could not hold the prompt KV"
            })?;
        (Some(params), state.tokens_to_compute(&prompt_ids, salt))
    } else if flag("do_remote_prefill") {
        let remote = kv_in
            .and_then(|kv| kv.get("remote_num_tokens"))
            .and_then(Value::as_u64)
            .ok_or("kv_transfer_params.remote_num_tokens missing")?;
        let remote = usize::try_from(remote).map_err(|_| "remote_num_tokens too large")?;
        // The pulled prompt's blocks land in this decoder's prefix cache (and
        // are reported), as vLLM caches a loaded prompt's full blocks.
        cached_prompt = prompt_ids.len() - state.tokens_to_compute(&prompt_ids, salt);
        (None, prompt_ids.len().saturating_sub(remote))
    } else {
        (None, state.tokens_to_compute(&prompt_ids, salt))
    };
    let kv_pull = (flag("do_remote_prefill") && !flag("do_remote_decode"))
        .then(|| kv_in.cloned())
        .flatten();
    // A continuation's prompt is the held prompt and the answer so far.
    let answered = match &kv_pull {
        Some(kv) => kv
            .get("remote_num_tokens")
            .and_then(Value::as_u64)
            .map_or(0, |held| (prompt_ids.len() as u64).saturating_sub(held)),
        None => 0,
    };
    let eos = state.config.eos_after_tokens.filter(|_| kv_out.is_none());
    let eos_at = eos.map(|n| {
        u32::try_from(u64::from(n).saturating_sub(answered))
            .unwrap_or(0)
            .max(1)
    });
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
        Kind::Tokens => "generate-tokens",
    };
    let suffix = request_id.unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    Ok(Plan {
        kind,
        id: format!("{prefix}-{suffix}"),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: state.config.model.clone(),
        shape: Shape::new(
            kind == Kind::Chat,
            request,
            &prompt_ids,
            if kv_out.is_some() { 1 } else { max_tokens },
            eos,
        ),
        eos_at,
        max_tokens: if kv_out.is_some() { 1 } else { max_tokens },
        n: request
            .get("n")
            .and_then(Value::as_u64)
            .map_or(1, |n| n.clamp(1, 128) as usize),
        prompt_ids,
        include_usage: request
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        return_token_ids: request
            .get("return_token_ids")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        kv_out,
        computed_prompt,
        cached_prompt,
        kv_pull,
        pulled: None,
    })
}

/// Why a run stopped producing tokens early.
#[derive(Debug)]
struct Crashed;

impl std::fmt::Display for Crashed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mock engine crashed (fault injection)")
    }
}

impl std::error::Error for Crashed {}

/// One generation in progress. Its drop marks the record aborted when the
/// client left before the end.
struct Run {
    state: Arc<EngineState>,
    plan: Plan,
    record: Option<usize>,
    context: ContextHash,
    emitted: Vec<u32>,
    /// Text of a split token (see [`model::is_split`]) not sent yet.
    held_text: String,
    started: bool,
    finished: bool,
    sent_done: bool,
    /// `--bad-chunk-after-tokens` sent its chunk.
    sent_bad: bool,
    /// The event that ended a merge, sent next.
    after_merge: Option<Result<Bytes, Crashed>>,
}

impl Run {
    fn new(state: Arc<EngineState>, plan: Plan, record: Option<usize>) -> Self {
        state.inflight.fetch_add(1, Ordering::Relaxed);
        let context = ContextHash::of(&plan.prompt_ids);
        Self {
            state,
            plan,
            record,
            context,
            emitted: Vec::new(),
            held_text: String::new(),
            started: false,
            finished: false,
            sent_done: false,
            sent_bad: false,
            after_merge: None,
        }
    }

    /// Produces the next token, applying the prefill cost and the faults.
    async fn next_token(&mut self) -> Result<Option<u32>, Crashed> {
        let config = &self.state.config;
        if !self.started {
            self.started = true;
            let cost = config
                .prefill_us_per_token
                .saturating_mul(self.plan.computed_prompt as u64);
            if cost > 0 {
                tokio::time::sleep(Duration::from_micros(cost)).await;
            }
        }
        let count = self.emitted.len() as u32;
        if count >= self.plan.max_tokens || self.plan.eos_at.is_some_and(|at| count >= at) {
            return Ok(None);
        }
        // The decode step's time passes first, so that the previous token is on
        // the wire when a fault below hits.
        if config.decode_us_per_token > 0 && !self.emitted.is_empty() {
            tokio::time::sleep(Duration::from_micros(config.decode_us_per_token)).await;
        }
        let crash = config.crash_after_tokens == Some(count)
            || self.state.crash_now.load(Ordering::Relaxed);
        if crash && self.plan.kv_out.is_none() {
            match self.state.crash {
                CrashAction::ExitProcess => {
                    eprintln!(
                        "connex-mock-engine: crashing after {count} tokens (--crash-after-tokens)"
                    );
                    std::process::exit(137);
                }
                CrashAction::StopServing => {
                    self.state.shutdown.cancel();
                    return Err(Crashed);
                }
            }
        }
        if config.engine_dead_after_tokens == Some(count) && self.plan.kv_out.is_none() {
            self.state.engine_dead.store(true, Ordering::Relaxed);
        }
        let engine_dead = self.state.engine_dead.load(Ordering::Relaxed);
        if engine_dead || config.stall_after_tokens == Some(count) && self.plan.kv_out.is_none() {
            std::future::pending::<()>().await;
        }
        let token = match self.plan.eos_at == Some(count + 1) {
            true => model::EOS_ID,
            false => self.context.next_token(),
        };
        self.context.absorb(token);
        self.emitted.push(token);
        let emitted = self.emitted.len() as u32;
        self.state
            .log
            .update(self.record, |r| r.tokens_emitted = emitted);
        Ok(Some(token))
    }

    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            // As the connector: a router that continues several choices
            // from one hold releases it itself.
            let keep = self
                .plan
                .kv_pull
                .as_ref()
                .and_then(|kv| kv.get("release_on_finish"))
                == Some(&Value::Bool(false));
            if let (Some(pulled), false) = (&self.plan.pulled, keep) {
                self.state.kv.release_later(pulled);
            }
            self.state
                .log
                .update(self.record, |r| r.outcome = Outcome::Completed);
        }
    }

    /// Whether the last token emitted is the answer's end-of-sequence token.
    fn ended_at_eos(&self) -> bool {
        self.plan.eos_at == Some(self.emitted.len() as u32)
    }

    fn usage(&self) -> Value {
        let prompt = self.plan.prompt_ids.len();
        let completion = self.emitted.len() * self.plan.n;
        json!({"prompt_tokens":prompt,"completion_tokens":completion,"total_tokens":prompt+completion})
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.plan.kind, stream) {
            (Kind::Completion | Kind::Tokens, _) => "text_completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
        }
    }

    /// The end that `--truncate-after-tokens` or `--error-after-tokens` puts on a
    /// decode stream at this point, if any: `Some(None)` ends the body cleanly
    /// without a finish_reason, `Some(Some(event))` sends an error event first.
    fn injected_end(&self) -> Option<Option<Bytes>> {
        let config = &self.state.config;
        let count = Some(self.emitted.len() as u32);
        if self.plan.kv_out.is_some() {
            return None;
        }
        if config.truncate_after_tokens == count {
            return Some(None);
        }
        if config.finish_error_after_tokens == count {
            // vLLM's way of failing a request it could not run: a last chunk with
            // finish_reason "error", then the usual end.
            let chunk = json!({"id":self.plan.id,"object":self.object(true),"created":self.plan.created,
                "model":self.plan.model,"choices":self.choices(json!({"index":0,"text":"","logprobs":null,
                "finish_reason":"error","stop_reason":null}))});
            return Some(Some(Bytes::from(format!(
                "data: {chunk}\n\ndata: [DONE]\n\n"
            ))));
        }
        if config.error_after_tokens == count {
            let error = json!({"error":{"message":"injected engine error (--error-after-tokens)",
                "type":"InternalServerError","param":null,"code":500}});
            return Some(Some(Bytes::from(format!("data: {error}\n\n"))));
        }
        None
    }

    /// The next SSE event of a streaming response, with up to
    /// `--tokens-per-chunk` token chunks merged into one.
    async fn next_merged(&mut self) -> Option<Result<Bytes, Crashed>> {
        if let Some(event) = self.after_merge.take() {
            return Some(event);
        }
        let first = self.next_event().await?;
        let per_chunk = self.state.config.tokens_per_chunk;
        if per_chunk <= 1 || self.plan.kv_out.is_some() {
            return Some(first);
        }
        let Some(mut merged) = first.as_ref().ok().and_then(|e| merge::token_chunk(e)) else {
            return Some(first);
        };
        for _ in 1..per_chunk {
            match self.next_event().await {
                Some(Ok(event)) => match merge::token_chunk(&event) {
                    Some(next) => merge::join(&mut merged, &next),
                    None => {
                        self.after_merge = Some(Ok(event));
                        break;
                    }
                },
                Some(Err(crashed)) => {
                    self.after_merge = Some(Err(crashed));
                    break;
                }
                None => break,
            }
        }
        Some(Ok(Bytes::from(sse_event(&merged))))
    }

    /// The next SSE event of a streaming response.
    async fn next_event(&mut self) -> Option<Result<Bytes, Crashed>> {
        if self.sent_done {
            return None;
        }
        let count = Some(self.emitted.len() as u32);
        if self.plan.kv_out.is_none() && self.state.config.trickle_after_tokens == count {
            // One byte of an event that never ends, now and then.
            tokio::time::sleep(Duration::from_millis(100)).await;
            return Some(Ok(Bytes::from_static(b"d")));
        }
        if self.plan.kv_out.is_none()
            && self.state.config.bad_chunk_after_tokens == count
            && !self.sent_bad
        {
            self.sent_bad = true;
            let chunk = json!({"id":self.plan.id,"object":self.object(true),"created":self.plan.created,
                "model":self.plan.model,"choices":[{"index":7,"text":" evil","logprobs":null,
                "finish_reason":null,"stop_reason":null,"token_ids":[99]}]});
            return Some(Ok(Bytes::from(sse_event(&chunk))));
        }
        if self.finished {
            self.sent_done = true;
            return Some(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
        }
        if self.plan.kv_out.is_none() && self.state.config.text_flood_after_tokens == count {
            let text = "x".repeat(512 * 1024);
            let chunk = json!({"id":self.plan.id,"object":self.object(true),"created":self.plan.created,
                "model":self.plan.model,"choices":[{"index":0,"text":text,"logprobs":null,
                "finish_reason":null,"stop_reason":null}]});
            return Some(Ok(Bytes::from(sse_event(&chunk))));
        }
        if let Some(end) = self.injected_end() {
            self.sent_done = true;
            return end.map(Ok);
        }
        let first = !self.started;
        let token = match self.next_token().await {
            Ok(Some(token)) => token,
            Ok(None) => {
                // max_tokens 0: nothing to emit but the end.
                self.finish();
                return Some(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
            }
            Err(crashed) => return Some(Err(crashed)),
        };
        let generated = self.emitted.len();
        let eos = self.ended_at_eos();
        let last = generated as u32 >= self.plan.max_tokens || eos;
        let finish_reason = if last {
            json!(self.plan.shape.finish_reason(generated, eos))
        } else {
            Value::Null
        };
        // A split token's text goes out with the next token's, as vLLM's
        // detokenizer holds back an incomplete character.
        let mut text = std::mem::take(&mut self.held_text) + &model::token_text(token);
        if model::is_split(token) && !last && self.plan.shape.is_plain() {
            self.held_text = std::mem::take(&mut text);
        }
        if self.plan.kind == Kind::Tokens {
            return Some(Ok(Bytes::from(self.tokens_event(
                token,
                finish_reason,
                last,
            ))));
        }
        let mut choice = self.plan.shape.stream_choice(
            generated - 1,
            token,
            text,
            &self.emitted[..generated - 1],
        );
        choice["index"] = json!(0);
        choice["finish_reason"] = finish_reason;
        choice["stop_reason"] = Value::Null;
        let mut chunk = json!({"id":self.plan.id,"object":self.object(true),"created":self.plan.created,"model":self.plan.model});
        if self.plan.return_token_ids {
            choice["token_ids"] = json!([token]);
            if first {
                match self.plan.kind {
                    Kind::Completion => choice["prompt_token_ids"] = json!(self.plan.prompt_ids),
                    Kind::Chat | Kind::Tokens => {
                        chunk["prompt_token_ids"] = json!(self.plan.prompt_ids)
                    }
                }
            }
        }
        if last {
            chunk["system_fingerprint"] = json!(SYSTEM_FINGERPRINT);
        }
        // One event per choice, as vLLM streams a request of several.
        let mut out = Vec::new();
        if let Value::Array(choices) = self.choices(choice) {
            for choice in choices {
                chunk["choices"] = json!([choice]);
                out.extend_from_slice(&sse_event(&chunk));
            }
        }
        if last {
            self.finish();
            if self.plan.include_usage {
                let usage = json!({"id":self.plan.id,"object":self.object(true),"created":self.plan.created,"model":self.plan.model,"choices":[],"usage":self.usage()});
                out.extend_from_slice(&sse_event(&usage));
            }
        }
        Some(Ok(Bytes::from(out)))
    }

    /// The event of one token of a `/inference/v1/generate` stream, as vLLM
    /// sends it (with the usage chunk after the last, when asked for).
    fn tokens_event(&mut self, token: u32, finish_reason: Value, last: bool) -> Vec<u8> {
        let chunk = json!({"request_id": self.plan.id, "choices": [{"index": 0,
            "finish_reason": finish_reason, "stop_reason": null, "token_ids": [token],
            "logprobs": null, "routed_experts": null}]});
        let mut out = sse_event(&chunk);
        if last {
            self.finish();
            if self.plan.include_usage {
                let usage =
                    json!({"request_id": self.plan.id, "choices": [], "usage": self.usage()});
                out.extend_from_slice(&sse_event(&usage));
            }
        }
        out
    }

    /// The whole non-streaming response body.
    async fn whole(mut self) -> Result<Bytes, Crashed> {
        let mut stopped = None;
        while self.next_token().await?.is_some() {
            stopped = self.plan.shape.stop_in(&self.emitted);
            if stopped.is_some() {
                break;
            }
        }
        self.finish();
        let mut choice = self.plan.shape.whole_choice(&self.emitted);
        let eos = self.ended_at_eos();
        choice["finish_reason"] = json!(self.plan.shape.finish_reason(self.emitted.len(), eos));
        choice["stop_reason"] = Value::Null;
        if let Some((stop, end)) = stopped {
            self.plan.shape.cut(&mut choice, end);
            choice["finish_reason"] = json!("stop");
            choice["stop_reason"] = json!(stop);
        }
        choice["token_ids"] = Value::Null;
        // What vLLM's non-stream answer carries, null when not asked for.
        choice["routed_experts"] = Value::Null;
        // A non-stream answer lists its null details; the stream's usage
        // leaves them out (vLLM serializes it without nulls).
        let mut usage = self.usage();
        usage["prompt_tokens_details"] = Value::Null;
        usage["completion_tokens_details"] = Value::Null;
        let mut response = json!({"id":self.plan.id,"object":self.object(false),"created":self.plan.created,
            "model":self.plan.model,"service_tier":null,"system_fingerprint":SYSTEM_FINGERPRINT,
            "usage":usage,"kv_transfer_params":self.plan.kv_out,"ec_transfer_params":null,
            "metrics":null});
        match self.plan.kind {
            Kind::Completion => choice["prompt_token_ids"] = Value::Null,
            Kind::Chat | Kind::Tokens => {
                response["prompt_logprobs"] = Value::Null;
                response["prompt_token_ids"] = Value::Null;
                response["prompt_text"] = Value::Null;
            }
        }
        if self.plan.return_token_ids {
            choice["token_ids"] = json!(self.emitted);
            match self.plan.kind {
                Kind::Completion => choice["prompt_token_ids"] = json!(self.plan.prompt_ids),
                Kind::Chat | Kind::Tokens => {
                    response["prompt_token_ids"] = json!(self.plan.prompt_ids)
                }
            }
        }
        response["choices"] = self.choices(choice);
        Ok(Bytes::from(response.to_string()))
    }

    /// `choice` once per requested choice, with its index.
    fn choices(&self, choice: Value) -> Value {
        (0..self.plan.n)
            .map(|index| {
                let mut choice = choice.clone();
                choice["index"] = json!(index);
                choice
            })
            .collect()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.state.inflight.fetch_sub(1, Ordering::Relaxed);
        if !self.finished {
            self.state.log.update(self.record, |r| {
                if r.outcome == Outcome::Running {
                    r.outcome = Outcome::Aborted;
                }
            });
        }
    }
}

/// One SSE event whose data is `value` (serialized straight into the
/// buffer: `format!` would go through `Display`, a byte at a time).
fn sse_event(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(b"data: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, value);
    out.extend_from_slice(b"\n\n");
    out
}
