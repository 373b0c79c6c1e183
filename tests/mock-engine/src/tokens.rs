//! vLLM's tokens API for routers, as the mock serves it: `render` (a chat
//! request to its prompt ids and sampling parameters) and the streaming
//! `derender` (a chunk of generated ids to the chat chunk the engine's chat
//! route would have sent, from a stream state the caller carries).
//! `generate` itself is a generation like the others (`api.rs`).
//!
//! Like vLLM's, the derenderer is stateless: what the answer's earlier tokens
//! made (reasoning, which tool calls are open) is derived again from the
//! state's output ids, and the state is checked as vLLM checks it (chunk
//! lengths that sum to the output) and more strictly: its tool-call ids and
//! `tools_streamed` must be those of the calls the output has opened, so a
//! router that carries a wrong state is caught. New tool calls get ids of
//! this engine (not the native route's), as vLLM's random ids differ between
//! servers: only the ids the caller pins survive a change of server.

use crate::api::{error, EngineState};
use crate::model;
use crate::shape::{Part, Shape};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub const RENDER_PATH: &str = "/v1/chat/completions/render";
pub const GENERATE_PATH: &str = "/inference/v1/generate";
pub const DERENDER_PATH: &str = "/v1/chat/completions/derender";

/// vLLM's answer to a tokens-API call on an engine started without
/// `--enable-scale-out`.
pub fn refused(state: &EngineState) -> Option<Response> {
    (!state.config.enable_scale_out).then(|| {
        error(
            StatusCode::FORBIDDEN,
            "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out",
        )
    })
}

/// The prompt ids of a chat request (its messages through the template).
pub fn chat_prompt(request: &Value) -> Result<Vec<u32>, &'static str> {
    let text = model::apply_chat_template(request.get("messages").ok_or("missing messages")?)
        .ok_or("messages must be a list of {role, content}")?;
    Ok(model::tokenize(&text))
}

/// The `max_tokens` a chat or completions request asks for (16 by default).
pub fn max_tokens(request: &Value) -> u64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|key| request.get(*key).and_then(Value::as_u64))
        .unwrap_or(16)
}

/// A chat request's fields vLLM's render carries into its sampling
/// parameters as they are.
const SAMPLING: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
];

/// `POST /v1/chat/completions/render`.
pub async fn render(State(state): State<Arc<EngineState>>, body: Bytes) -> Response {
    if let Some(refused) = refused(&state) {
        return refused;
    }
    state.render_calls.fetch_add(1, Ordering::Relaxed);
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "invalid JSON body");
    };
    *state.last_render.lock().unwrap_or_else(|e| e.into_inner()) = Some(request.clone());
    let prompt = match chat_prompt(&request) {
        Ok(prompt) => prompt,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let mut sampling = Map::new();
    sampling.insert("n".into(), json!(1));
    sampling.insert("max_tokens".into(), json!(max_tokens(&request)));
    // What vLLM's render puts in its SamplingParams of the request's own
    // fields (`vllm_xargs` become its `extra_args`).
    for &key in SAMPLING {
        if let Some(value) = request.get(key) {
            sampling.insert(key.into(), value.clone());
        }
    }
    if let Some(xargs) = request.get("vllm_xargs") {
        sampling.insert("extra_args".into(), xargs.clone());
    }
    Json(
        json!({"request_id": format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        "token_ids": prompt, "features": null, "sampling_params": sampling,
        "model": request.get("model"), "reasoning_ended": null, "stream": false,
        "priority": 0, "kv_transfer_params": null}),
    )
    .into_response()
}

/// `POST /v1/chat/completions/derender` (the streaming form only).
pub async fn derender(State(state): State<Arc<EngineState>>, body: Bytes) -> Response {
    if let Some(refused) = refused(&state) {
        return refused;
    }
    state.derender_calls.fetch_add(1, Ordering::Relaxed);
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "invalid JSON body");
    };
    match derender_chunk(&state, &request) {
        Ok(answer) => Json(answer).into_response(),
        Err(message) => error(StatusCode::BAD_REQUEST, &message),
    }
}

/// The stream state a derender call carries, as far as the mock reads it.
struct StreamState {
    role_sent: bool,
    output: Vec<u32>,
    chunk_lens: Vec<u64>,
    tools_streamed: bool,
    tool_call_ids: Vec<String>,
    /// Text of a split token not sent yet (vLLM keeps its detokenizer
    /// window in `prev_tokens`; the mock keeps the held text there).
    held: String,
}

impl StreamState {
    fn parse(state: Option<&Value>) -> Result<Self, String> {
        let Some(state) = state.filter(|s| !s.is_null()) else {
            return Ok(Self {
                role_sent: false,
                output: Vec::new(),
                chunk_lens: Vec::new(),
                tools_streamed: false,
                tool_call_ids: Vec::new(),
                held: String::new(),
            });
        };
        let ids = |key: &str| -> Result<Vec<u64>, String> {
            match state.get(key) {
                None => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| v.as_u64().ok_or(format!("stream_state.{key}: not ids")))
                    .collect(),
                Some(_) => Err(format!("stream_state.{key} must be a list")),
            }
        };
        let output = ids("output_token_ids")?
            .into_iter()
            .map(|id| u32::try_from(id).map_err(|_| "token id too large".to_string()))
            .collect::<Result<Vec<u32>, String>>()?;
        let chunk_lens = ids("output_chunk_lens")?;
        if chunk_lens.iter().sum::<u64>() != output.len() as u64 || chunk_lens.contains(&0) {
            return Err("output_chunk_lens must sum to len(output_token_ids)".into());
        }
        Ok(Self {
            role_sent: state
                .get("role_sent")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            output,
            chunk_lens,
            tools_streamed: state
                .get("tools_streamed")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            tool_call_ids: state
                .get("last_tool_call_ids")
                .and_then(Value::as_array)
                .map(|ids| {
                    ids.iter()
                        .filter_map(Value::as_str)
                        .map(String::from)
                        .collect()
                })
                .unwrap_or_default(),
            held: state
                .pointer("/prev_tokens/0")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
        })
    }

    fn to_json(&self) -> Value {
        json!({"prev_tokens": if self.held.is_empty() { json!([]) } else { json!([self.held]) },
            "prefix_offset": 0, "read_offset": 0, "role_sent": self.role_sent,
            "logprob_context_token_ids": [], "logprob_text_offset": 0,
            "output_token_ids": self.output, "output_chunk_lens": self.chunk_lens,
            "tools_streamed": self.tools_streamed, "last_tool_call_ids": self.tool_call_ids})
    }
}

/// One streaming derender: the chat chunk of `generate_chunk`'s tokens and
/// the next state.
fn derender_chunk(engine: &EngineState, request: &Value) -> Result<Value, String> {
    if request.get("stream").and_then(Value::as_bool) != Some(true) {
        return Err("this mock derenders streamed chunks only".into());
    }
    let chat = request
        .get("chat_request")
        .filter(|c| c.is_object())
        .ok_or("chat_request is required when a tool or reasoning parser is configured")?;
    let prompt: Vec<u32> = request
        .get("prompt_token_ids")
        .and_then(Value::as_array)
        .ok_or("prompt_token_ids is required when a tool or reasoning parser is configured")?
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect::<Option<_>>()
        .ok_or("prompt_token_ids must be token ids")?;
    let chunk = request
        .get("generate_chunk")
        .ok_or("missing generate_chunk")?;
    let mut state = StreamState::parse(request.get("stream_state"))?;
    let max = u32::try_from(max_tokens(chat)).map_err(|_| "max_tokens too large")?;
    let shape = Shape::new(true, chat, &prompt, max, engine.config.eos_after_tokens);
    // What the output so far opened: the state must say so (see the module doc).
    let opened = opened_calls(&shape, state.output.len());
    if state.tool_call_ids.len() != opened || state.tools_streamed != (opened > 0) {
        return Err(format!(
            "invalid stream_state: the output opened {opened} tool call(s), the state names {} (tools_streamed {})",
            state.tool_call_ids.len(),
            state.tools_streamed
        ));
    }
    let choices = chunk
        .get("choices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if choices.len() > 1 {
        return Err("derender_chat_stream expects at most one choice per chunk".into());
    }
    let mut out_choices = Vec::new();
    if let Some(choice) = choices.first() {
        let ids: Vec<u32> = choice
            .get("token_ids")
            .and_then(Value::as_array)
            .map(|ids| {
                ids.iter()
                    .filter_map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                    .collect()
            })
            .unwrap_or_default();
        let finish = choice
            .get("finish_reason")
            .filter(|f| !f.is_null())
            .cloned();
        let delta = delta_of(engine, &shape, &mut state, &ids, finish.is_some());
        if !ids.is_empty() {
            state.output.extend_from_slice(&ids);
            state.chunk_lens.push(ids.len() as u64);
        }
        // As vLLM 0.32's derender: any finish becomes `tool_calls` once a
        // call was streamed (its chat route turns only `stop` into it).
        let finish = finish.map(|reason| {
            if state.tools_streamed {
                json!("tool_calls")
            } else {
                reason
            }
        });
        let wants_ids = chat.get("return_token_ids").and_then(Value::as_bool) == Some(true);
        out_choices.push(
            json!({"index": choice.get("index").cloned().unwrap_or(json!(0)),
            "delta": delta, "logprobs": null, "finish_reason": finish,
            "stop_reason": choice.get("stop_reason").cloned().unwrap_or(Value::Null),
            "token_ids": if wants_ids { json!(ids) } else { Value::Null }}),
        );
    }
    let usage = chunk.get("usage").cloned().unwrap_or(Value::Null);
    Ok(
        json!({"chunk": {"id": chunk.get("request_id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion.chunk", "created": 0, "model": request.get("model"),
        "choices": out_choices, "usage": usage, "prompt_token_ids": null,
        "system_fingerprint": null}, "stream_state": state.to_json()}),
    )
}

/// How many tool calls the first `generated` tokens of an answer opened.
fn opened_calls(shape: &Shape, generated: usize) -> usize {
    let mut opened = Vec::new();
    for i in 0..generated {
        if let Part::Tool(n) = shape.part(i) {
            if !opened.contains(&n) {
                opened.push(n);
            }
        }
    }
    opened.len()
}

/// The delta of `ids`, the next tokens after `state.output`: what the
/// engine's chat route would send for them (with the fields vLLM's
/// derender answers with, nulls included).
fn delta_of(
    engine: &EngineState,
    shape: &Shape,
    state: &mut StreamState,
    ids: &[u32],
    finished: bool,
) -> Value {
    let mut content: Option<String> = None;
    let mut reasoning: Option<String> = None;
    let mut calls: Vec<Value> = Vec::new();
    let mut before = state.output.clone();
    for (j, &token) in ids.iter().enumerate() {
        let i = before.len();
        let last = finished && j + 1 == ids.len();
        // The chat route holds a split token's text back for the next one.
        let mut text = std::mem::take(&mut state.held) + &model::token_text(token);
        if model::is_split(token) && !last && shape.is_plain() {
            state.held = std::mem::take(&mut text);
        }
        let piece = shape.stream_choice(i, token, text, &before);
        before.push(token);
        let delta = &piece["delta"];
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            content.get_or_insert_with(String::new).push_str(text);
        }
        if let Some(text) = delta.get("reasoning").and_then(Value::as_str) {
            reasoning.get_or_insert_with(String::new).push_str(text);
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let mut call = call.clone();
            let index = call.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
            if call.get("id").is_some() {
                // A new call: this server's own id, unless the caller pinned one.
                let id = match state.tool_call_ids.get(index) {
                    Some(pinned) => pinned.clone(),
                    None => {
                        let id = format!("chatcmpl-tool-{}-{index}", engine.addr.port());
                        state.tool_call_ids.push(id.clone());
                        id
                    }
                };
                call["id"] = json!(id);
                state.tools_streamed = true;
            }
            match calls.last_mut() {
                Some(previous) if previous["index"] == call["index"] => {
                    let more = call
                        .pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string();
                    if let Some(Value::String(arguments)) =
                        previous.pointer_mut("/function/arguments")
                    {
                        arguments.push_str(&more);
                    }
                }
                _ => calls.push(call),
            }
        }
    }
    let role = (!state.role_sent).then_some("assistant");
    state.role_sent = true;
    json!({"role": role, "content": content, "reasoning": reasoning, "tool_calls": calls})
}
