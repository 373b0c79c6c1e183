//! A prompt's token ids before prefill, for `cache_aware`: a completions
//! prompt given as ids is its own answer; a completions text prompt is
//! tokenized here when the model has a tokenizer here (`--tokenizer`, see
//! [`super::tokenizer`]); the rest goes through an engine's `POST /tokenize`
//! (vLLM's: the model's own tokenizer and chat template, so the ids are those
//! the engine will cache). That is one round trip to an engine per request,
//! bounded in time and size; on any failure the choice falls back to load
//! alone.

use super::flow::Flow;
use super::request::Route;
use super::upstream::ask_tokenizer;
use crate::registry::Instance;
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
    if let Some((model, text)) = text_for_here(state, route, body) {
        return tokenize_here(state, body, model, text).await;
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
    crate::metrics::tokenize(started.elapsed(), "engine", ids.is_some());
    ids
}

/// A completions text prompt, and its model, when the model has a
/// tokenizer here.
fn text_for_here<'b>(state: &Flow, route: Route, body: &'b Value) -> Option<(&'b str, &'b str)> {
    let model = body.get("model").and_then(Value::as_str)?;
    if route != Route::Completions || !state.tokenizers.has(model) {
        return None;
    }
    Some((model, text_prompt(body)?))
}

/// `text`'s ids from the router's own tokenizer of the model, within the
/// tokenize time limit (else the choice is by load: the engines are not
/// asked as well, which would double the wait).
async fn tokenize_here(state: &Flow, body: &Value, model: &str, text: &str) -> Option<Vec<u32>> {
    // vLLM's completions add the model's special tokens unless told not to.
    let special_tokens = body
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let started = std::time::Instant::now();
    let encode = state.tokenizers.encode(model, text, special_tokens);
    let ids = tokio::time::timeout(state.settings.tokenize_timeout, encode)
        .await
        .ok()
        .flatten();
    crate::metrics::tokenize(started.elapsed(), "router", ids.is_some());
    ids
}

/// A completions prompt that is one text.
fn text_prompt(body: &Value) -> Option<&str> {
    match body.get("prompt")? {
        Value::String(text) => Some(text),
        Value::Array(items) if items.len() == 1 => items[0].as_str(),
        _ => None,
    }
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
        Route::Completions => Some(json!({"model": model, "prompt": text_prompt(body)?})),
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
    let answer: Answer = ask_tokenizer(state.upstream.as_ref(), url, "/tokenize", request).await?;
    Some(answer.tokens)
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
