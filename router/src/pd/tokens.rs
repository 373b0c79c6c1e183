//! A prompt's token ids before prefill, for `cache_aware`: a completions
//! prompt given as ids is its own answer; text and chat go through an
//! engine's `POST /tokenize` (vLLM's: the model's own tokenizer and chat
//! template, so the ids are those the engine will cache). One round trip to
//! an engine per request, bounded in time and size; on any failure the
//! choice falls back to load alone.

use super::flow::Flow;
use super::request::Route;
use super::upstream::Call;
use crate::registry::Instance;
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;

/// The token ids of the prompt of `body`, or `None` when they cannot be had
/// within the time limit.
pub async fn prompt_ids(
    state: &Flow,
    route: Route,
    body: &Value,
    engines: &[Arc<Instance>],
) -> Option<Vec<u32>> {
    if let Some(ids) = literal_ids(route, body) {
        return Some(ids);
    }
    // Any engine of the model tokenizes alike; spread the calls by prompt.
    let engine = engines.get(rand::random_range(0..engines.len().max(1)))?;
    let request = tokenize_request(route, body)?;
    let limit = state.settings.tokenize_timeout;
    let started = std::time::Instant::now();
    let ids = tokio::time::timeout(limit, tokenize(state, &engine.url, &request))
        .await
        .ok()
        .flatten();
    crate::metrics::tokenize(started.elapsed(), ids.is_some());
    ids
}

/// A completions prompt that is already one list of token ids.
fn literal_ids(route: Route, body: &Value) -> Option<Vec<u32>> {
    if route != Route::Completions {
        return None;
    }
    let items = match body.get("prompt")? {
        Value::Array(items) if items.len() == 1 && items[0].is_array() => items[0].as_array()?,
        Value::Array(items) => items,
        _ => return None,
    };
    items
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

/// vLLM's /tokenize body for the prompt of `body` (the fields that change
/// what the chat template renders are passed along).
fn tokenize_request(route: Route, body: &Value) -> Option<Value> {
    let model = body.get("model")?.clone();
    match route {
        Route::Completions => {
            let prompt = match body.get("prompt")? {
                Value::String(text) => text.clone(),
                Value::Array(items) if items.len() == 1 => items[0].as_str()?.to_string(),
                _ => return None,
            };
            Some(json!({"model": model, "prompt": prompt}))
        }
        Route::Chat => {
            let mut request = json!({"model": model, "messages": body.get("messages")?.clone()});
            for key in [
                "chat_template",
                "chat_template_kwargs",
                "add_generation_prompt",
                "continue_final_message",
                "tools",
            ] {
                if let Some(value) = body.get(key) {
                    request[key] = value.clone();
                }
            }
            Some(request)
        }
    }
}

async fn tokenize(state: &Flow, url: &str, request: &Value) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Answer {
        tokens: Vec<u32>,
    }
    let call = Call {
        url,
        path: "/tokenize",
        request_id: "",
        trace: Vec::new(),
        body: Bytes::from(serde_json::to_vec(request).ok()?),
    };
    let reply = state.upstream.tokenizer(call).await.ok()?;
    if !(200..300).contains(&reply.status) {
        return None;
    }
    serde_json::from_slice::<Answer>(&reply.body)
        .ok()
        .map(|a| a.tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_single_id_prompt_needs_no_tokenizer() {
        let ids = |prompt: Value| literal_ids(Route::Completions, &json!({"prompt": prompt}));
        assert_eq!(ids(json!([1, 2, 3])), Some(vec![1, 2, 3]));
        assert_eq!(ids(json!([[4, 5]])), Some(vec![4, 5]));
        assert_eq!(ids(json!("text")), None);
        assert_eq!(ids(json!([[1], [2]])), None);
        assert_eq!(literal_ids(Route::Chat, &json!({"prompt": [1]})), None);
        let chat = tokenize_request(
            Route::Chat,
            &json!({"model": "m", "messages": [], "tools": [], "max_tokens": 3}),
        );
        assert_eq!(
            chat,
            Some(json!({"model": "m", "messages": [], "tools": []}))
        );
    }
}
