//! Phase 4: resume. What a request that lost its decoder is continued with: the
//! client's sampling parameters on `/v1/completions`, prompt ids + generated ids as
//! the prompt, `max_tokens` reduced by what was generated, and the hold's
//! `kv_transfer_params` with a bumped `resume_epoch`. The new decoder pulls the
//! prompt KV from the hold and computes only the generated suffix.
//!
//! Some requests carry state that a resumed completions request cannot: `n > 1`,
//! guided or structured output, logprobs, tool calls, echo. Those fail over only
//! before their first token (when nothing has reached the client yet).

use super::request::Route;
use serde_json::{json, Value};

/// Keys of a chat request that a completions request does not take.
const CHAT_ONLY: &[&str] = &[
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "mm_processor_kwargs",
    "max_completion_tokens",
    "top_logprobs",
    "reasoning_effort",
    "include_reasoning",
    "modalities",
    "audio",
];

/// Why a request cannot be continued from its generated tokens, if it cannot.
pub fn mid_stream_blocker(route: Route, body: &Value) -> Option<&'static str> {
    let set = |key: &str| body.get(key).is_some_and(|v| !v.is_null() && v != false);
    if body.get("n").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return Some("n > 1");
    }
    if body.get("best_of").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return Some("best_of > 1");
    }
    let guided = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ];
    if guided.iter().any(|k| set(k))
        || body
            .pointer("/response_format/type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "text")
    {
        return Some("guided or structured output");
    }
    if set("logprobs") || set("prompt_logprobs") || set("top_logprobs") {
        return Some("logprobs");
    }
    if route == Route::Chat && (set("tools") || set("functions")) {
        return Some("tool calls");
    }
    if set("echo") {
        return Some("echo");
    }
    None
}

/// The `max_tokens` the client asked for, from either key.
fn requested_max_tokens(body: &Value) -> Option<u64> {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|key| body.get(*key).and_then(Value::as_u64))
}

/// `kv_transfer_params` for resume `epoch`.
pub fn with_epoch(kv_transfer_params: &Value, epoch: u64) -> Value {
    let mut kv = kv_transfer_params.clone();
    if let Some(map) = kv.as_object_mut() {
        map.insert("resume_epoch".into(), json!(epoch));
    }
    kv
}

/// The `/v1/completions` body that continues a request after `generated` tokens.
pub fn resume_body(
    route: Route,
    body: &Value,
    prompt_token_ids: &[u32],
    generated: &[u32],
    kv_transfer_params: &Value,
) -> Value {
    let mut out = body.clone();
    let Some(map) = out.as_object_mut() else {
        return out;
    };
    let max_tokens = requested_max_tokens(body);
    if route == Route::Chat {
        for key in CHAT_ONLY {
            map.remove(*key);
        }
    }
    let mut prompt = Vec::with_capacity(prompt_token_ids.len() + generated.len());
    prompt.extend_from_slice(prompt_token_ids);
    prompt.extend_from_slice(generated);
    map.insert("prompt".into(), json!(prompt));
    let done = generated.len() as u64;
    // Without a limit the engine generates to the end of the context: `null` asks
    // vLLM for exactly that on the completions route (whose default is 16).
    map.insert(
        "max_tokens".into(),
        max_tokens.map_or(Value::Null, |m| json!(m.saturating_sub(done).max(1))),
    );
    for key in ["min_tokens", "min_completion_tokens"] {
        if let Some(min) = map.get(key).and_then(Value::as_u64) {
            map.insert(key.into(), json!(min.saturating_sub(done)));
        }
    }
    map.insert("stream".into(), Value::Bool(true));
    map.insert("return_token_ids".into(), Value::Bool(true));
    map.insert("stream_options".into(), json!({"include_usage": false}));
    map.insert("n".into(), json!(1));
    map.insert("echo".into(), Value::Bool(false));
    map.insert("kv_transfer_params".into(), kv_transfer_params.clone());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_resumes_as_completions_on_prompt_plus_generated() {
        let body = json!({"model":"m","messages":[{"role":"user","content":"hi"}],
            "max_completion_tokens":10,"temperature":0,"seed":7,"min_tokens":4,"stream":false});
        let kv = with_epoch(&json!({"transfer_id":"t","resume_epoch":0}), 1);
        let out = resume_body(Route::Chat, &body, &[1, 2], &[9, 8, 7], &kv);
        assert_eq!(out["prompt"], json!([1, 2, 9, 8, 7]));
        assert_eq!(out["max_tokens"], 7);
        assert_eq!(out["min_tokens"], 1);
        assert_eq!(out["temperature"], 0);
        assert_eq!(out["seed"], 7);
        assert_eq!(out["stream"], true);
        assert_eq!(out["kv_transfer_params"]["resume_epoch"], 1);
        assert!(out.get("messages").is_none());
        assert!(out.get("max_completion_tokens").is_none());
    }

    #[test]
    fn requests_with_uncarried_state_are_not_resumable_mid_stream() {
        let blocked = |body: Value| mid_stream_blocker(Route::Completions, &body);
        assert_eq!(blocked(json!({"n": 2})), Some("n > 1"));
        assert_eq!(blocked(json!({"logprobs": 2})), Some("logprobs"));
        assert_eq!(
            blocked(json!({"guided_json": {"type":"object"}})),
            Some("guided or structured output")
        );
        assert_eq!(
            mid_stream_blocker(
                Route::Chat,
                &json!({"response_format": {"type": "json_object"}})
            ),
            Some("guided or structured output")
        );
        assert_eq!(blocked(json!({"n": 1, "temperature": 0.5})), None);
        assert_eq!(blocked(json!({"logprobs": null, "echo": false})), None);
    }
}
