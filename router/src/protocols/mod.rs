//! Wire formats. `sse.rs` is the one SSE parser and emitter (engine streams
//! in, client streams out). The client protocols beyond OpenAI's chat and
//! completions are each translated to and from a chat completion run through
//! prefill/decode (so a decoder failure resumes them as it resumes chat):
//! OpenAI's Responses and Anthropic's Messages, both cut into the same
//! segments (`segments.rs`), written through the `TranslatedOutput` the
//! relay feeds (`openai/translated_output.rs`).

pub mod client_event;
pub mod messages;
pub mod openai;
pub mod responses;
pub mod segments;
pub mod sse;

use crate::error::ApiError;
use serde_json::{Map, Value};

/// A request field checked for its JSON type: its name, what it must be (for
/// the error) and the check.
pub type Shape = (&'static str, &'static str, fn(&Value) -> bool);

/// A 400 about `param`.
pub fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

/// Boolean field `key` of `body` (`default` when absent or null; 400
/// otherwise).
pub fn flag(body: &Map<String, Value>, key: &'static str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{key}` must be a boolean"), key)),
    }
}

/// Fields vLLM's own routes take that the router sets itself: a client's
/// would be overwritten, so it is refused (400 saying why), never dropped.
const ROUTER_OWNED: &[(&str, &str)] = &[
    (
        "kv_transfer_params",
        "the router sets it for each phase (prefill, decode, resume)",
    ),
    (
        "ec_transfer_params",
        "the router does not disaggregate encoders",
    ),
    (
        "request_id",
        "the router names a request by its `x-request-id` header",
    ),
];

/// Whether `value` is a JSON integer that fits an i64 (what vLLM takes for
/// its integer fields).
pub fn is_integer(value: &Value) -> bool {
    value.is_i64()
}

/// The fields of `keys` that `body` sets (not null), as they are: vLLM's own
/// request fields, which its chat route reads as the protocol's own route
/// does, so that the chat body carries them to every phase.
pub fn engine_fields(body: &Map<String, Value>, keys: &[&str]) -> Map<String, Value> {
    keys.iter()
        .filter_map(|&key| {
            let value = body.get(key).filter(|v| !v.is_null())?;
            Some((key.to_string(), value.clone()))
        })
        .collect()
}

/// The checks every translated request starts with: no field the router
/// sets itself (`ROUTER_OWNED`) and none outside the lists of `known` (400
/// naming it: never dropped in silence), the fields of `shapes` of their
/// JSON type when set, and a `model`; returns the model.
pub fn check_fields(
    body: &Map<String, Value>,
    protocol: &str,
    known: &[&[&str]],
    shapes: &[Shape],
) -> Result<String, ApiError> {
    if let Some((key, why)) = ROUTER_OWNED
        .iter()
        .find(|(key, _)| body.get(*key).is_some_and(|v| !v.is_null()))
    {
        return Err(bad(
            format!("`{key}` is not taken from clients: {why}"),
            key,
        ));
    }
    let is_known = |key: &str| {
        known.iter().any(|part| part.contains(&key))
            || ROUTER_OWNED.iter().any(|(owned, _)| *owned == key)
    };
    if let Some(unknown) = body.keys().find(|k| !is_known(k)) {
        return Err(ApiError::bad_request(
            format!("`{unknown}` is not a {protocol} request field this router serves"),
            None,
        ));
    }
    for (key, kind, fits) in shapes {
        if body.get(*key).is_some_and(|v| !v.is_null() && !fits(v)) {
            return Err(bad(format!("`{key}` must be {kind}"), key));
        }
    }
    match body.get("model") {
        Some(Value::String(model)) if !model.is_empty() => Ok(model.clone()),
        _ => Err(bad("`model` must be a non-empty string", "model")),
    }
}
