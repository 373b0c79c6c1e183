//! Validation of a client's OpenAI request, and what the flow needs to know of it.
//!
//! The body stays a JSON value: fields the router does not know pass through to
//! the engines untouched.

use crate::error::ApiError;
use serde_json::Value;

/// The two generation routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
}

impl Route {
    pub fn path(self) -> &'static str {
        match self {
            Route::Completions => "/v1/completions",
            Route::Chat => "/v1/chat/completions",
        }
    }

    /// Prefix of response ids, as vLLM uses it.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Route::Completions => "cmpl",
            Route::Chat => "chatcmpl",
        }
    }
}

/// What the flow needs to know of a validated request.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    pub route: Route,
    pub request_id: String,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    /// The client asked for `token_ids` / `prompt_token_ids` itself.
    pub return_token_ids: bool,
    pub n: u64,
    /// Chat: the alternatives per token of the logprobs asked for
    /// (`logprobs: true`, `top_logprobs`), when asked for.
    pub chat_top_logprobs: Option<usize>,
    /// The stop strings the router matches (never sent to decoders).
    pub stop: Option<super::stops::StopStrings>,
    /// Completions `echo` of a text prompt: the text each choice starts with.
    /// The router asks decoders for token ids, and vLLM then echoes no prompt
    /// text (only the ids), so the router puts the text back itself.
    pub echo_text: Option<String>,
}

/// Checks the body of a generation request; returns what the flow needs.
pub fn validate(
    route: Route,
    body: &Value,
    request_id: String,
    max_tokens_limit: u64,
) -> Result<RequestInfo, ApiError> {
    let object = body
        .as_object()
        .ok_or_else(|| ApiError::bad_request("request body must be a JSON object", None))?;
    let model = match object.get("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "`model` must be a non-empty string",
                Some("model"),
            ))
        }
        None => return Err(ApiError::bad_request("`model` is required", Some("model"))),
    };
    match route {
        Route::Completions => check_prompt(object.get("prompt"))?,
        Route::Chat => check_messages(object.get("messages"))?,
    }
    let stream = optional_bool(object, "stream")?.unwrap_or(false);
    for key in ["max_tokens", "max_completion_tokens"] {
        check_max_tokens(object.get(key), key, max_tokens_limit)?;
    }
    let n = match object.get("n") {
        None | Some(Value::Null) => 1,
        Some(value) => value
            .as_u64()
            .filter(|n| (1..=128).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request("`n` must be an integer from 1 to 128", Some("n"))
            })?,
    };
    let include_usage = match object.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(options)) => optional_bool(options, "include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(ApiError::bad_request(
                "`stream_options` must be an object",
                Some("stream_options"),
            ))
        }
    };
    Ok(RequestInfo {
        route,
        request_id,
        model,
        stream,
        include_usage,
        return_token_ids: optional_bool(object, "return_token_ids")?.unwrap_or(false),
        n,
        chat_top_logprobs: (route == Route::Chat
            && object.get("logprobs") == Some(&Value::Bool(true)))
        .then(|| {
            let top = object
                .get("top_logprobs")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            usize::try_from(top).unwrap_or(usize::MAX)
        }),
        stop: checked_stops(body)?,
        echo_text: echo_text(route, object)?,
    })
}

/// The prompt text a completions client with `echo` (and without
/// `return_token_ids`, with which vLLM echoes no text either) gets back.
fn echo_text(
    route: Route,
    object: &serde_json::Map<String, Value>,
) -> Result<Option<String>, ApiError> {
    if route != Route::Completions
        || optional_bool(object, "echo")? != Some(true)
        || optional_bool(object, "return_token_ids")? == Some(true)
    {
        return Ok(None);
    }
    Ok(match object.get("prompt") {
        Some(Value::String(text)) => Some(text.clone()),
        Some(Value::Array(one)) => match one.as_slice() {
            [Value::String(text)] => Some(text.clone()),
            _ => None,
        },
        _ => None,
    })
}

/// Most stop strings a request may have, and longest: the router matches
/// them on every chunk it relays, so their cost is bounded here.
const MAX_STOPS: usize = 64;
const MAX_STOP_CHARS: usize = 1024;

fn checked_stops(body: &Value) -> Result<Option<super::stops::StopStrings>, ApiError> {
    let stops = super::stops::StopStrings::of(body);
    if let Some(given) = &stops {
        if given.stops.len() > MAX_STOPS
            || given
                .stops
                .iter()
                .any(|s| s.chars().count() > MAX_STOP_CHARS)
        {
            return Err(ApiError::bad_request(
                format!("`stop` takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters"),
                Some("stop"),
            ));
        }
    }
    Ok(stops)
}

fn optional_bool(
    object: &serde_json::Map<String, Value>,
    key: &'static str,
) -> Result<Option<bool>, ApiError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad_request(
            format!("`{key}` must be a boolean"),
            Some(key),
        )),
    }
}

fn check_prompt(prompt: Option<&Value>) -> Result<(), ApiError> {
    let invalid = || {
        ApiError::bad_request(
            "`prompt` must be a string or a list of token ids",
            Some("prompt"),
        )
    };
    // An empty prompt has nothing to prefill (vLLM refuses it too).
    let empty = || ApiError::bad_request("`prompt` must not be empty", Some("prompt"));
    match prompt {
        None => Err(ApiError::bad_request(
            "`prompt` is required",
            Some("prompt"),
        )),
        Some(Value::String(text)) if text.is_empty() => Err(empty()),
        Some(Value::String(_)) => Ok(()),
        Some(Value::Array(items)) if items.is_empty() => Err(invalid()),
        Some(Value::Array(items))
            if items
                .iter()
                .all(|i| i.as_u64().is_some_and(|id| id <= u64::from(u32::MAX))) =>
        {
            Ok(())
        }
        Some(Value::Array(items)) if items.len() == 1 => match &items[0] {
            Value::String(text) if text.is_empty() => Err(empty()),
            Value::String(_) => Ok(()),
            inner @ Value::Array(_) => check_prompt(Some(inner)),
            _ => Err(invalid()),
        },
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            Err(ApiError::bad_request(
                "prompt token ids must be integers from 0 to 4294967295",
                Some("prompt"),
            ))
        }
        Some(Value::Array(_)) => Err(ApiError::bad_request(
            "batched prompts are not supported: send one request per prompt",
            Some("prompt"),
        )),
        Some(_) => Err(invalid()),
    }
}

fn check_messages(messages: Option<&Value>) -> Result<(), ApiError> {
    let messages = match messages {
        None => {
            return Err(ApiError::bad_request(
                "`messages` is required",
                Some("messages"),
            ))
        }
        Some(Value::Array(messages)) if !messages.is_empty() => messages,
        Some(_) => {
            return Err(ApiError::bad_request(
                "`messages` must be a non-empty list",
                Some("messages"),
            ))
        }
    };
    for message in messages {
        if !message.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::bad_request(
                "each message must be an object with a string `role`",
                Some("messages"),
            ));
        }
    }
    Ok(())
}

fn check_max_tokens(value: Option<&Value>, key: &'static str, limit: u64) -> Result<(), ApiError> {
    match value {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) | None => Err(ApiError::bad_request(
                format!("`{key}` must be a positive integer"),
                Some(key),
            )),
            Some(v) if v > limit => Err(ApiError::bad_request(
                format!("`{key}` must be at most {limit}"),
                Some(key),
            )),
            Some(_) => Ok(()),
        },
        Some(_) => Err(ApiError::bad_request(
            format!("`{key}` must be an integer"),
            Some(key),
        )),
    }
}
