//! One chunk of a decoder's stream: what the router reads of it (token ids, text,
//! finish) and the edits it makes before a client sees it.
//!
//! Every token of every stream passes through here, so both halves avoid building
//! a JSON tree: the reading half deserializes into borrowed structs that skip what
//! the router does not need, and the editing half splices the chunk's bytes (a new
//! `id`, token-id fields removed). A chunk whose shape the splice does not expect
//! takes the slow path through `serde_json::Value`, which is always right.

use memchr::memmem;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::borrow::Cow;
use std::sync::LazyLock;

/// The byte patterns searched in every chunk, each built once (a `Finder`
/// built per search costs more than the search in a chunk this short).
static KV_PARAMS_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(b"\"kv_transfer_params\":"));
static TOKEN_IDS_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(Field::TokenIds.pattern()));
static PROMPT_TOKEN_IDS_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(Field::PromptTokenIds.pattern()));

/// What the router reads of one chunk.
#[derive(Debug, Deserialize)]
pub struct Chunk<'a> {
    #[serde(default, borrow)]
    pub choices: Vec<Choice<'a>>,
    #[serde(default, borrow)]
    pub error: Option<&'a RawValue>,
    /// The engine's usage (a chunk of its own, at the end).
    #[serde(default, borrow)]
    pub usage: Option<&'a RawValue>,
}

/// What the router reads of one choice of a chunk.
#[derive(Debug, Deserialize)]
pub struct Choice<'a> {
    #[serde(default)]
    pub index: usize,
    /// Completions: the text of this chunk.
    #[serde(default, borrow)]
    pub text: Option<Cow<'a, str>>,
    /// Chat: the delta of this chunk.
    #[serde(default, borrow)]
    pub delta: Option<Delta<'a>>,
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default, borrow)]
    pub finish_reason: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub stop_reason: Option<&'a RawValue>,
    /// The logprobs of this chunk's tokens, when asked for.
    #[serde(default, borrow)]
    pub logprobs: Option<&'a RawValue>,
}

/// What the router reads of a chat delta: the journal its text, whether it
/// carries output other than text and its tool calls' ids; a translated
/// protocol (Responses, Messages: `protocols::segments`) all of it.
#[derive(Debug, Deserialize)]
pub struct Delta<'a> {
    #[serde(default, borrow)]
    pub content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub reasoning: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub tool_calls: Option<Vec<ToolCallDelta<'a>>>,
}

/// One tool-call delta of a chat chunk: its index and, on the delta that
/// opens the call, its id and function name (a continuation keeps the ids
/// the client already has); then pieces of its arguments.
#[derive(Debug, Deserialize)]
pub struct ToolCallDelta<'a> {
    #[serde(default, deserialize_with = "null_as_default")]
    pub index: usize,
    #[serde(default, borrow)]
    pub id: Option<Cow<'a, str>>,
    #[serde(default, borrow, deserialize_with = "null_as_default")]
    pub function: FunctionDelta<'a>,
}

/// A tool call's function, as its deltas bring it.
#[derive(Debug, Default, Deserialize)]
pub struct FunctionDelta<'a> {
    #[serde(default, borrow)]
    pub name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub arguments: Option<Cow<'a, str>>,
}

/// A field that may be `null`, read as its default then.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

impl Choice<'_> {
    /// Whether the chunk carries logprobs.
    pub fn has_logprobs(&self) -> bool {
        self.logprobs.is_some_and(|l| l.get() != "null")
    }

    /// Whether the chunk brings chat output besides text (reasoning, tool
    /// calls): such a chunk has its output, even without text.
    pub fn has_other_output(&self) -> bool {
        self.delta.as_ref().is_some_and(|d| {
            d.reasoning.is_some()
                || d.reasoning_content.is_some()
                || d.tool_calls.as_ref().is_some_and(|c| !c.is_empty())
        })
    }

    /// The tool-call deltas of this chunk (none on the completions route).
    pub fn tool_calls(&self) -> &[ToolCallDelta<'_>] {
        self.delta
            .as_ref()
            .and_then(|d| d.tool_calls.as_deref())
            .unwrap_or_default()
    }

    /// The text this chunk adds, for either route.
    pub fn text(&self) -> &str {
        self.text
            .as_deref()
            .or_else(|| self.delta.as_ref().and_then(|d| d.content.as_deref()))
            .unwrap_or_default()
    }
}

/// An error event of a decoder stream (`{"error": {...}}`).
#[derive(Debug, Clone)]
pub struct ErrorEvent {
    pub message: String,
    /// The HTTP-like code the engine gave, when it gave one.
    pub code: Option<u16>,
}

impl ErrorEvent {
    pub fn parse(raw: &RawValue) -> Self {
        let value: Value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
        let message = value
            .get("message")
            .and_then(Value::as_str)
            .or_else(|| value.as_str())
            .unwrap_or("decoder error")
            .to_string();
        let code = value
            .get("code")
            .and_then(|c| {
                c.as_u64()
                    .or_else(|| c.as_str().and_then(|s| s.parse().ok()))
            })
            .and_then(|c| u16::try_from(c).ok());
        Self { message, code }
    }

    /// Whether the engine failed (retrying elsewhere may succeed) rather than
    /// refusing the request.
    pub fn is_server_error(&self) -> bool {
        self.code.is_none_or(|c| c >= 500)
    }
}

/// Parses one chunk; `None` when it is not a JSON object of the expected shape.
pub fn parse(data: &[u8]) -> Option<Chunk<'_>> {
    serde_json::from_slice(data).ok()
}

/// A token-id field the router may remove from a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    TokenIds,
    PromptTokenIds,
}

impl Field {
    fn key(self) -> &'static str {
        match self {
            Field::TokenIds => "token_ids",
            Field::PromptTokenIds => "prompt_token_ids",
        }
    }

    /// The field as it appears in compact JSON, quoted and with its colon.
    fn pattern(self) -> &'static [u8] {
        match self {
            Field::TokenIds => b"\"token_ids\":",
            Field::PromptTokenIds => b"\"prompt_token_ids\":",
        }
    }

    fn finder(self) -> &'static memmem::Finder<'static> {
        match self {
            Field::TokenIds => &TOKEN_IDS_KEY,
            Field::PromptTokenIds => &PROMPT_TOKEN_IDS_KEY,
        }
    }
}

/// The client's copy of a chunk, as one SSE event: `id` replaced, the listed
/// top-level or choice fields removed, `kv_transfer_params` always removed.
pub fn rewrite_event(data: &[u8], id: &str, strip: &[Field]) -> Vec<u8> {
    splice(data, id, strip).unwrap_or_else(|| {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&rewrite_value(data, id, strip));
        out.extend_from_slice(b"\n\n");
        out
    })
}

/// The fast path: byte edits on the compact JSON engines emit, whatever the
/// order of its keys (vLLM puts `id` first, other servers elsewhere). `None`
/// when the chunk does not have the expected shape.
///
/// A key pattern such as `"token_ids":` preceded by `{` or `,` can only be a real
/// key: inside a JSON string every `"` is escaped, so `,"` never occurs there.
fn splice(data: &[u8], id: &str, strip: &[Field]) -> Option<Vec<u8>> {
    if KV_PARAMS_KEY.find(data).is_some() {
        return None;
    }
    let old_id = top_level_id(data)?;
    let mut out = Vec::with_capacity(data.len() + id.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&data[..old_id.start]);
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(&data[old_id.end..]);
    for field in strip {
        loop {
            match field_range(&out, *field) {
                FieldAt::Absent => break,
                FieldAt::Range(range) => drop(out.drain(range)),
                FieldAt::Unexpected => return None,
            }
        }
    }
    out.extend_from_slice(b"\n\n");
    Some(out)
}

/// The byte range of the string value of the object's own `"id"` key (not
/// one nested deeper, such as a tool call's), in compact JSON; `None` when
/// there is none or the JSON is cut short.
fn top_level_id(data: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut depth = 0usize;
    let mut i = 0;
    while i < data.len() {
        match data[i] {
            b'"' => {
                let end = i + 1 + string_end(&data[i + 1..])?;
                // A string followed by `:` is a key (a value is followed by
                // `,`, `}` or `]`).
                if depth == 1 && &data[i + 1..end] == b"id" && data.get(end + 1) == Some(&b':') {
                    if data.get(end + 2) != Some(&b'"') {
                        return None;
                    }
                    let start = end + 3;
                    return Some(start..start + string_end(&data[start..])?);
                }
                i = end + 1;
            }
            b'{' | b'[' => {
                depth += 1;
                i += 1;
            }
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                i += 1;
            }
            _ => i += 1,
        }
    }
    None
}

/// Where a field to strip is in a chunk.
enum FieldAt {
    /// The chunk has no such key.
    Absent,
    /// The key and its value (an array of numbers or null), with one
    /// separating comma.
    Range(std::ops::Range<usize>),
    /// The key holds another kind of value: not the shape the fast path edits.
    Unexpected,
}

/// Where the first field `key` is, if its value is an array of numbers or null.
fn field_range(data: &[u8], field: Field) -> FieldAt {
    field_value_range(data, field).unwrap_or(FieldAt::Unexpected)
}

fn field_value_range(data: &[u8], field: Field) -> Option<FieldAt> {
    let pattern = field.pattern();
    let mut from = 0;
    let start = loop {
        let Some(at) = field.finder().find(&data[from..]) else {
            return Some(FieldAt::Absent);
        };
        let at = from + at;
        if at > 0 && matches!(data[at - 1], b',' | b'{') {
            break at;
        }
        from = at + pattern.len();
    };
    let value = start + pattern.len();
    let len = match data.get(value)? {
        b'[' => {
            let close = memchr::memchr(b']', &data[value..])?;
            let inner = &data[value + 1..value + close];
            if !inner
                .iter()
                .all(|b| b.is_ascii_digit() || matches!(b, b',' | b' '))
            {
                return None;
            }
            close + 1
        }
        b'n' if data[value..].starts_with(b"null") => 4,
        _ => return None,
    };
    let end = value + len;
    Some(FieldAt::Range(if data[start - 1] == b',' {
        start - 1..end
    } else if data.get(end) == Some(&b',') {
        start..end + 1
    } else {
        start..end
    }))
}

/// Offset of the closing quote of a JSON string whose opening quote came just
/// before `data`.
fn string_end(data: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < data.len() {
        match data[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// The slow path: the same edits through a JSON tree.
fn rewrite_value(data: &[u8], id: &str, strip: &[Field]) -> Vec<u8> {
    let Ok(mut chunk) = serde_json::from_slice::<Value>(data) else {
        return data.to_vec();
    };
    if let Some(map) = chunk.as_object_mut() {
        map.insert("id".into(), Value::String(id.to_string()));
        map.remove("kv_transfer_params");
        for field in strip {
            map.remove(field.key());
        }
    }
    if let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            for field in strip {
                choice.remove(field.key());
            }
        }
    }
    serde_json::to_vec(&chunk).unwrap_or_else(|_| data.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The JSON of the event `rewrite_event` makes, and checks its framing.
    fn rewrite(data: &[u8], id: &str, strip: &[Field]) -> Vec<u8> {
        let event = rewrite_event(data, id, strip);
        let json = event
            .strip_prefix(b"data: ")
            .and_then(|e| e.strip_suffix(b"\n\n"))
            .expect("one SSE event");
        json.to_vec()
    }

    const CHUNK: &[u8] = br#"{"id":"cmpl-engine-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" w300","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[300],"prompt_token_ids":[1,2,3]}]}"#;

    #[test]
    fn reads_tokens_text_and_finish() {
        let chunk = parse(CHUNK).expect("parses");
        assert_eq!(chunk.choices.len(), 1);
        assert_eq!(chunk.choices[0].text(), " w300");
        assert_eq!(chunk.choices[0].token_ids.as_deref(), Some(&[300][..]));
        assert_eq!(chunk.choices[0].finish_reason, None);
        let chat = parse(br#"{"id":"x","choices":[{"index":1,"delta":{"role":"assistant","content":"hi \"q\""},"finish_reason":"stop"}]}"#).expect("parses");
        assert_eq!(chat.choices[0].index, 1);
        assert_eq!(chat.choices[0].text(), "hi \"q\"");
        assert_eq!(chat.choices[0].finish_reason.as_deref(), Some("stop"));
    }

    #[test]
    fn splices_id_and_strips_token_ids() {
        let out = rewrite(
            CHUNK,
            "cmpl-router",
            &[Field::TokenIds, Field::PromptTokenIds],
        );
        let value: Value = serde_json::from_slice(&out).expect("valid JSON");
        assert_eq!(value["id"], "cmpl-router");
        assert!(value["choices"][0].get("token_ids").is_none());
        assert!(value["choices"][0].get("prompt_token_ids").is_none());
        assert_eq!(value["choices"][0]["text"], " w300");
        // The fast path made it: the bytes are the original ones, edited.
        assert!(out.starts_with(br#"{"id":"cmpl-router","object""#));
        assert!(out.ends_with(br#""stop_reason":null}]}"#));
    }

    #[test]
    fn keys_in_any_order_take_the_fast_path_and_nested_ids_are_kept() {
        // Keys sorted (as serde_json writes a map), `id` last, and a tool
        // call's own `id` before it.
        let data = br#"{"choices":[{"delta":{"tool_calls":[{"id":"call_1","index":0}]},"index":0,"token_ids":[5]}],"created":1,"id":"engine-id","model":"m"}"#;
        let out = rewrite(data, "cmpl-router", &[Field::TokenIds]);
        assert_eq!(
            out,
            br#"{"choices":[{"delta":{"tool_calls":[{"id":"call_1","index":0}]},"index":0}],"created":1,"id":"cmpl-router","model":"m"}"#
        );
        assert_eq!(top_level_id(br#"{"a":{"id":"x"}}"#), None);
        assert_eq!(top_level_id(br#"{"a":"id","id":"y"}"#), Some(16..17));
        assert_eq!(top_level_id(br#"{"id":7}"#), None);
        assert_eq!(top_level_id(br#"{"id":"unterminated"#), None);
    }

    #[test]
    fn key_names_inside_text_are_left_alone() {
        let data =
            br#"{"id":"a","choices":[{"index":0,"text":"\"token_ids\":[1]","token_ids":[7]}]}"#;
        let value: Value =
            serde_json::from_slice(&rewrite(data, "b", &[Field::TokenIds])).expect("valid JSON");
        assert_eq!(value["choices"][0]["text"], "\"token_ids\":[1]");
        assert!(value["choices"][0].get("token_ids").is_none());
    }

    #[test]
    fn unexpected_shapes_take_the_slow_path() {
        let data = br#"{"object":"x","id":"a","kv_transfer_params":{"k":1},"choices":[{"token_ids":[1],"index":0}]}"#;
        let value: Value =
            serde_json::from_slice(&rewrite(data, "b", &[Field::TokenIds])).expect("valid JSON");
        assert_eq!(value["id"], "b");
        assert!(value.get("kv_transfer_params").is_none());
        assert!(value["choices"][0].get("token_ids").is_none());
    }

    #[test]
    fn error_events_give_message_and_code() {
        let chunk =
            parse(br#"{"error":{"message":"boom","type":"InternalServerError","code":500}}"#)
                .expect("parses");
        let error = ErrorEvent::parse(chunk.error.expect("error"));
        assert_eq!(error.message, "boom");
        assert_eq!(error.code, Some(500));
        assert!(error.is_server_error());
    }
}
