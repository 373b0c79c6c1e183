//! Output items and the response object, from a chat answer.

use super::request::Echo;
use serde_json::{json, Map, Value};

/// The Responses usage of a chat usage object.
pub fn usage(chat: &Value) -> Value {
    let count = |key: &str| chat.get(key).and_then(Value::as_u64).unwrap_or(0);
    let detail = |outer: &str, key: &str| {
        chat.get(outer)
            .and_then(|d| d.get(key))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    json!({
        "input_tokens": count("prompt_tokens"),
        "input_tokens_details": {"cached_tokens": detail("prompt_tokens_details", "cached_tokens")},
        "output_tokens": count("completion_tokens"),
        "output_tokens_details": {"reasoning_tokens": detail("completion_tokens_details", "reasoning_tokens")},
        "total_tokens": count("total_tokens"),
    })
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

/// The response object.
pub fn response(
    id: &str,
    created_at: u64,
    echo: &Echo,
    status: &str,
    output: Vec<Value>,
    usage: Value,
    incomplete_details: Value,
) -> Value {
    let field = |key: &str, default: Value| echo.fields.get(key).cloned().unwrap_or(default);
    let mut object = Map::new();
    object.insert("id".into(), json!(id));
    object.insert("object".into(), json!("response"));
    object.insert("created_at".into(), json!(created_at));
    object.insert("status".into(), json!(status));
    object.insert("model".into(), json!(echo.model));
    object.insert("output".into(), Value::Array(output));
    object.insert("usage".into(), usage);
    object.insert("error".into(), Value::Null);
    object.insert("incomplete_details".into(), incomplete_details);
    object.insert("instructions".into(), field("instructions", Value::Null));
    object.insert(
        "max_output_tokens".into(),
        field("max_output_tokens", Value::Null),
    );
    object.insert("temperature".into(), field("temperature", json!(1.0)));
    object.insert("top_p".into(), field("top_p", json!(1.0)));
    object.insert("tools".into(), field("tools", json!([])));
    object.insert("tool_choice".into(), field("tool_choice", json!("auto")));
    object.insert(
        "parallel_tool_calls".into(),
        field("parallel_tool_calls", json!(true)),
    );
    object.insert(
        "text".into(),
        field("text", json!({"format": {"type": "text"}})),
    );
    object.insert(
        "reasoning".into(),
        field("reasoning", json!({"effort": null, "summary": null})),
    );
    object.insert("metadata".into(), field("metadata", json!({})));
    object.insert("truncation".into(), field("truncation", json!("disabled")));
    object.insert("user".into(), field("user", Value::Null));
    object.insert("store".into(), json!(echo.store));
    object.insert("background".into(), json!(echo.background));
    object.insert(
        "previous_response_id".into(),
        json!(echo.previous_response_id),
    );
    Value::Object(object)
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
    fn usage_is_renamed() {
        let u = usage(&json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}));
        assert_eq!(
            (u["input_tokens"].as_u64(), u["output_tokens"].as_u64()),
            (Some(3), Some(4))
        );
        assert_eq!(u["total_tokens"], 7);
    }
}
