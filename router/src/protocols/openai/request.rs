//! Validation of a client's OpenAI request, and what the flow needs to know of it.
//!
//! The body stays a JSON value: fields the router does not know pass through to
//! the engines untouched.

use super::client_body::ClientBody;
use crate::error::ApiError;
use serde_json::value::RawValue;
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
    /// Chat `include_reasoning: false`: the router asks decoders for the
    /// reasoning anyway (vLLM then streams no token ids, and the journal
    /// could not follow the answer) and hides it from the client itself.
    pub hide_reasoning: bool,
    /// Chat with a required or named tool choice (see [`forces_tool_call`]).
    pub forced_tool_call: bool,
    /// The root of the prompt's chain in the prefix indexes: its
    /// `cache_salt`'s (`crate::prefix::hash::root`), so that a tenant's
    /// prompts match only the prefixes cached under its own salt.
    pub cache_root: u64,
}

/// Checks the body of a generation request; returns what the flow needs.
pub fn validate(
    route: Route,
    body: &ClientBody,
    request_id: String,
    max_tokens_limit: u64,
) -> Result<RequestInfo, ApiError> {
    let object = body.fields();
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
    match (route, body.raw("prompt"), body.raw("messages")) {
        (Route::Completions, Some(raw), _) => check_raw_prompt(raw)?,
        (Route::Completions, None, _) => check_prompt(object.get("prompt"))?,
        (Route::Chat, _, Some(raw)) => check_raw_messages(raw)?,
        (Route::Chat, _, None) => check_messages(object.get("messages"))?,
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
        echo_text: echo_text(route, body)?,
        hide_reasoning: route == Route::Chat
            && optional_bool(object, "include_reasoning")? == Some(false),
        forced_tool_call: route == Route::Chat && forces_tool_call(body),
        cache_root: crate::prefix::hash::root(object.get("cache_salt").and_then(Value::as_str)),
    })
}

/// The prompt text a completions client with `echo` (and without
/// `return_token_ids`, with which vLLM echoes no text either) gets back.
fn echo_text(route: Route, body: &ClientBody) -> Result<Option<String>, ApiError> {
    let object = body.fields();
    if route != Route::Completions
        || optional_bool(object, "echo")? != Some(true)
        || optional_bool(object, "return_token_ids")? == Some(true)
    {
        return Ok(None);
    }
    // A text, or a list of one text.
    Ok(body
        .typed::<String>("prompt")
        .or_else(|| body.typed::<(String,)>("prompt").map(|(text,)| text)))
}

/// Most stop strings a request may have, and longest: the router matches
/// them on every chunk it relays, so their cost is bounded here.
const MAX_STOPS: usize = 64;
const MAX_STOP_CHARS: usize = 1024;

fn checked_stops(body: &ClientBody) -> Result<Option<super::stops::StopStrings>, ApiError> {
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

/// [`check_prompt`] for a prompt kept raw (a large array): read element by
/// element, nothing kept.
fn check_raw_prompt(raw: &[u8]) -> Result<(), ApiError> {
    let invalid = || {
        ApiError::bad_request(
            "`prompt` must be a string or a list of token ids",
            Some("prompt"),
        )
    };
    // A string kept raw is longer than the raw threshold: not empty.
    if raw.starts_with(b"\"") {
        return Ok(());
    }
    let shape: ArrayShape = serde_json::from_slice(raw).map_err(|_| invalid())?;
    match shape {
        ArrayShape { len: 0, .. } => Err(invalid()),
        ArrayShape { all_ids: true, .. } => Ok(()),
        ArrayShape {
            len: 1,
            only: Some(Element::Text { empty: true }),
            ..
        } => Err(ApiError::bad_request(
            "`prompt` must not be empty",
            Some("prompt"),
        )),
        ArrayShape {
            len: 1,
            only: Some(Element::Text { empty: false } | Element::Ids),
            ..
        } => Ok(()),
        ArrayShape {
            all_numbers: true, ..
        } => Err(ApiError::bad_request(
            "prompt token ids must be integers from 0 to 4294967295",
            Some("prompt"),
        )),
        ArrayShape { len: 1, .. } => Err(invalid()),
        ArrayShape { .. } => Err(ApiError::bad_request(
            "batched prompts are not supported: send one request per prompt",
            Some("prompt"),
        )),
    }
}

/// [`check_messages`] for messages kept raw (a long history): each message's
/// `role` is read as the list goes, nothing kept.
fn check_raw_messages(raw: &[u8]) -> Result<(), ApiError> {
    let empty = || ApiError::bad_request("`messages` must be a non-empty list", Some("messages"));
    let bad_role = || {
        ApiError::bad_request(
            "each message must be an object with a string `role`",
            Some("messages"),
        )
    };
    if !raw.starts_with(b"[") {
        return Err(empty());
    }
    let roles: RolesShape = serde_json::from_slice(raw).map_err(|_| bad_role())?;
    match roles {
        RolesShape { len: 0, .. } => Err(empty()),
        RolesShape {
            all_roles: false, ..
        } => Err(bad_role()),
        RolesShape { .. } => Ok(()),
    }
}

/// What a list of messages holds, as [`check_raw_messages`] needs to know it.
struct RolesShape {
    len: usize,
    /// Every message has a string `role`.
    all_roles: bool,
}

/// One message as [`RolesShape`] reads it: its role, if any, left raw.
#[derive(serde::Deserialize)]
struct MessageRole<'a> {
    #[serde(borrow, default)]
    role: Option<&'a RawValue>,
}

impl<'de> SeqShape<'de> for RolesShape {
    type Element = MessageRole<'de>;
    const EXPECTING: &'static str = "a list of messages";

    fn start() -> Self {
        RolesShape {
            len: 0,
            all_roles: true,
        }
    }

    fn add(&mut self, message: MessageRole<'de>) {
        self.all_roles &= message.role.is_some_and(|r| r.get().starts_with('"'));
        self.len += 1;
    }
}

impl<'de> serde::Deserialize<'de> for RolesShape {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_seq(Folding::<Self>::new())
    }
}

/// What a JSON list holds, read element by element as it goes (nothing of
/// an element kept but what `add` counts).
trait SeqShape<'de>: Sized {
    type Element: serde::Deserialize<'de>;
    const EXPECTING: &'static str;
    /// The shape of an empty list.
    fn start() -> Self;
    fn add(&mut self, element: Self::Element);
}

/// The visitor that folds a list into its [`SeqShape`].
struct Folding<T>(std::marker::PhantomData<T>);

impl<T> Folding<T> {
    fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<'de, T: SeqShape<'de>> serde::de::Visitor<'de> for Folding<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(T::EXPECTING)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<T, A::Error> {
        let mut shape = T::start();
        while let Some(element) = seq.next_element::<T::Element>()? {
            shape.add(element);
        }
        Ok(shape)
    }
}

/// What a JSON array holds, as [`check_raw_prompt`] needs to know it.
struct ArrayShape {
    len: usize,
    /// Every element is a token id (an integer that fits a `u32`).
    all_ids: bool,
    /// Every element is a number.
    all_numbers: bool,
    /// The element, when there is exactly one.
    only: Option<Element>,
}

/// One element of a prompt array.
#[derive(Clone, Copy)]
enum Element {
    Id,
    Number,
    Text {
        empty: bool,
    },
    /// A non-empty list of token ids.
    Ids,
    Other,
}

impl SeqShape<'_> for ArrayShape {
    type Element = Element;
    const EXPECTING: &'static str = "an array";

    fn start() -> Self {
        ArrayShape {
            len: 0,
            all_ids: true,
            all_numbers: true,
            only: None,
        }
    }

    fn add(&mut self, element: Element) {
        self.all_ids &= matches!(element, Element::Id);
        self.all_numbers &= matches!(element, Element::Id | Element::Number);
        self.only = (self.len == 0).then_some(element);
        self.len += 1;
    }
}

impl<'de> serde::Deserialize<'de> for ArrayShape {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_seq(Folding::<Self>::new())
    }
}

impl<'de> serde::Deserialize<'de> for Element {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Element;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a prompt element")
            }
            fn visit_u64<E>(self, id: u64) -> Result<Element, E> {
                Ok(if id <= u64::from(u32::MAX) {
                    Element::Id
                } else {
                    Element::Number
                })
            }
            fn visit_i64<E>(self, _: i64) -> Result<Element, E> {
                Ok(Element::Number)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Element, E> {
                Ok(Element::Number)
            }
            fn visit_str<E>(self, text: &str) -> Result<Element, E> {
                Ok(Element::Text {
                    empty: text.is_empty(),
                })
            }
            fn visit_bool<E>(self, _: bool) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_unit<E>(self) -> Result<Element, E> {
                Ok(Element::Other)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Element, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Element::Other)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Element, A::Error> {
                let inner = Folding::<ArrayShape>::new().visit_seq(seq)?;
                Ok(if inner.len > 0 && inner.all_ids {
                    Element::Ids
                } else {
                    Element::Other
                })
            }
        }
        deserializer.deserialize_any(Visit)
    }
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

/// A chat with tools and a required or named `tool_choice`: vLLM serves it with
/// structured output (and answers it with empty content, not null, beside the call).
pub fn forces_tool_call(body: &ClientBody) -> bool {
    let forced = match body.get("tool_choice") {
        Some(Value::String(choice)) => choice == "required",
        Some(Value::Object(_)) => true,
        _ => false,
    };
    forced && offers_tools(body)
}

/// Whether a chat request offers tools.
pub fn offers_tools(body: &ClientBody) -> bool {
    ["tools", "functions"].iter().any(|key| body.has_items(key))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::protocols::openai::client_body::RAW_FIELD_BYTES;
    use serde_json::json;

    /// `body` parsed as the router reads a client's bytes, then validated.
    fn check(route: Route, body: Value) -> Result<RequestInfo, String> {
        let body = ClientBody::parse(&body.to_string().into()).unwrap();
        validate(route, &body, "r".into(), 1 << 20).map_err(|e| e.to_string())
    }

    #[test]
    fn large_fields_kept_raw_are_checked_as_small_ones_are() {
        let long = "word ".repeat(RAW_FIELD_BYTES);
        // A long text prompt, alone or in a list of one; an echo gets it back.
        let text = check(
            Route::Completions,
            json!({"model": "m", "prompt": long, "echo": true}),
        )
        .unwrap();
        assert_eq!(text.echo_text.as_deref(), Some(long.as_str()));
        assert!(check(Route::Completions, json!({"model": "m", "prompt": [long]})).is_ok());
        let ids: Vec<u32> = (0..10_000).collect();
        assert!(check(Route::Completions, json!({"model": "m", "prompt": ids})).is_ok());
        let batch = vec![long.clone(), long.clone()];
        let refused = check(Route::Completions, json!({"model": "m", "prompt": batch}));
        assert!(refused.unwrap_err().contains("batched prompts"));
        // A long history: every message needs its role, and a text is no list.
        let message = json!({"role": "user", "content": "hi"});
        let history = vec![message; 2_000];
        assert!(check(Route::Chat, json!({"model": "m", "messages": history})).is_ok());
        let mut no_role = history.clone();
        no_role[1_000] = json!({"content": "hi"});
        let refused = check(Route::Chat, json!({"model": "m", "messages": no_role}));
        assert!(refused.unwrap_err().contains("string `role`"));
        let refused = check(Route::Chat, json!({"model": "m", "messages": long}));
        assert!(refused.unwrap_err().contains("non-empty list"));
    }
}
