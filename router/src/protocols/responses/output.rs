//! Output items and the response object, from a chat answer.

use super::request::ResponseEcho;
use serde_json::{json, Map, Value};
use std::sync::LazyLock;

/// The Responses usage of a chat usage object.
#[derive(Debug, serde::Serialize)]
pub struct ResponseUsage {
    input_tokens: u64,
    input_tokens_details: CachedTokens,
    output_tokens: u64,
    output_tokens_details: ReasoningTokens,
    total_tokens: u64,
}

#[derive(Debug, serde::Serialize)]
struct CachedTokens {
    cached_tokens: u64,
}

#[derive(Debug, serde::Serialize)]
struct ReasoningTokens {
    reasoning_tokens: u64,
}

pub fn usage(chat: &Value) -> ResponseUsage {
    let count = |key: &str| chat.get(key).and_then(Value::as_u64).unwrap_or(0);
    let detail = |outer: &str, key: &str| {
        chat.get(outer)
            .and_then(|d| d.get(key))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    ResponseUsage {
        input_tokens: count("prompt_tokens"),
        input_tokens_details: CachedTokens {
            cached_tokens: detail("prompt_tokens_details", "cached_tokens"),
        },
        output_tokens: count("completion_tokens"),
        output_tokens_details: ReasoningTokens {
            reasoning_tokens: detail("completion_tokens_details", "reasoning_tokens"),
        },
        total_tokens: count("total_tokens"),
    }
}

/// A reasoning item with its whole text.
pub fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": id, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}], "status": "completed"})
}

/// The assistant's text part.
pub fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// An assistant message item with its whole text.
pub fn message_item(id: &str, text: &str) -> Value {
    json!({"type": "message", "id": id, "status": "completed", "role": "assistant",
           "content": [text_part(text)]})
}

/// A function call item.
pub fn function_call_item(id: &str, call_id: &str, name: &str, arguments: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
           "arguments": arguments, "status": "completed"})
}

/// How a response ended, from the chat's finish reason.
pub fn status_of(finish_reason: Option<&str>) -> (&'static str, Value) {
    match finish_reason {
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        _ => ("completed", Value::Null),
    }
}

/// The request fields a response repeats, as they are when not asked for.
static FIELD_DEFAULTS: LazyLock<Map<String, Value>> = LazyLock::new(|| {
    let defaults = json!({"instructions": null, "max_output_tokens": null, "temperature": 1.0,
        "top_p": 1.0, "tools": [], "tool_choice": "auto", "parallel_tool_calls": true,
        "text": {"format": {"type": "text"}}, "reasoning": {"effort": null, "summary": null},
        "metadata": {}, "truncation": "disabled", "user": null});
    match defaults {
        Value::Object(map) => map,
        _ => Map::new(),
    }
});

/// The response object, serialized from its parts where they are: on every
/// response's path three times (created, in progress, done), so no tree of
/// values is built for it.
#[derive(Debug, serde::Serialize)]
pub struct ResponseObject<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    status: &'a str,
    model: &'a str,
    output: &'a [Value],
    usage: ResponseUsage,
    error: Option<()>,
    incomplete_details: &'a Value,
    instructions: &'a Value,
    max_output_tokens: &'a Value,
    temperature: &'a Value,
    top_p: &'a Value,
    tools: &'a Value,
    tool_choice: &'a Value,
    parallel_tool_calls: &'a Value,
    text: &'a Value,
    reasoning: &'a Value,
    metadata: &'a Value,
    truncation: &'a Value,
    user: &'a Value,
    store: bool,
    background: bool,
    previous_response_id: Option<&'a str>,
}

impl<'a> ResponseObject<'a> {
    pub fn new(
        id: &'a str,
        created_at: u64,
        echo: &'a ResponseEcho,
        status: &'a str,
        output: &'a [Value],
        usage: ResponseUsage,
        incomplete_details: &'a Value,
    ) -> Self {
        let field = |key: &str| {
            echo.fields
                .get(key)
                .or_else(|| FIELD_DEFAULTS.get(key))
                .unwrap_or(&Value::Null)
        };
        Self {
            id,
            object: "response",
            created_at,
            status,
            model: &echo.model,
            output,
            usage,
            error: None,
            incomplete_details,
            instructions: field("instructions"),
            max_output_tokens: field("max_output_tokens"),
            temperature: field("temperature"),
            top_p: field("top_p"),
            tools: field("tools"),
            tool_choice: field("tool_choice"),
            parallel_tool_calls: field("parallel_tool_calls"),
            text: field("text"),
            reasoning: field("reasoning"),
            metadata: field("metadata"),
            truncation: field("truncation"),
            user: field("user"),
            store: echo.store,
            background: echo.background,
            previous_response_id: echo.previous_response_id.as_deref(),
        }
    }

    /// As a JSON value (where it is changed or kept as one).
    pub fn value(&self) -> Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// A response's output items as the next turn's input items (its reasoning
/// dropped, as chat templates drop it).
pub fn as_input(output: &[Value]) -> Vec<Value> {
    output
        .iter()
        .filter_map(|item| match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                let text: String = item["content"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|part| part.get("text").and_then(Value::as_str))
                    .collect();
                Some(json!({"type": "message", "role": "assistant", "content": text}))
            }
            Some("function_call") => Some(json!({"type": "function_call",
                "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]})),
            _ => None,
        })
        .collect()
}

/// `response` as failed on the router's side, saying `message`.
pub fn fail(response: &mut Value, message: &str) {
    response["status"] = json!("failed");
    response["error"] = json!({"code": "server_error", "message": message});
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_turn_gets_text_and_calls_not_reasoning() {
        let items = [
            reasoning_item("rs_1", "think"),
            message_item("msg_1", "hi"),
            function_call_item("fc_1", "call_1", "f", "{\"a\":1}"),
        ];
        let next = as_input(&items);
        assert_eq!(next.len(), 2, "the reasoning is not carried: {next:?}");
        assert_eq!(
            next[0],
            json!({"type": "message", "role": "assistant", "content": "hi"})
        );
        assert_eq!(next[1]["call_id"], "call_1");
        assert_eq!(next[1]["arguments"], "{\"a\":1}");
    }

    #[test]
    fn a_response_repeats_the_fields_asked_for_and_defaults_the_rest() {
        let mut fields = Map::new();
        fields.insert("temperature".into(), json!(0.5));
        fields.insert("tools".into(), json!([{"type": "function", "name": "f"}]));
        let echo = ResponseEcho {
            model: "m".into(),
            stream: false,
            store: true,
            background: false,
            previous_response_id: Some("resp_0".into()),
            fields,
            hide_reasoning: false,
        };
        let output = [message_item("msg_1", "hi")];
        let chat_usage = json!({"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3});
        let incomplete = Value::Null;
        let object = ResponseObject::new(
            "resp_1",
            7,
            &echo,
            "completed",
            &output,
            usage(&chat_usage),
            &incomplete,
        );
        let value = object.value();
        assert_eq!(value["id"], "resp_1");
        assert_eq!(value["object"], "response");
        assert_eq!(value["status"], "completed");
        assert_eq!(value["output"][0]["content"][0]["text"], "hi");
        assert_eq!(value["temperature"], 0.5, "asked for");
        assert_eq!(value["tools"][0]["name"], "f");
        assert_eq!(value["top_p"], 1.0, "defaulted");
        assert_eq!(value["text"]["format"]["type"], "text");
        assert_eq!(value["tool_choice"], "auto");
        assert_eq!(value["error"], Value::Null);
        assert_eq!(value["previous_response_id"], "resp_0");
        assert_eq!(value["usage"]["total_tokens"], 3);
        // The same JSON however it is written.
        let written = serde_json::to_string(&object).unwrap_or_default();
        assert_eq!(
            serde_json::from_str::<Value>(&written).unwrap_or_default(),
            value
        );
    }

    #[test]
    fn usage_is_renamed() {
        let u = usage(&json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}));
        let u = serde_json::to_value(u).unwrap_or_default();
        assert_eq!(
            (u["input_tokens"].as_u64(), u["output_tokens"].as_u64()),
            (Some(3), Some(4))
        );
        assert_eq!(u["total_tokens"], 7);
    }
}
