//! The engine's routes besides generation, as vLLM serves them: tokenize,
//! detokenize, embeddings, pooling, score and rerank (with vLLM's aliases).
//!
//! Each answer is a pure function of the request (no random id, no clock), so
//! that a test can hold what a router passes through to the engine's own
//! answer, byte for byte. Every request is recorded like a generation.

use crate::api::EngineState;
use crate::model;
use crate::stats::{Outcome, RequestRecord};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::Arc;

/// The context length the mock announces.
pub const MAX_MODEL_LEN: usize = 4096;
/// Numbers per embedding or pooled output.
const DIMENSIONS: usize = 8;

/// The routes, on `router`.
pub fn routes(router: Router<Arc<EngineState>>) -> Router<Arc<EngineState>> {
    router
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/embeddings", post(embeddings))
        .route("/pooling", post(pooling))
        .route("/score", post(score))
        .route("/v1/score", post(score))
        .route("/rerank", post(rerank))
        .route("/v1/rerank", post(rerank))
}

type Answer = Result<Value, &'static str>;

/// Records the request, parses it and answers with `answer`'s JSON or a 400.
fn serve(
    state: &EngineState,
    path: &str,
    headers: &HeaderMap,
    body: &[u8],
    answer: impl FnOnce(&EngineState, &Value) -> Answer,
) -> Response {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let result = if request.is_object() {
        answer(state, &request)
    } else {
        Err("the body must be a JSON object")
    };
    let outcome = if result.is_ok() {
        Outcome::Completed
    } else {
        Outcome::Failed
    };
    state.log.push(
        RequestRecord {
            path: path.to_string(),
            request_id,
            traceparent: crate::api::header(headers, "traceparent"),
            tracestate: crate::api::header(headers, "tracestate"),
            body: crate::stats::recorded(&request, state.config.max_recorded_string),
            outcome,
            tokens_emitted: 0,
            computed_prompt_tokens: 0,
            pulled_bytes: 0,
        },
        state.config.max_records,
    );
    match result {
        Ok(answer) => Json(answer).into_response(),
        Err(message) => {
            let body = json!({"error":{"message":message,"type":"BadRequestError","param":null,"code":400}});
            (StatusCode::BAD_REQUEST, Json(body)).into_response()
        }
    }
}

macro_rules! handler {
    ($name:ident, $answer:expr) => {
        async fn $name(
            State(state): State<Arc<EngineState>>,
            uri: Uri,
            headers: HeaderMap,
            body: Bytes,
        ) -> Response {
            serve(&state, uri.path(), &headers, &body, $answer)
        }
    };
}

handler!(tokenize, answer_tokenize);
handler!(detokenize, answer_detokenize);
handler!(embeddings, |s, r| answer_pooled(s, r, "embedding"));
handler!(pooling, |s, r| answer_pooled(s, r, "pooling"));
handler!(score, answer_score);
handler!(rerank, answer_rerank);

/// Token ids of a text or of a list of ids.
fn ids_of(value: &Value) -> Option<Vec<u32>> {
    match value {
        Value::String(text) => Some(model::tokenize(text)),
        Value::Array(items) => items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect(),
        _ => None,
    }
}

/// The inputs of an embeddings or pooling request: one text or id list, or a
/// list of them.
fn inputs(value: Option<&Value>) -> Option<Vec<Vec<u32>>> {
    match value? {
        Value::Array(items) if items.iter().all(|i| i.is_string() || i.is_array()) => {
            items.iter().map(ids_of).collect()
        }
        one => ids_of(one).map(|ids| vec![ids]),
    }
}

/// A deterministic vector of a context.
fn vector(ids: &[u32]) -> Vec<f64> {
    model::generate(ids, DIMENSIONS)
        .into_iter()
        .map(|t| f64::from(t % 1000) / 1000.0)
        .collect()
}

fn usage(prompt: usize) -> Value {
    json!({"prompt_tokens":prompt,"total_tokens":prompt,"completion_tokens":0,"prompt_tokens_details":null})
}

fn answer_tokenize(_state: &EngineState, request: &Value) -> Answer {
    let ids = match (request.get("prompt"), request.get("messages")) {
        (Some(Value::String(prompt)), _) => model::tokenize(prompt),
        (_, Some(messages)) => model::tokenize(
            &model::apply_chat_template(messages)
                .ok_or("messages must be a list of {role, content}")?,
        ),
        _ => return Err("`prompt` (a string) or `messages` is required"),
    };
    Ok(json!({"count":ids.len(),"max_model_len":MAX_MODEL_LEN,"tokens":ids,"token_strs":null}))
}

fn answer_detokenize(_state: &EngineState, request: &Value) -> Answer {
    let ids = request
        .get("tokens")
        .filter(|t| t.is_array())
        .and_then(ids_of)
        .ok_or("`tokens` must be a list of token ids")?;
    // A split token's text is a character's first bytes: at the end it
    // decodes as a real tokenizer decodes a character cut short.
    let text = match ids.split_last() {
        Some((&last, before)) if model::is_split(last) => model::detokenize(before) + "\u{FFFD}",
        _ => model::detokenize(&ids),
    };
    Ok(json!({"prompt": text}))
}

fn answer_pooled(state: &EngineState, request: &Value, object: &str) -> Answer {
    let inputs =
        inputs(request.get("input")).ok_or("`input` must be a text, ids, or a list of them")?;
    let key = if object == "embedding" {
        "embedding"
    } else {
        "data"
    };
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, ids)| json!({"index": index, "object": object, key: vector(ids)}))
        .collect();
    let prompt: usize = inputs.iter().map(Vec::len).sum();
    Ok(
        json!({"id":format!("{object}-mock"),"object":"list","created":0,
        "model":state.config.model,"data":data,"usage":usage(prompt)}),
    )
}

/// A relevance score of `document` for `query`, in [0, 1).
fn relevance(query: &str, document: &str) -> f64 {
    let mut ids = model::tokenize(query);
    ids.extend(model::tokenize(document));
    vector(&ids)[0]
}

/// One text or a list of texts.
fn texts(value: Option<&Value>) -> Option<Vec<String>> {
    match value? {
        Value::String(text) => Some(vec![text.clone()]),
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map(str::to_string))
            .collect(),
        _ => None,
    }
}

fn answer_score(state: &EngineState, request: &Value) -> Answer {
    let first = texts(request.get("text_1")).ok_or("`text_1` must be a text or a list of texts")?;
    let second =
        texts(request.get("text_2")).ok_or("`text_2` must be a text or a list of texts")?;
    let pairs: Vec<(&String, &String)> = match (first.len(), second.len()) {
        (1, _) => second.iter().map(|s| (&first[0], s)).collect(),
        (a, b) if a == b => first.iter().zip(second.iter()).collect(),
        _ => return Err("`text_1` must be one text or as many as `text_2`"),
    };
    let data: Vec<Value> = pairs
        .iter()
        .enumerate()
        .map(|(index, (a, b))| json!({"index":index,"object":"score","score":relevance(a, b)}))
        .collect();
    let prompt: usize = pairs.iter().map(|(a, b)| a.len() + b.len()).sum();
    Ok(
        json!({"id":"score-mock","object":"list","created":0,"model":state.config.model,
        "data":data,"usage":usage(prompt)}),
    )
}

fn answer_rerank(state: &EngineState, request: &Value) -> Answer {
    let query = request
        .get("query")
        .and_then(Value::as_str)
        .ok_or("`query` must be a text")?;
    let documents = texts(request.get("documents")).ok_or("`documents` must be a list of texts")?;
    let mut results: Vec<(usize, f64)> = documents
        .iter()
        .enumerate()
        .map(|(index, d)| (index, relevance(query, d)))
        .collect();
    results.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some(top) = request.get("top_n").and_then(Value::as_u64) {
        results.truncate(usize::try_from(top).unwrap_or(usize::MAX));
    }
    let results: Vec<Value> = results
        .into_iter()
        .map(|(index, score)| {
            json!({"index":index,"document":{"text":documents[index]},"relevance_score":score})
        })
        .collect();
    let tokens = query.len() + documents.iter().map(String::len).sum::<usize>();
    Ok(
        json!({"id":"rerank-mock","model":state.config.model,"usage":{"total_tokens":tokens},
        "results":results}),
    )
}
