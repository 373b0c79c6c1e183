//! Chat continuations through vLLM's tokens API (engines started with
//! `--enable-scale-out`).
//!
//! A chat continued on `/v1/completions` loses what the engine's chat parsers
//! make of its tokens: the rest of the reasoning arrives as content, and a
//! tool call cannot be continued at all. vLLM serves three routes for routers
//! that own the tokens, and a continuation uses all three on the new decoder:
//!
//! 1. `render` turns the client's chat body into its prompt ids and the
//!    engine's own sampling parameters (the model's generation defaults, and
//!    what `tools` and `tool_choice` mean for this model);
//! 2. `generate` runs prompt ids + generated ids with those parameters and the
//!    hold's `kv_transfer_params` (the prompt KV is pulled, only the generated
//!    suffix is computed), streaming token ids;
//! 3. the streaming `derender` turns each of those chunks into the chat chunk
//!    the engine's chat route would have sent, from a state the caller
//!    carries: every output id so far with its chunk boundaries (the
//!    engine's reasoning and tool parsers are replayed over them: parser
//!    state cannot be serialized), whether tool calls were streamed and the
//!    ids of those already issued.
//!
//! The router builds that state from its journal, which is what the client
//! has: the chunks the first decoder sent (token ids and chunk lengths) and
//! the tool-call ids the client saw. So the continuation's chunks continue the
//! client's message exactly, reasoning as reasoning, a half-streamed tool
//! call's arguments in that call, under the id the client already has.
//!
//! Costs, on a continuation only (a request without a failure never comes
//! here): one render call, one seed call, and one derender call per chunk,
//! each replaying the output so far through the parsers (vLLM bounds that
//! work by `max_model_len`).

use super::failure::{Cause, Failure};
use super::upstream::{Call, CallError, Payload, Upstream};
use crate::journal::ChoiceProgress;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::patch::{Patch, Set};
use crate::protocols::openai::stops::StopStrings;
use bytes::{BufMut, Bytes, BytesMut};
use futures_util::future::BoxFuture;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::Duration;

/// The client body's fields a continuation's `generate` request carries as
/// they are (the tenant's, set by the router: not left to render's echo).
const CARRIED: [&str; 2] = ["priority", "cache_salt"];

/// The client's chat request as prompt ids and sampling parameters.
pub const RENDER_PATH: &str = "/v1/chat/completions/render";
/// Token ids in, token ids out.
pub const GENERATE_PATH: &str = "/inference/v1/generate";
/// Generated token ids as chat chunks.
pub const DERENDER_PATH: &str = "/v1/chat/completions/derender";

/// Why a decoder gave no continuation.
#[derive(Debug)]
pub enum RenderError {
    /// The decoder does not serve the tokens API: vLLM answers 403 unless
    /// started with `--enable-scale-out`, and a vLLM before 0.32 404.
    Unsupported(String),
    /// No answer: what that says of the decoder is `decode::call_failure`'s.
    Call(CallError),
    /// The decoder failed: another one may serve the continuation.
    Failed(Failure),
}

/// The body `render` is given: the client's chat body, without the stop
/// strings the router matches itself (`stops.rs`): the engine must not stop
/// on them either; asking for the reasoning as the first decoder was asked
/// ([`reasoning_shown`]).
pub fn render_body(body: &ClientBody) -> Payload {
    // Rendered as not streamed: vLLM refuses `stream_options` then (the
    // generate request sets its own).
    let remove: &[&str] = if StopStrings::of(body).is_some() {
        &["stop", "stream_options"]
    } else {
        &["stream_options"]
    };
    reasoning_shown(Patch::new(body, remove), body)
        .value("stream", Value::Bool(false))
        .to_payload()
}

/// `patch` asking the engine for the reasoning a client that hides it
/// (`include_reasoning: false`) will not see: vLLM streams no token ids
/// then, so the router asks for it and hides it itself (`output.rs`). A
/// continuation's render asks the same, so that the engine decides where
/// the reasoning ended as the first decoder did (render answers
/// `reasoning_ended: true` for a request that hides it, and a structured
/// request's grammar would then be replayed over the reasoning).
pub(super) fn reasoning_shown<'a>(patch: Patch<'a>, body: &ClientBody) -> Patch<'a> {
    if body.get("include_reasoning") == Some(&Value::Bool(false)) {
        patch.value("include_reasoning", Value::Bool(true))
    } else {
        patch
    }
}

/// A continuation's chunk that is not derendered, as the client's stream
/// takes it: an error event as it is; the last, usage-only chunk with its
/// usage alone (generate's `request_id` and `output_mode` are not a chat
/// chunk's fields).
pub fn passed_through(data: Bytes) -> Bytes {
    #[derive(Deserialize)]
    struct UsageOnly<'a> {
        #[serde(borrow)]
        usage: &'a RawValue,
        #[serde(default)]
        error: Option<serde::de::IgnoredAny>,
    }
    match serde_json::from_slice::<UsageOnly<'_>>(&data) {
        Ok(chunk) if chunk.error.is_none() => {
            let mut out = BytesMut::with_capacity(chunk.usage.get().len() + 24);
            out.put_slice(b"{\"choices\":[],\"usage\":");
            out.put_slice(chunk.usage.get().as_bytes());
            out.put_u8(b'}');
            out.freeze()
        }
        _ => data,
    }
}

/// Asks `decoder_url` to render the client's chat body; its answer is the
/// `generate` request for the whole request (prompt ids, sampling params).
pub async fn render(
    upstream: &dyn Upstream,
    decoder: &str,
    decoder_url: &str,
    request_id: &str,
    body: Payload,
) -> Result<Value, RenderError> {
    let failed = |cause, message: String| {
        RenderError::Failed(Failure::new(
            decoder,
            cause,
            format!("decoder {decoder} could not render the continuation: {message}"),
        ))
    };
    let call = Call {
        url: decoder_url,
        path: RENDER_PATH,
        request_id,
        trace: Vec::new(),
        body,
    };
    let reply = upstream.answer(call).await.map_err(RenderError::Call)?;
    match reply.status {
        200..=299 => serde_json::from_slice(&reply.body)
            .ok()
            .filter(Value::is_object)
            .ok_or_else(|| failed(Cause::Protocol, "its answer is not a JSON object".into())),
        // vLLM without `--enable-scale-out` answers 403; an older one 404.
        403..=405 => Err(RenderError::Unsupported(format!(
            "decoder {decoder} does not serve vLLM's tokens API ({} on {RENDER_PATH}: start vLLM with --enable-scale-out)",
            reply.status
        ))),
        status => Err(failed(
            if status >= 500 { Cause::ServerError } else { Cause::Protocol },
            format!("{RENDER_PATH} answered {status}"),
        )),
    }
}

/// The `generate` body that continues a chat after `generated` tokens:
/// render's request with prompt + generated as its tokens, what is left of
/// `max_tokens` and `min_tokens`, one sequence, no prompt logprobs (the first
/// decoder gave them), streamed with usage, pulling the hold with `kv` (which
/// says how many of the tokens are generated: `resume::continuing`); the
/// client body's `priority` and `cache_salt` (its tenant's, as the router set
/// them) whatever render echoed of them.
pub fn generate_body(
    rendered: &Value,
    client: &ClientBody,
    prompt: &[u32],
    generated: &[u32],
    kv: &Value,
) -> Result<Bytes, String> {
    let mut sampling = match rendered.get("sampling_params") {
        Some(Value::Object(params)) => params.clone(),
        _ => return Err("render's answer has no sampling_params".into()),
    };
    let done = generated.len() as u64;
    if let Some(max) = sampling.get("max_tokens").and_then(Value::as_u64) {
        sampling.insert("max_tokens".into(), json!(max.saturating_sub(done).max(1)));
    }
    if let Some(min) = sampling.get("min_tokens").and_then(Value::as_u64) {
        sampling.insert("min_tokens".into(), json!(min.saturating_sub(done)));
    }
    sampling.insert("n".into(), json!(1));
    sampling.insert("prompt_logprobs".into(), Value::Null);
    let remove = ["features", "token_offsets", "content_parts"];
    let mut patch = Patch::of_value(rendered, &remove);
    for key in CARRIED {
        if let Some(value) = client.get(key) {
            patch = patch.value(key, value.clone());
        }
    }
    Ok(patch
        .set("token_ids", Set::Ids(prompt, generated))
        .value("sampling_params", Value::Object(sampling))
        .value("output_mode", json!("tokens"))
        .value("stream", Value::Bool(true))
        .value("stream_options", json!({"include_usage": true}))
        .value(
            "kv_transfer_params",
            super::resume::continuing(kv, generated.len()),
        )
        .to_bytes())
}

/// Where the derender calls of one continuation go, and their limits.
#[derive(Clone)]
pub struct DerenderTarget {
    pub upstream: Arc<dyn Upstream>,
    pub decoder: String,
    pub url: String,
    pub request_id: String,
    pub model: String,
    /// Each call's limit: a derender that takes longer is a decoder stall.
    pub timeout: Duration,
}

/// A continuation's generate chunks turned into chat chunks, one derender
/// call per chunk, the stream state carried from call to call.
pub struct Derender {
    target: Arc<DerenderTarget>,
    /// Every call's fixed fields (`{"stream":true,"model":...,
    /// "prompt_token_ids":...,"chat_request":...`), without the closing brace.
    fixed: Bytes,
    /// `stream_state` after the last chunk (JSON).
    state: Bytes,
    /// The client asked `include_stop_str_in_output` (a stop token's text is
    /// then the engine's to show).
    includes_stop: bool,
    /// The call under way. Kept here, not in the caller's future, so that a
    /// caller that stops polling (a batch that waits only a few scheduler
    /// turns) loses no chunk: the next poll continues the same call.
    in_flight: Option<BoxFuture<'static, Result<(Bytes, Bytes), Failure>>>,
}

impl Derender {
    /// The derenderer of a continuation after what `choice` (the journal's
    /// one choice) holds. A first call with no chunk seeds the engine's
    /// incremental detokenizer from prompt + generated (an engine without a
    /// chat parser detokenizes from that window; one with a parser replays
    /// the output ids instead).
    pub async fn start(
        target: DerenderTarget,
        body: &ClientBody,
        prompt: &[u32],
        choice: &ChoiceProgress,
    ) -> Result<Self, Failure> {
        // The client's body, asking for token ids (the journal records the
        // continuation's tokens from them) and reasoning (vLLM leaves the
        // token ids out when it hides reasoning).
        let chat_request = Patch::new(body, &[])
            .value("return_token_ids", Value::Bool(true))
            .value("include_reasoning", Value::Bool(true))
            .value("stream", Value::Bool(true))
            .to_bytes();
        let model = serde_json::to_vec(&target.model).unwrap_or_default();
        let fixed = |prompt_ids: &[&[u32]]| -> Bytes {
            let mut out = BytesMut::new();
            out.put_slice(b"{\"stream\":true,\"model\":");
            out.put_slice(&model);
            out.put_slice(b",\"prompt_token_ids\":");
            out.put_slice(&ids_json(prompt_ids));
            out.put_slice(b",\"chat_request\":");
            out.put_slice(&chat_request);
            out.freeze()
        };
        let target = Arc::new(target);
        let seed_request = call_body(
            &fixed(&[prompt, &choice.token_ids]),
            b"null",
            json!({"request_id": target.request_id, "choices": []})
                .to_string()
                .as_bytes(),
        );
        let (_, seeded) = call(target.clone(), seed_request).await?;
        let state = stream_state(&seeded, choice);
        Ok(Self {
            fixed: fixed(&[prompt]),
            state,
            includes_stop: body.get("include_stop_str_in_output") == Some(&Value::Bool(true)),
            target,
            in_flight: None,
        })
    }

    /// Starts derendering one generate chunk (JSON); its chat chunk comes
    /// from [`Derender::finish`].
    pub fn start_chunk(&mut self, generate_chunk: &[u8]) {
        let ending = Ending::of(generate_chunk, self.includes_stop);
        let chunk = ending.as_ref().map_or_else(
            || Bytes::copy_from_slice(generate_chunk),
            |ending| ending.chunk.clone(),
        );
        let body = call_body(&self.fixed, &self.state, &chunk);
        let call = call(self.target.clone(), body);
        self.in_flight = Some(Box::pin(async move {
            let (chunk, state) = call.await?;
            let chunk = match &ending {
                Some(ending) => ending.restore(&chunk),
                None => chunk,
            };
            Ok((chunk, state))
        }));
    }

    /// The chat chunk of the chunk under way, if one is: `None` when none is.
    pub async fn finish(&mut self) -> Option<Result<Bytes, Failure>> {
        let result = self.in_flight.as_mut()?.await;
        self.in_flight = None;
        Some(result.map(|(chunk, state)| {
            self.state = state;
            chunk
        }))
    }
}

/// The last chunk of a continuation, as derender must be given it and as
/// the client must get it back. vLLM 0.32's derender (1) detokenizes with
/// special tokens kept, for its parsers, so the EOS (or a stop token) that
/// ended the answer would come out as text, which the engine's own chat
/// route never shows: it is derendered without that id, which goes back
/// into the chunk's `token_ids` after; and (2) turns any finish into
/// `tool_calls` once calls were streamed, where the chat route turns only
/// `stop` into it: a continuation cut by `max_tokens` stays `length`.
struct Ending {
    /// The chunk as derender gets it.
    chunk: Bytes,
    /// The stop token taken out, if one was.
    stop_token: Option<u64>,
    /// The engine's finish, when it is not `stop`.
    finish: Option<String>,
}

impl Ending {
    /// `None` for a chunk that does not end the answer.
    fn of(data: &[u8], includes_stop: bool) -> Option<Self> {
        let mut chunk: Value = serde_json::from_slice(data).ok()?;
        let choice = chunk.pointer_mut("/choices/0")?;
        let finish = choice.get("finish_reason")?.as_str()?.to_string();
        let mut stop_token = None;
        let stopped_on_token = choice
            .get("stop_reason")
            .is_none_or(|r| r.is_null() || r.is_u64());
        if finish == "stop" && stopped_on_token && !includes_stop {
            if let Some(Value::Array(ids)) = choice.get_mut("token_ids") {
                stop_token = ids.pop().and_then(|id| id.as_u64());
            }
        }
        Some(Self {
            chunk: Bytes::from(serde_json::to_vec(&chunk).ok()?),
            stop_token,
            finish: (finish != "stop").then_some(finish),
        })
    }

    /// The derendered `chunk` with the stop token back in its token ids and
    /// the engine's own finish.
    fn restore(&self, chunk: &[u8]) -> Bytes {
        let Ok(mut value) = serde_json::from_slice::<Value>(chunk) else {
            return Bytes::copy_from_slice(chunk);
        };
        if let Some(choice) = value.pointer_mut("/choices/0") {
            if let Some(id) = self.stop_token {
                match choice.get_mut("token_ids") {
                    Some(Value::Array(ids)) => ids.push(json!(id)),
                    _ => choice["token_ids"] = json!([id]),
                }
            }
            if let Some(finish) = &self.finish {
                choice["finish_reason"] = json!(finish);
            }
        }
        serde_json::to_vec(&value).map_or_else(|_| Bytes::copy_from_slice(chunk), Bytes::from)
    }
}

/// Whether a generate chunk goes through derender: chunks with choices do;
/// an error event or the last usage chunk is relayed as it is.
pub fn needs_derender(data: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Peek {
        #[serde(default)]
        choices: Vec<serde::de::IgnoredAny>,
        #[serde(default)]
        error: Option<serde::de::IgnoredAny>,
    }
    serde_json::from_slice::<Peek>(data).is_ok_and(|p| p.error.is_none() && !p.choices.is_empty())
}

/// One derender request: the fixed fields, the state, the chunk.
fn call_body(fixed: &[u8], state: &[u8], generate_chunk: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(fixed.len() + state.len() + generate_chunk.len() + 48);
    out.put_slice(fixed);
    out.put_slice(b",\"stream_state\":");
    out.put_slice(state);
    out.put_slice(b",\"generate_chunk\":");
    out.put_slice(generate_chunk);
    out.put_u8(b'}');
    out.freeze()
}

/// Token ids, the slices one after the other, as a JSON array.
fn ids_json(parts: &[&[u32]]) -> Vec<u8> {
    let ids: Vec<u32> = parts.iter().flat_map(|p| p.iter().copied()).collect();
    serde_json::to_vec(&ids).unwrap_or_default()
}

/// Runs one derender call: the chat chunk and the next stream state.
async fn call(target: Arc<DerenderTarget>, body: Bytes) -> Result<(Bytes, Bytes), Failure> {
    let failed = |cause, message: String| {
        Failure::new(
            &target.decoder,
            cause,
            format!(
                "decoder {} could not derender the continuation: {message}",
                target.decoder
            ),
        )
    };
    let request = Call {
        url: &target.url,
        path: DERENDER_PATH,
        request_id: &target.request_id,
        trace: Vec::new(),
        body: body.into(),
    };
    let reply = match tokio::time::timeout(target.timeout, target.upstream.convert(request)).await {
        Err(_) => {
            return Err(failed(
                Cause::Stall,
                format!("no answer within {} ms", target.timeout.as_millis()),
            ))
        }
        Ok(Err(error @ CallError::Connect { .. })) => {
            return Err(failed(Cause::Reset, error.to_string()))
        }
        Ok(Err(error)) => return Err(failed(Cause::Reset, error.to_string())),
        Ok(Ok(reply)) => reply,
    };
    if !(200..300).contains(&reply.status) {
        let cause = if reply.status >= 500 {
            Cause::ServerError
        } else {
            Cause::Protocol
        };
        let message =
            String::from_utf8_lossy(&reply.body[..reply.body.len().min(512)]).into_owned();
        return Err(failed(
            cause,
            format!("{DERENDER_PATH} answered {}: {message}", reply.status),
        ));
    }
    #[derive(Deserialize)]
    struct Answer<'a> {
        #[serde(borrow)]
        chunk: &'a RawValue,
        #[serde(borrow)]
        stream_state: &'a RawValue,
    }
    let answer: Answer<'_> = serde_json::from_slice(&reply.body).map_err(|e| {
        failed(
            Cause::Protocol,
            format!("its answer is not a derender answer: {e}"),
        )
    })?;
    let chunk = tidy(answer.chunk.get())
        .ok_or_else(|| failed(Cause::Protocol, "its chunk is not a JSON object".into()))?;
    Ok((
        chunk,
        Bytes::copy_from_slice(answer.stream_state.get().as_bytes()),
    ))
}

/// The stream state a continuation starts from: the seeded detokenizer
/// window of `seeded` (the seed call's state), with what the client has of
/// the answer: its role, every output id with its chunk lengths, and the ids
/// of the tool calls it saw.
fn stream_state(seeded: &[u8], choice: &ChoiceProgress) -> Bytes {
    let mut state: Map<String, Value> = serde_json::from_slice(seeded).unwrap_or_default();
    state.insert("role_sent".into(), Value::Bool(true));
    state.insert("output_token_ids".into(), json!(choice.token_ids));
    state.insert("output_chunk_lens".into(), json!(choice.chunk_lens));
    state.insert(
        "tools_streamed".into(),
        Value::Bool(!choice.tool_call_ids.is_empty()),
    );
    state.insert("last_tool_call_ids".into(), json!(choice.tool_call_ids));
    Bytes::from(serde_json::to_vec(&state).unwrap_or_default())
}

/// A derendered chunk as the engine's chat route sends it: vLLM's derender
/// answers with every field of its models (nulls, empty lists), its chat
/// route leaves out what was not set. Kept in each choice: `index`,
/// `logprobs` and `finish_reason` (null included, as the chat route sends
/// them); dropped elsewhere: nulls and empty tool-call lists.
fn tidy(chunk: &str) -> Option<Bytes> {
    let Value::Object(mut chunk) = serde_json::from_str::<Value>(chunk).ok()? else {
        return None;
    };
    chunk.retain(|_, v| !v.is_null());
    if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            choice.retain(|k, v| !v.is_null() || k == "logprobs" || k == "finish_reason");
            if let Some(Value::Object(delta)) = choice.get_mut("delta") {
                delta.retain(|_, v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()));
                if let Some(Value::Array(calls)) = delta.get_mut("tool_calls") {
                    for call in calls.iter_mut().filter_map(Value::as_object_mut) {
                        call.retain(|_, v| !v.is_null());
                        if let Some(Value::Object(function)) = call.get_mut("function") {
                            function.retain(|_, v| !v.is_null());
                        }
                    }
                }
            }
        }
    }
    serde_json::to_vec(&chunk).ok().map(Bytes::from)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn generate_body_continues_after_the_generated_tokens() {
        let rendered = json!({"request_id": "chatcmpl-x", "token_ids": [1, 2],
            "features": null, "sampling_params": {"max_tokens": 10, "min_tokens": 4,
            "temperature": 0.0, "n": 1, "prompt_logprobs": 2}, "model": "m", "stream": false});
        let kv = json!({"transfer_id": "t", "resume_epoch": 1});
        let client = ClientBody::of(json!({"priority": 3, "cache_salt": "tenant:a"}));
        let body: Value = serde_json::from_slice(
            &generate_body(&rendered, &client, &[1, 2], &[7, 8, 9], &kv).unwrap(),
        )
        .unwrap();
        assert_eq!(body["priority"], 3, "the client body's, not render's");
        assert_eq!(body["cache_salt"], "tenant:a");
        assert_eq!(body["token_ids"], json!([1, 2, 7, 8, 9]));
        assert_eq!(body["sampling_params"]["max_tokens"], 7);
        assert_eq!(body["sampling_params"]["min_tokens"], 1);
        assert_eq!(body["sampling_params"]["temperature"], 0.0);
        assert_eq!(body["sampling_params"]["prompt_logprobs"], Value::Null);
        assert_eq!(body["stream"], true);
        assert_eq!(body["output_mode"], "tokens");
        // The hold's params, saying which of the tokens are generated (the
        // connector replays a structured request's grammar over those).
        assert_eq!(
            body["kv_transfer_params"],
            json!({"transfer_id": "t", "resume_epoch": 1, "generated_tokens": 3})
        );
        assert!(body.get("features").is_none());
        let none = ClientBody::default();
        assert!(generate_body(&json!({"token_ids": [1]}), &none, &[1], &[2], &kv).is_err());
    }

    #[test]
    fn the_stream_state_carries_what_the_client_has() {
        let choice = ChoiceProgress {
            token_ids: vec![5, 6, 7],
            chunk_lens: vec![1, 2],
            tool_call_ids: vec!["call-a".into()],
            ..ChoiceProgress::default()
        };
        let seeded = br#"{"prev_tokens":["a"],"prefix_offset":0,"read_offset":1,"role_sent":false,"output_token_ids":[]}"#;
        let state: Value = serde_json::from_slice(&stream_state(seeded, &choice)).unwrap();
        assert_eq!(state["prev_tokens"], json!(["a"]));
        assert_eq!(state["read_offset"], 1);
        assert_eq!(state["role_sent"], true);
        assert_eq!(state["output_token_ids"], json!([5, 6, 7]));
        assert_eq!(state["output_chunk_lens"], json!([1, 2]));
        assert_eq!(state["tools_streamed"], true);
        assert_eq!(state["last_tool_call_ids"], json!(["call-a"]));
    }

    #[test]
    fn derendered_chunks_lose_the_unset_fields() {
        let chunk = r#"{"id":"g","object":"chat.completion.chunk","created":1,"model":"m","usage":null,
            "choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning":"hm","tool_calls":[]},
            "logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[4]}]}"#;
        let out: Value = serde_json::from_slice(&tidy(chunk).unwrap()).unwrap();
        assert_eq!(
            out,
            json!({"id":"g","object":"chat.completion.chunk","created":1,"model":"m",
                "choices":[{"index":0,"delta":{"reasoning":"hm"},"logprobs":null,
                "finish_reason":null,"token_ids":[4]}]})
        );
        assert!(tidy("[1]").is_none());
        assert!(needs_derender(
            br#"{"request_id":"r","choices":[{"index":0,"token_ids":[1]}]}"#
        ));
        assert!(!needs_derender(
            br#"{"request_id":"r","choices":[],"usage":{}}"#
        ));
        assert!(!needs_derender(br#"{"error":{"message":"x","code":500}}"#));
    }

    #[test]
    fn the_last_chunk_loses_its_stop_token_to_derender_and_gets_it_back() {
        let last = br#"{"request_id":"r","choices":[{"index":0,"finish_reason":"stop","stop_reason":null,"token_ids":[7,2]}]}"#;
        let ending = Ending::of(last, false).unwrap();
        let sent: Value = serde_json::from_slice(&ending.chunk).unwrap();
        assert_eq!(sent["choices"][0]["token_ids"], json!([7]));
        let derendered = br#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"tool_calls","token_ids":[7]}]}"#;
        let back: Value = serde_json::from_slice(&ending.restore(derendered)).unwrap();
        assert_eq!(back["choices"][0]["token_ids"], json!([7, 2]));
        assert_eq!(
            back["choices"][0]["finish_reason"], "tool_calls",
            "stop: derender's"
        );
        // Cut by max_tokens: the engine's own finish, and every token shown.
        let cut = br#"{"request_id":"r","choices":[{"index":0,"finish_reason":"length","token_ids":[7]}]}"#;
        let ending = Ending::of(cut, false).unwrap();
        let back: Value = serde_json::from_slice(&ending.restore(derendered)).unwrap();
        assert_eq!(back["choices"][0]["finish_reason"], "length");
        assert_eq!(back["choices"][0]["token_ids"], json!([7]));
        // A stop string the client keeps, and a chunk that ends nothing.
        assert!(Ending::of(last, true).unwrap().stop_token.is_none());
        assert!(Ending::of(
            br#"{"choices":[{"index":0,"finish_reason":null,"token_ids":[7]}]}"#,
            false
        )
        .is_none());
    }

    #[test]
    fn rendering_drops_the_stream_options_and_usage_chunks_keep_only_usage() {
        let body = ClientBody::of(json!({"model": "m", "messages": [], "stream": true,
            "stream_options": {"include_usage": true}, "stop": ["x"]}));
        let out: Value = serde_json::from_slice(&render_body(&body).to_bytes()).unwrap();
        assert_eq!(out, json!({"model": "m", "messages": [], "stream": false}));
        let usage = Bytes::from_static(br#"{"request_id":"generate-tokens-1","usage":{"prompt_tokens":3},"output_mode":"tokens","choices":[]}"#);
        let out: Value = serde_json::from_slice(&passed_through(usage)).unwrap();
        assert_eq!(out, json!({"choices": [], "usage": {"prompt_tokens": 3}}));
        let error = Bytes::from_static(br#"{"error":{"message":"x","code":500}}"#);
        assert_eq!(passed_through(error.clone()), error);
    }

    /// A client that hides the reasoning has it rendered as the first
    /// decoder was asked (shown): render answers `reasoning_ended: true` for
    /// a request with `include_reasoning: false`, and the continuation's
    /// decoder would then replay a structured request's grammar over the
    /// reasoning, which the grammar rejects.
    #[test]
    fn rendering_asks_for_the_reasoning_as_the_first_decoder_did() {
        let hidden = ClientBody::of(
            json!({"model": "m", "messages": [], "include_reasoning": false,
            "response_format": {"type": "json_object"}}),
        );
        let out: Value = serde_json::from_slice(&render_body(&hidden).to_bytes()).unwrap();
        assert_eq!(out["include_reasoning"], true);
        let shown =
            ClientBody::of(json!({"model": "m", "messages": [], "include_reasoning": true}));
        let out: Value = serde_json::from_slice(&render_body(&shown).to_bytes()).unwrap();
        assert_eq!(out["include_reasoning"], true);
        let unset = ClientBody::of(json!({"model": "m", "messages": []}));
        let out: Value = serde_json::from_slice(&render_body(&unset).to_bytes()).unwrap();
        assert_eq!(out.get("include_reasoning"), None);
    }

    #[test]
    fn call_bodies_are_one_json_object() {
        let body = call_body(
            b"{\"stream\":true,\"model\":\"m\"",
            b"null",
            b"{\"choices\":[]}",
        );
        let value: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["stream_state"], Value::Null);
        assert_eq!(value["generate_chunk"], json!({"choices": []}));
        assert_eq!(ids_json(&[&[1, 2], &[3]]), b"[1,2,3]");
    }
}
