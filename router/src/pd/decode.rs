//! Phase 2: decode. Opens a decoder's stream for a request: the client's body with
//! the prefill's `kv_transfer_params` (or, on a resume, the completions body that
//! continues it), always streaming toward the engine so that the router journals
//! every token as it comes.

use super::attempt::{Attempt, Lane};
use super::deps::FlowDeps;
use super::derender::Derender;
use super::failure::{Cause, Failure};
use super::upstream::{ByteStream, Call, CallError, Opened, Payload};
use crate::error::ApiError;
use crate::membership::{Instance, LoadGuard, Pick};
use crate::prefix::hash::Prompt;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::output::Source;
use crate::protocols::openai::patch::Patch;
use crate::protocols::openai::stops::StopStrings;
use serde_json::{json, Value};
use std::sync::Arc;
use tracing::Instrument;

/// The body sent to a decode instance for the client's own route. The engine's
/// usage is asked for: the router counts tokens itself, but keeps the usage
/// details only the engine knows (cached prompt tokens).
pub fn decode_body(body: &ClientBody, kv_transfer_params: &Value) -> Payload {
    let mut remove: Vec<&str> = Vec::new();
    // Stop strings are the router's (`stops.rs`).
    if StopStrings::of(body).is_some() {
        remove.push("stop");
    }
    // A stream cannot carry the prompt's logprobs (vLLM refuses them with
    // `stream`): a non-stream client gets the prefill's (`Prefilled`).
    if body.get("stream") != Some(&Value::Bool(true)) {
        remove.push("prompt_logprobs");
    }
    super::derender::reasoning_shown(Patch::new(body, &remove), body)
        .value("stream", Value::Bool(true))
        .value("return_token_ids", Value::Bool(true))
        .value("stream_options", json!({"include_usage": true}))
        .value("kv_transfer_params", kv_transfer_params.clone())
        .to_payload()
}

/// Why no stream could be opened on a decoder.
#[derive(Debug)]
pub enum OpenError {
    /// The decoder failed (connect error, no headers, 5xx): another one may
    /// succeed.
    Failed(Failure),
    /// The decoder refused the request (4xx): its answer goes to the client.
    Rejected(ApiError),
}

/// Chooses a decoder for `model`: one that has not failed this request and is
/// not suspect when there is one, else one not failed, else any eligible one (a
/// decoder that failed may have come back). `prompt`: the prompt's token ids,
/// for `cache_aware` (a decoder holding its prefix pulls less).
pub fn choose(
    deps: &FlowDeps,
    model: &str,
    failed: &[String],
    prompt: Option<Prompt<'_>>,
) -> Option<Arc<Instance>> {
    let candidates = deps.registry.eligible(model, Pick::Decode);
    let mut avoid = deps
        .outliers
        .avoid(candidates.iter().map(|c| c.id.as_str()));
    let select = |exclude: &[String]| {
        let decision = deps.decode.select_for(&candidates, exclude, prompt)?;
        if let Some(reason) = decision.reason {
            crate::observe::metrics::routing_decision(
                "decode",
                reason.as_str(),
                decision.hit_tokens,
            );
        }
        if let Some(prompt) = prompt {
            // The decoder is about to load (pull) this prompt.
            decision.instance.remember_prompt(
                prompt,
                deps.routing.kv_block_size,
                deps.routing.prefix_index_blocks,
            );
        }
        Some(decision.instance)
    };
    if !avoid.is_empty() {
        avoid.extend(failed.iter().cloned());
        if let Some(chosen) = select(&avoid) {
            return Some(chosen);
        }
    }
    select(failed).or_else(|| select(&[]))
}

/// What one lane of an attempt sends (see [`Lane`]).
pub struct LanePlan {
    /// The choice the lane continues (a resumed request of several choices).
    pub choice: Option<usize>,
    pub payload: Payload,
    pub derender: Option<Derender>,
}

impl LanePlan {
    /// The one lane of an attempt.
    pub fn only(payload: Payload) -> Self {
        Self {
            choice: None,
            payload,
            derender: None,
        }
    }
}

/// Sends each lane's payload to `decoder` and returns the open streams.
pub async fn open(
    deps: &FlowDeps,
    decoder: Arc<Instance>,
    path: &'static str,
    request_id: &str,
    plans: Vec<LanePlan>,
    source: Source,
) -> Result<Attempt, OpenError> {
    let guard = LoadGuard::new(decoder.clone());
    crate::observe::metrics::upstream_request(&decoder.id, &decoder.model, "decode");
    // One span per attempt, from the call to the end of its stream; the
    // decoder continues the trace from it.
    let span =
        tracing::info_span!("decode", decoder = %decoder.id, resumed = source != Source::Native);
    let mut lanes = Vec::with_capacity(plans.len());
    for plan in plans {
        let call = Call {
            url: &decoder.url,
            path,
            request_id,
            trace: crate::observe::traces::headers(&span),
            body: plan.payload,
        };
        let opened = deps.upstream.decode(call).instrument(span.clone()).await;
        lanes.push(Lane::new(
            opened_stream(deps, &decoder, opened)?,
            plan.choice,
            plan.derender,
        ));
    }
    deps.outliers.clear(&decoder.id);
    let clock = deps.outliers.clock(&decoder.id);
    Ok(Attempt::of_lanes(lanes, guard, source, deps.engines, clock).in_span(span))
}

/// The stream a decode call opened, or why it opened none.
fn opened_stream(
    deps: &FlowDeps,
    decoder: &Instance,
    opened: Result<Opened, CallError>,
) -> Result<ByteStream, OpenError> {
    let failed =
        |cause, message: String| OpenError::Failed(Failure::new(&decoder.id, cause, message));
    match opened {
        Ok(Opened::Stream(stream)) => Ok(stream),
        // A redirect is not followed (it could send the request anywhere): like
        // a 5xx, the decoder failed and another may serve the request.
        Ok(Opened::Status(reply)) if reply.status >= 500 || reply.status < 400 => {
            crate::observe::metrics::upstream_error(&decoder.id, &decoder.model, "decode", "5xx");
            let error = ApiError::upstream(reply.status, &reply.body);
            Err(failed(
                Cause::ServerError,
                format!("decoder {} answered {}: {error}", decoder.id, reply.status),
            ))
        }
        Ok(Opened::Status(reply)) => {
            crate::observe::metrics::upstream_error(&decoder.id, &decoder.model, "decode", "4xx");
            Err(OpenError::Rejected(ApiError::upstream(
                reply.status,
                &reply.body,
            )))
        }
        Err(error) => Err(OpenError::Failed(call_failure(deps, decoder, error))),
    }
}

/// The decoder failure a call to it that got no answer is, with what it
/// says of the decoder: a refused connection is evidence that nothing
/// listens there any more (it is marked dead), a connect timeout that it is
/// busy (new requests avoid it for a while; its streams in flight are left
/// alone).
pub fn call_failure(deps: &FlowDeps, decoder: &Instance, error: CallError) -> Failure {
    let failed = |cause, message: String| Failure::new(&decoder.id, cause, message);
    let count =
        |kind| crate::observe::metrics::upstream_error(&decoder.id, &decoder.model, "decode", kind);
    match error {
        CallError::Connect { refused, message } => {
            count("connect");
            // The decoder never saw the request.
            deps.outliers.suspect(&decoder.id);
            if refused {
                deps.registry.mark_dead(&decoder.id);
            }
            let what = if refused {
                "refused the connection"
            } else {
                "unreachable"
            };
            failed(
                Cause::Connect,
                format!("decoder {} {what}: {message}", decoder.id),
            )
        }
        err @ CallError::NoHeaders(_) => {
            count("no_headers");
            failed(Cause::NoHeaders, format!("decoder {}: {err}", decoder.id))
        }
        err => {
            count("transport");
            failed(Cause::Reset, format!("decoder {}: {err}", decoder.id))
        }
    }
}
