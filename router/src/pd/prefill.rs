//! Phase 1: prefill. The prompt runs on a prefill instance with `max_tokens: 1`
//! and `do_remote_decode`; its answer carries the hold (`kv_transfer_params`) and
//! the prompt token ids. A connect error, 5xx or unusable answer is retried once
//! elsewhere.

use super::deps::FlowDeps;
use super::upstream::{Call, CallError, Payload, Reply};
use crate::error::ApiError;
use crate::membership::{Instance, Pick};
use crate::pd::holds::Hold;
use crate::prefix::hash::Prompt;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::patch::{Patch, Set};
use crate::protocols::openai::request::{RequestInfo, Route};
use serde_json::{json, Value};
use tracing::Instrument;

/// What a successful prefill hands to decode.
#[derive(Debug, Clone)]
pub struct Prefilled {
    pub instance: String,
    pub kv_transfer_params: Value,
    pub prompt_token_ids: Vec<u32>,
    /// The prompt's logprobs, when the request asked for them (`prompt_logprobs`,
    /// or completions `echo` with `logprobs`): vLLM computes them on the prefill
    /// as it would alone, and cannot stream them from the decoder.
    pub prompt_logprobs: Option<Value>,
}

/// The body sent to a prefill instance.
pub fn prefill_body(route: Route, body: &ClientBody) -> Payload {
    let mut patch = Patch::new(
        body,
        &["stream_options", "min_tokens", "min_completion_tokens"],
    )
    .value("stream", Value::Bool(false))
    .value("max_tokens", json!(1));
    if route == Route::Chat || body.get("max_completion_tokens").is_some() {
        patch = patch.value("max_completion_tokens", json!(1));
    }
    patch
        .value("return_token_ids", Value::Bool(true))
        .value("n", json!(1))
        .value(
            "kv_transfer_params",
            json!({"do_remote_decode": true, "do_remote_prefill": false}),
        )
        .to_payload()
}

/// The prefill of a re-prefill: the client's own route and body before the
/// first token, else completions on prompt + generated (the continuation).
pub fn continuation_body(
    route: Route,
    body: &ClientBody,
    prompt_token_ids: &[u32],
    generated: &[u32],
) -> (Route, Payload) {
    if generated.is_empty() {
        return (route, prefill_body(route, body));
    }
    let mut remove: Vec<&str> = vec![
        "stream_options",
        "min_tokens",
        "min_completion_tokens",
        "echo",
    ];
    if route == Route::Chat {
        remove.extend_from_slice(super::resume::CHAT_ONLY);
    }
    let payload = Patch::new(body, &remove)
        .set("prompt", Set::Ids(prompt_token_ids, generated))
        .value("stream", Value::Bool(false))
        .value("max_tokens", json!(1))
        .value("return_token_ids", Value::Bool(true))
        .value("n", json!(1))
        .value(
            "kv_transfer_params",
            json!({"do_remote_decode": true, "do_remote_prefill": false}),
        )
        .to_payload();
    (Route::Completions, payload)
}

/// Runs prefill (the client's `route` on `body`), retrying once on another
/// instance after a failure of the instance (connect error, 5xx, an invalid
/// answer, a `remote_ctrl` that is not its registered control address).
///
/// `prompt`: the prompt's token ids when the policy reads them (`cache_aware`).
pub async fn run(
    deps: &FlowDeps,
    info: &RequestInfo,
    route: Route,
    payload: Payload,
    prompt: Option<&[u32]>,
) -> Result<Prefilled, ApiError> {
    let mut tried: Vec<String> = Vec::new();
    let mut last_error = None;
    for attempt in 0..2 {
        let candidates = deps.registry.eligible(&info.model, Pick::Prefill);
        // The prompt under its `cache_salt`: only its own salt's prefixes match.
        let salted = prompt.map(|ids| Prompt::new(ids, info.cache_root));
        let Some(decision) = deps.prefill.select_for(&candidates, &tried, salted) else {
            break;
        };
        if let Some(reason) = decision.reason {
            crate::observe::metrics::routing_decision(
                "prefill",
                reason.as_str(),
                decision.hit_tokens,
            );
        }
        let instance = decision.instance;
        if attempt > 0 {
            crate::observe::metrics::prefill_retry();
            tracing::warn!(instance = %instance.id, "retrying prefill on another instance");
        }
        tried.push(instance.id.clone());
        let _load = crate::membership::LoadGuard::new(instance.clone());
        crate::observe::metrics::upstream_request(&instance.id, &instance.model, "prefill");
        let bad_gateway = |message: String| ApiError::BadGateway {
            instance: instance.id.clone(),
            message,
        };
        let called = std::time::Instant::now();
        // The prefill continues the request's trace from this span.
        let span = tracing::info_span!("prefill", instance = %instance.id);
        let call = call_owning_the_hold(deps, &instance.url, route, info, payload.clone());
        let reply = match call.instrument(span).await {
            Ok(reply) => reply,
            Err(err) => {
                let kind = match err {
                    CallError::Connect { .. } => "connect",
                    CallError::NoHeaders(_) => "timeout",
                    CallError::TooLarge(_) => "too_large",
                    CallError::Transport(_) => "body",
                };
                crate::observe::metrics::upstream_error(
                    &instance.id,
                    &instance.model,
                    "prefill",
                    kind,
                );
                tracing::warn!(instance = %instance.id, error = %err, "prefill failed");
                last_error = Some(bad_gateway(err.to_string()));
                continue;
            }
        };
        // A redirect is not followed: like a 5xx, this prefill failed.
        if reply.status >= 500 || reply.status < 200 || (300..400).contains(&reply.status) {
            crate::observe::metrics::upstream_error(
                &instance.id,
                &instance.model,
                "prefill",
                "5xx",
            );
            let error = ApiError::upstream(reply.status, &reply.body);
            tracing::warn!(instance = %instance.id, status = reply.status, %error, "prefill failed");
            last_error = Some(bad_gateway(format!("HTTP {}: {error}", reply.status)));
            continue;
        }
        if !(200..300).contains(&reply.status) {
            crate::observe::metrics::upstream_error(
                &instance.id,
                &instance.model,
                "prefill",
                "4xx",
            );
            return Err(ApiError::upstream(reply.status, &reply.body));
        }
        match parse_answer(route, &instance, &reply.body) {
            Ok(prefilled) => {
                crate::observe::metrics::prefill_duration(
                    &instance.id,
                    &instance.model,
                    called.elapsed(),
                );
                if deps.prefill.wants_prompt() {
                    instance.remember_prompt(
                        Prompt::new(&prefilled.prompt_token_ids, info.cache_root),
                        deps.routing.kv_block_size,
                        deps.routing.prefix_index_blocks,
                    );
                }
                return Ok(prefilled);
            }
            Err(invalid) => {
                crate::observe::metrics::upstream_error(
                    &instance.id,
                    &instance.model,
                    "prefill",
                    invalid.kind(),
                );
                tracing::warn!(instance = %instance.id, %invalid, "prefill answer refused");
                last_error = Some(bad_gateway(invalid.to_string()));
            }
        }
    }
    Err(last_error.unwrap_or_else(|| {
        ApiError::Unavailable(format!(
            "no prefill instance is ready for model `{}`",
            info.model
        ))
    }))
}

/// Runs one prefill call on its own task, so that it completes even when the
/// request is dropped meanwhile (its client went away): the hold the prefill
/// made is then released at once instead of waiting for its lease to lapse.
async fn call_owning_the_hold(
    deps: &FlowDeps,
    url: &str,
    route: Route,
    info: &RequestInfo,
    payload: Payload,
) -> Result<Reply, CallError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (upstream, holds) = (deps.upstream.clone(), deps.holds.clone());
    let (url, request_id) = (url.to_string(), info.request_id.clone());
    let span = tracing::Span::current();
    let trace = crate::observe::traces::headers(&span);
    tokio::spawn({
        let holds = holds.clone();
        async move {
            let call = Call {
                url: &url,
                path: route.path(),
                request_id: &request_id,
                trace,
                body: payload,
            };
            let reply = upstream.answer(call).await;
            // The request went away before the answer came.
            if let Err(Ok(abandoned)) = tx.send(reply) {
                release_abandoned(&holds, &abandoned);
            }
        }
        .instrument(span)
    });
    // The request may also go away after the answer was sent but before it
    // was read: the answer then still sits in the channel.
    let mut pending = PendingAnswer { rx, holds };
    (&mut pending.rx).await.unwrap_or_else(|_| {
        Err(CallError::Transport(
            "the prefill call was cancelled".into(),
        ))
    })
}

/// The receiving end of a prefill call; an answer left unread when it drops is
/// abandoned (see [`release_abandoned`]).
struct PendingAnswer {
    rx: tokio::sync::oneshot::Receiver<Result<Reply, CallError>>,
    holds: crate::pd::holds::Holds,
}

impl Drop for PendingAnswer {
    fn drop(&mut self) {
        if let Ok(Ok(abandoned)) = self.rx.try_recv() {
            release_abandoned(&self.holds, &abandoned);
        }
    }
}

/// Releases the hold of a prefill answer nobody will use: a lease dropped at
/// once, so the keeper releases it.
fn release_abandoned(holds: &crate::pd::holds::Holds, abandoned: &Reply) {
    let hold = serde_json::from_slice::<Value>(&abandoned.body)
        .ok()
        .and_then(|answer| Hold::from_params(answer.get("kv_transfer_params")?));
    if let Some(hold) = hold {
        drop(holds.lease(hold, 0));
    }
}

/// The part of a prefill answer the router reads.
#[derive(serde::Deserialize)]
struct PrefillAnswer<'a> {
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a serde_json::value::RawValue>,
    /// Chat puts the prompt ids (and logprobs) at the top level...
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    prompt_logprobs: Option<Value>,
    /// ...completions in the choice.
    #[serde(default)]
    choices: Vec<AnswerChoice>,
}

#[derive(serde::Deserialize)]
struct AnswerChoice {
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    prompt_logprobs: Option<Value>,
}

/// Why a prefill answer cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidAnswer {
    #[error("prefill answered invalid JSON")]
    Json,
    #[error("prefill answered without kv_transfer_params (is its KV connector configured?)")]
    NoParams,
    #[error("prefill answered invalid kv_transfer_params: {0}")]
    BadParams(&'static str),
    #[error("prefill answered without prompt_token_ids")]
    NoPromptIds,
    #[error("prefill named a holder ({answered}) that is not its registered ctrl ({registered})")]
    ForeignCtrl {
        answered: String,
        registered: String,
    },
}

impl InvalidAnswer {
    /// The `kind` label of `connex_upstream_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            InvalidAnswer::ForeignCtrl { .. } => "foreign_ctrl",
            _ => "invalid_answer",
        }
    }
}

/// Reads the hold and the prompt ids out of a prefill answer, and checks them:
/// the router passes these params to decoders and to its own hold calls, so a
/// prefill is not trusted on its word. Its `remote_ctrl` must be the control
/// address it registered.
pub fn parse_answer(
    route: Route,
    instance: &Instance,
    bytes: &[u8],
) -> Result<Prefilled, InvalidAnswer> {
    let answer: PrefillAnswer = serde_json::from_slice(bytes).map_err(|_| InvalidAnswer::Json)?;
    let kv_transfer_params = answer
        .kv_transfer_params
        .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok())
        .filter(Value::is_object)
        .ok_or(InvalidAnswer::NoParams)?;
    check_params(&kv_transfer_params, instance)?;
    let (prompt_token_ids, prompt_logprobs) = match route {
        Route::Completions => answer
            .choices
            .into_iter()
            .next()
            .map_or((None, None), |c| (c.prompt_token_ids, c.prompt_logprobs)),
        Route::Chat => (answer.prompt_token_ids, answer.prompt_logprobs),
    };
    let prompt_token_ids = prompt_token_ids
        .filter(|ids| !ids.is_empty())
        .ok_or(InvalidAnswer::NoPromptIds)?;
    Ok(Prefilled {
        instance: instance.id.clone(),
        kv_transfer_params,
        prompt_token_ids,
        prompt_logprobs: prompt_logprobs.filter(|l| !l.is_null()),
    })
}

/// Longest `transfer_id` accepted.
const MAX_TRANSFER_ID: usize = 256;

/// Highest `resume_epoch` a hold's params may carry.
pub const MAX_RESUME_EPOCH: u64 = u32::MAX as u64;

/// Checks a hold's params (a prefill's answer, or a checkpoint read back
/// from the shared response store) against the prefill `instance` that
/// holds it.
pub fn check_params(kv: &Value, instance: &Instance) -> Result<(), InvalidAnswer> {
    let text = |key: &'static str| match kv.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(InvalidAnswer::BadParams(key)),
    };
    if let Some(id) = text("transfer_id")? {
        if id.is_empty() || id.len() > MAX_TRANSFER_ID {
            return Err(InvalidAnswer::BadParams("transfer_id"));
        }
    }
    if let Some(lease) = kv.get("lease_s") {
        if !lease.as_f64().is_some_and(|l| l.is_finite() && l > 0.0) {
            return Err(InvalidAnswer::BadParams("lease_s"));
        }
    }
    if let Some(epoch) = kv.get("resume_epoch") {
        if epoch.as_u64().is_none_or(|e| e > MAX_RESUME_EPOCH) {
            return Err(InvalidAnswer::BadParams("resume_epoch"));
        }
    }
    if let Some(answered) = text("remote_ctrl")? {
        if instance.ctrl.as_deref() != Some(answered) {
            return Err(InvalidAnswer::ForeignCtrl {
                answered: answered.to_string(),
                registered: instance.ctrl.clone().unwrap_or_else(|| "none".into()),
            });
        }
    }
    Ok(())
}
