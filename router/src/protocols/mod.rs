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

/// The checks every translated request starts with: no field outside the
/// lists of `known` (400 naming it: never dropped in silence), the fields of
/// `shapes` of their JSON type when set, and a `model`; returns the model.
pub fn check_fields(
    body: &Map<String, Value>,
    protocol: &str,
    known: &[&[&str]],
    shapes: &[Shape],
) -> Result<String, ApiError> {
    let is_known = |key: &str| known.iter().any(|part| part.contains(&key));
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
