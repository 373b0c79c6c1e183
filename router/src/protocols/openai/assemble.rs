//! The one answer of a non-stream client, assembled from the decoder's stream
//! chunks by the rules the OpenAI SDKs use to accumulate a stream, so that it
//! equals what the engine would have answered unstreamed:
//!
//! - per choice `index` (`n > 1`): strings concatenate (`text`, a chat delta's
//!   `content` and `reasoning`/`reasoning_content`), arrays of values join
//!   (`token_ids`, completions `logprobs.tokens`/`token_logprobs`/
//!   `top_logprobs`/`text_offset`, chat `logprobs.content`), objects merge key
//!   by key, and array entries that carry an `index` (a delta's `tool_calls`)
//!   merge with the entry of the same index;
//! - a chat choice's deltas become its `message`;
//! - `index`, `type`, `id` and `role` are replaced, never concatenated (they
//!   name a thing, they are not pieces of it); any other field of a choice or
//!   of the chunk (`finish_reason`, `stop_reason`, `system_fingerprint`, fields
//!   the router does not know) keeps its last non-null value;
//! - the fields an engine's non-stream answer has that its stream leaves out
//!   (vLLM 0.32: `service_tier`, `prompt_logprobs`, a message's `refusal`...)
//!   are added as null where the stream did not give them.
//!
//! The router's own fields (id, created, model, usage counts, token ids) are
//! the [`super::output::Output`]'s.

use super::request::Route;
use serde_json::{Map, Value};

/// Top-level fields of a chunk the assembly leaves to the output.
const ROUTER_FIELDS: &[&str] = &[
    "id",
    "object",
    "created",
    "model",
    "choices",
    "usage",
    "kv_transfer_params",
];

/// Fields whose value names a thing: replaced by a later chunk, never joined.
const NAMES: &[&str] = &["index", "type", "id", "role"];

/// vLLM's (0.32) non-stream fields that its stream does not carry: null unless
/// a chunk gave them. (`kv_transfer_params`, `token_ids` and
/// `prompt_token_ids` are the output's.)
const TOP_DEFAULTS: &[&str] = &[
    "service_tier",
    "system_fingerprint",
    "ec_transfer_params",
    "metrics",
];
const CHAT_TOP_DEFAULTS: &[&str] = &["prompt_logprobs", "prompt_text"];
const CHOICE_DEFAULTS: &[&str] = &["logprobs", "finish_reason", "stop_reason", "routed_experts"];
const COMPLETION_CHOICE_DEFAULTS: &[&str] = &["prompt_logprobs"];
/// vLLM's usage fields that its stream leaves out when null.
pub const USAGE_DEFAULTS: &[&str] = &["prompt_tokens_details", "completion_tokens_details"];
const MESSAGE_DEFAULTS: &[&str] = &[
    "content",
    "refusal",
    "annotations",
    "audio",
    "function_call",
    "reasoning",
];

/// What the chunks of one request brought so far.
#[derive(Debug)]
pub struct Assembly {
    route: Route,
    top: Map<String, Value>,
    choices: Vec<Option<Map<String, Value>>>,
    /// A chat whose `tool_choice` forces a call: vLLM's answer then has empty
    /// content beside the call, where a parser's (auto) call has none.
    forced_tool_call: bool,
}

impl Assembly {
    pub fn new(route: Route, choices: usize) -> Self {
        Self {
            route,
            top: Map::new(),
            choices: vec![None; choices.max(1)],
            forced_tool_call: false,
        }
    }

    /// The assembly of a chat with a required or named `tool_choice`.
    pub fn forcing_tool_call(mut self, forced: bool) -> Self {
        self.forced_tool_call = forced;
        self
    }

    /// Adds one stream chunk (of the client's route: a resumed chat request's
    /// completions chunks are converted first).
    pub fn add(&mut self, chunk: &Value) {
        let Some(chunk) = chunk.as_object() else {
            return;
        };
        for (key, value) in chunk {
            if !ROUTER_FIELDS.contains(&key.as_str()) {
                keep_last(&mut self.top, key, value);
            }
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            let Some(choice) = choice.as_object() else {
                continue;
            };
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let Some(slot) = usize::try_from(index)
                .ok()
                .and_then(|i| self.choices.get_mut(i))
            else {
                continue;
            };
            add_choice(slot.get_or_insert_with(Map::new), choice);
        }
    }

    /// The top-level fields of the answer (besides the router's own).
    pub fn top(&self) -> Map<String, Value> {
        let mut top = self.top.clone();
        let chat = if self.route == Route::Chat {
            CHAT_TOP_DEFAULTS
        } else {
            &[]
        };
        for key in TOP_DEFAULTS.iter().chain(chat) {
            top.entry(*key).or_insert(Value::Null);
        }
        top
    }

    /// Choice `index` of the answer, as the engine's non-stream answer has it.
    pub fn choice(&self, index: usize) -> Map<String, Value> {
        let mut choice = self
            .choices
            .get(index)
            .cloned()
            .flatten()
            .unwrap_or_default();
        choice.insert("index".into(), Value::from(index));
        match self.route {
            Route::Completions => {
                if !choice.contains_key("text") {
                    choice.insert("text".into(), Value::from(""));
                }
                for key in COMPLETION_CHOICE_DEFAULTS {
                    choice.entry(*key).or_insert(Value::Null);
                }
            }
            Route::Chat => {
                let mut message = match choice.remove("delta") {
                    Some(Value::Object(message)) => message,
                    _ => Map::new(),
                };
                finish_message(&mut message, self.forced_tool_call);
                choice.insert("message".into(), Value::Object(message));
            }
        }
        for key in CHOICE_DEFAULTS {
            choice.entry(*key).or_insert(Value::Null);
        }
        choice
    }
}

/// Adds one chunk's choice to what its index has so far.
fn add_choice(acc: &mut Map<String, Value>, choice: &Map<String, Value>) {
    for (key, value) in choice {
        match key.as_str() {
            "text" | "delta" | "logprobs" | "token_ids" => accumulate(acc, key, value),
            // A resumed request's prompt is prompt + generated: the first
            // attempt's prompt ids are the client's.
            "prompt_token_ids" => {
                if acc.get(key).is_none_or(Value::is_null) {
                    acc.insert(key.clone(), value.clone());
                }
            }
            _ => keep_last(acc, key, value),
        }
    }
}

/// `value` replaces `acc[key]` unless it is null.
fn keep_last(acc: &mut Map<String, Value>, key: &str, value: &Value) {
    if !value.is_null() || !acc.contains_key(key) {
        acc.insert(key.to_string(), value.clone());
    }
}

/// The SDKs' `accumulate_delta` for one key.
fn accumulate(acc: &mut Map<String, Value>, key: &str, delta: &Value) {
    let Some(current) = acc.get_mut(key).filter(|v| !v.is_null()) else {
        acc.insert(key.to_string(), delta.clone());
        return;
    };
    if delta.is_null() {
        return;
    }
    if NAMES.contains(&key) {
        *current = delta.clone();
        return;
    }
    match (current, delta) {
        (Value::String(current), Value::String(delta)) => current.push_str(delta),
        (Value::Object(current), Value::Object(delta)) => {
            for (key, value) in delta {
                accumulate(current, key, value);
            }
        }
        (Value::Array(current), Value::Array(delta)) => join(current, delta),
        (current, delta) => *current = delta.clone(),
    }
}

/// Joins two arrays: an entry with an integer `index` merges into the entry of
/// the same index (a tool call's pieces), any other entry is appended.
fn join(current: &mut Vec<Value>, delta: &[Value]) {
    for entry in delta {
        let index = entry.get("index").and_then(Value::as_u64);
        let same = index.and_then(|index| {
            current
                .iter_mut()
                .find(|e| e.get("index").and_then(Value::as_u64) == Some(index))
        });
        match (same, entry) {
            (Some(Value::Object(same)), Value::Object(entry)) => {
                for (key, value) in entry {
                    accumulate(same, key, value);
                }
            }
            _ => current.push(entry.clone()),
        }
    }
}

/// A chat choice's accumulated deltas as the message of a non-stream answer:
/// tool calls without their stream `index`, and no `tool_calls` when there are
/// none (as vLLM serializes a message).
fn finish_message(message: &mut Map<String, Value>, forced_tool_call: bool) {
    if message.get("role").is_none_or(Value::is_null) {
        message.insert("role".into(), Value::from("assistant"));
    }
    for key in MESSAGE_DEFAULTS {
        message.entry(*key).or_insert(Value::Null);
    }
    match message.get_mut("tool_calls") {
        Some(Value::Array(calls)) if !calls.is_empty() => {
            for call in calls.iter_mut().filter_map(Value::as_object_mut) {
                call.remove("index");
            }
            // The stream's empty content deltas around tool calls are no
            // content: vLLM's own answer has none (null) beside the calls a
            // parser found, and "" beside a call the tool choice forced.
            if !forced_tool_call && message.get("content").and_then(Value::as_str) == Some("") {
                message.insert("content".into(), Value::Null);
            }
        }
        _ => {
            message.remove("tool_calls");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn assemble(route: Route, n: usize, chunks: &[Value]) -> Assembly {
        let mut assembly = Assembly::new(route, n);
        for chunk in chunks {
            assembly.add(chunk);
        }
        assembly
    }

    #[test]
    fn a_forced_tool_call_keeps_its_empty_content() {
        let chunks = [
            json!({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"stop"}]}),
        ];
        let mut forced = Assembly::new(Route::Chat, 1).forcing_tool_call(true);
        let mut parsed = Assembly::new(Route::Chat, 1);
        for chunk in &chunks {
            forced.add(chunk);
            parsed.add(chunk);
        }
        // vLLM: "" beside a call its tool_choice forced, null beside a parsed one.
        assert_eq!(forced.choice(0)["message"]["content"], "");
        assert_eq!(parsed.choice(0)["message"]["content"], Value::Null);
    }

    #[test]
    fn tool_calls_merge_by_index_and_text_concatenates() {
        let chunks = [
            json!({"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}),
            json!({"choices":[{"index":0,"delta":{"reasoning_content":"let me","tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"f","arguments":"{\"a\""}}]}}]}),
            json!({"choices":[{"index":0,"delta":{"reasoning_content":" think","tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"g","arguments":"{"}}]}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":": 1}"}}]}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"}"}}]},"finish_reason":"tool_calls","stop_reason":null}],"system_fingerprint":"fp","future_field":{"k":1}}),
        ];
        let assembly = assemble(Route::Chat, 1, &chunks);
        let choice = Value::Object(assembly.choice(0));
        assert_eq!(choice["finish_reason"], "tool_calls");
        let message = &choice["message"];
        assert_eq!(message["role"], "assistant");
        // Only the role chunk's empty content beside the calls: none, as vLLM says.
        assert_eq!(message["content"], Value::Null);
        assert_eq!(message["reasoning_content"], "let me think");
        assert_eq!(message["reasoning"], Value::Null);
        assert_eq!(
            message["tool_calls"],
            json!([
                {"id":"call_a","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}},
                {"id":"call_b","type":"function","function":{"name":"g","arguments":"{}"}}
            ])
        );
        let top = Value::Object(assembly.top());
        assert_eq!(top["system_fingerprint"], "fp");
        assert_eq!(top["future_field"], json!({"k":1}));
        assert_eq!(top["service_tier"], Value::Null);
        assert!(top.get("id").is_none());
    }

    #[test]
    fn completion_logprobs_join_per_choice() {
        let lp = |t: &str, o: u64| json!({"tokens":[t],"token_logprobs":[-0.5],"top_logprobs":[{t:-0.5}],"text_offset":[o]});
        let chunks = [
            json!({"choices":[{"index":1,"text":"a","logprobs":lp("a",0),"token_ids":[1],"prompt_token_ids":[7]}]}),
            json!({"choices":[{"index":0,"text":"b","logprobs":lp("b",0),"token_ids":[2]}]}),
            json!({"choices":[{"index":1,"text":"c","logprobs":lp("c",1),"token_ids":[3],"prompt_token_ids":[7,1],"finish_reason":"stop","stop_reason":"x"}]}),
        ];
        let assembly = assemble(Route::Completions, 2, &chunks);
        let one = Value::Object(assembly.choice(1));
        assert_eq!(one["text"], "ac");
        assert_eq!(one["token_ids"], json!([1, 3]));
        assert_eq!(one["prompt_token_ids"], json!([7]), "the first prompt");
        assert_eq!(
            one["logprobs"],
            json!({"tokens":["a","c"],"token_logprobs":[-0.5,-0.5],"top_logprobs":[{"a":-0.5},{"c":-0.5}],"text_offset":[0,1]})
        );
        assert_eq!(one["finish_reason"], "stop");
        assert_eq!(one["stop_reason"], "x");
        assert_eq!(one["prompt_logprobs"], Value::Null);
        let zero = Value::Object(assembly.choice(0));
        assert_eq!(zero["text"], "b");
        assert_eq!(zero["finish_reason"], Value::Null);
    }

    #[test]
    fn chat_logprobs_content_joins_and_a_message_without_tools_has_no_tool_calls() {
        let entry = |t: &str| json!({"token":t,"logprob":-1.0,"bytes":[1],"top_logprobs":[]});
        let chunks = [
            json!({"choices":[{"index":0,"delta":{"role":"assistant","content":"a","tool_calls":[]},"logprobs":{"content":[entry("a")]}}]}),
            json!({"choices":[{"index":0,"delta":{"content":"b"},"logprobs":{"content":[entry("b")]},"finish_reason":"length"}]}),
        ];
        let choice = Value::Object(assemble(Route::Chat, 1, &chunks).choice(0));
        assert_eq!(choice["message"]["content"], "ab");
        assert!(choice["message"].get("tool_calls").is_none());
        assert_eq!(
            choice["logprobs"],
            json!({"content":[entry("a"), entry("b")]})
        );
    }
}
