//! A prompt's token ids before prefill, for `cache_aware`: a completions
//! prompt given as ids is its own answer; a completions text prompt is
//! tokenized here when the model has a tokenizer here (`--tokenizer`, see
//! [`super::tokenizer`]); the rest goes through an engine's `POST /tokenize`
//! (vLLM's: the model's own tokenizer and chat template, so the ids are those
//! the engine will cache). That is one round trip to an engine per request,
//! bounded in time and size; on any failure the choice falls back to load
//! alone.

use super::deps::FlowDeps;
use super::upstream::{ask_tokenizer, Payload};
use crate::membership::Instance;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::patch::Patch;
use crate::protocols::openai::request::Route;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::sync::Arc;

/// The token ids of the prompt of `body`, or `None` when they cannot be had
/// within the time limit.
pub async fn prompt_ids(
    deps: &FlowDeps,
    route: Route,
    body: &ClientBody,
    engines: &[Arc<Instance>],
) -> Option<Vec<u32>> {
    if let Some(ids) = literal_ids(route, body) {
        return Some(ids);
    }
    if let Some((model, text)) = text_for_here(deps, route, body) {
        return tokenize_here(deps, body, model, text).await;
    }
    // Any engine of the model tokenizes alike; spread the calls by prompt.
    let engine = engines.get(rand::random_range(0..engines.len().max(1)))?;
    let request = tokenize_request(route, body)?;
    let limit = deps.routing.tokenize_timeout;
    let started = std::time::Instant::now();
    let ids = tokio::time::timeout(limit, tokenize(deps, &engine.url, request))
        .await
        .ok()
        .flatten();
    crate::observe::metrics::tokenize(started.elapsed(), "engine", ids.is_some());
    ids
}

/// A completions text prompt, and its model, when the model has a
/// tokenizer here.
fn text_for_here(deps: &FlowDeps, route: Route, body: &ClientBody) -> Option<(String, String)> {
    let model = body.get("model").and_then(Value::as_str)?;
    if route != Route::Completions || !deps.tokenizers.has(model) {
        return None;
    }
    Some((model.to_string(), text_prompt(body)?.into_owned()))
}

/// `text`'s ids from the router's own tokenizer of the model, within the
/// tokenize time limit (else the choice is by load: the engines are not
/// asked as well, which would double the wait).
async fn tokenize_here(
    deps: &FlowDeps,
    body: &ClientBody,
    model: String,
    text: String,
) -> Option<Vec<u32>> {
    // vLLM's completions add the model's special tokens unless told not to.
    let special_tokens = body
        .get("add_special_tokens")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let started = std::time::Instant::now();
    let encode = deps.tokenizers.encode(&model, &text, special_tokens);
    let ids = tokio::time::timeout(deps.routing.tokenize_timeout, encode)
        .await
        .ok()
        .flatten();
    crate::observe::metrics::tokenize(started.elapsed(), "router", ids.is_some());
    ids
}

/// A completions prompt that is one text (or a list of one text).
fn text_prompt(body: &ClientBody) -> Option<Cow<'_, str>> {
    match body.get("prompt") {
        Some(Value::String(text)) => Some(Cow::Borrowed(text)),
        Some(Value::Array(items)) if items.len() == 1 => items[0].as_str().map(Cow::Borrowed),
        Some(_) => None,
        // A text (or a list of one text) longer than the raw threshold: read
        // out of the body's buffer for the tokenizer.
        None => body
            .typed::<String>("prompt")
            .or_else(|| body.typed::<(String,)>("prompt").map(|(text,)| text))
            .map(Cow::Owned),
    }
}

/// A completions prompt that is already one list of token ids (read as
/// `u32`s, 4 bytes an id, even from a large raw prompt).
fn literal_ids(route: Route, body: &ClientBody) -> Option<Vec<u32>> {
    if route != Route::Completions {
        return None;
    }
    body.typed::<Vec<u32>>("prompt")
        .or_else(|| body.typed::<(Vec<u32>,)>("prompt").map(|(ids,)| ids))
}

/// The fields of a chat body that change what the chat template renders:
/// vLLM's /tokenize gets them with the messages.
const TEMPLATE_FIELDS: &[&str] = &[
    "model",
    "messages",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
];

/// vLLM's /tokenize body for the prompt of `body` (written from the client's
/// body: its large fields as the client sent them).
fn tokenize_request(route: Route, body: &ClientBody) -> Option<Payload> {
    let model = body.get("model")?.clone();
    match route {
        Route::Completions => {
            let request = json!({"model": model, "prompt": text_prompt(body)?});
            Some(serde_json::to_vec(&request).ok()?.into())
        }
        Route::Chat => {
            let others: Vec<&str> = body
                .fields()
                .keys()
                .map(String::as_str)
                .chain(body.raw_fields().map(|(k, _)| k.as_str()))
                .filter(|k| !TEMPLATE_FIELDS.contains(k))
                .collect();
            Some(Patch::new(body, &others).to_payload())
        }
    }
}

async fn tokenize(deps: &FlowDeps, url: &str, request: Payload) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Answer {
        tokens: Vec<u32>,
    }
    let answer: Answer = ask_tokenizer(deps.upstream.as_ref(), url, "/tokenize", request).await?;
    Some(answer.tokens)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_a_single_id_prompt_needs_no_tokenizer() {
        let ids = |prompt: Value| {
            literal_ids(
                Route::Completions,
                &ClientBody::of(json!({"prompt": prompt})),
            )
        };
        assert_eq!(ids(json!([1, 2, 3])), Some(vec![1, 2, 3]));
        assert_eq!(ids(json!([[4, 5]])), Some(vec![4, 5]));
        assert_eq!(ids(json!("text")), None);
        assert_eq!(ids(json!([[1], [2]])), None);
        assert_eq!(
            literal_ids(Route::Chat, &ClientBody::of(json!({"prompt": [1]}))),
            None
        );
        let chat = tokenize_request(
            Route::Chat,
            &ClientBody::of(json!({"model": "m", "messages": [], "tools": [], "max_tokens": 3})),
        )
        .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&chat.to_bytes()).unwrap(),
            json!({"model": "m", "messages": [], "tools": []})
        );
        // A long prompt of ids is read as ids, however it is held.
        let long: Vec<u32> = (0..20_000).collect();
        let raw = ClientBody::parse(&json!({"prompt": long}).to_string().into()).unwrap();
        assert!(raw.raw("prompt").is_some());
        assert_eq!(literal_ids(Route::Completions, &raw), Some(long));
        // A long text prompt (kept raw) is read as its text.
        let text = "a b ".repeat(10_000);
        let raw = ClientBody::parse(&json!({"prompt": text}).to_string().into()).unwrap();
        assert!(raw.raw("prompt").is_some());
        assert_eq!(text_prompt(&raw).as_deref(), Some(text.as_str()));
        let listed = ClientBody::parse(&json!({"prompt": [text]}).to_string().into()).unwrap();
        assert_eq!(text_prompt(&listed).as_deref(), Some(text.as_str()));
    }
}
