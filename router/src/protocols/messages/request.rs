//! A Messages request, checked and translated to a chat completion body.

use crate::error::ApiError;
use crate::protocols::{bad, check_fields, engine_fields, flag, Shape};
use serde_json::{json, Map, Value};

/// Fields a Messages request may carry; anything else is refused (400).
const KNOWN: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "metadata",
    "service_tier",
    "output_config",
];

/// vLLM's own Messages fields beyond Anthropic's (its `/v1/messages` takes
/// them: `vllm/entrypoints/anthropic/protocol.py`), each one vLLM's chat
/// route reads with the same meaning: carried to the chat body as they are,
/// so that prefill, decode and a resume's continuation all get them.
const ENGINE: &[&str] = &[
    "chat_template_kwargs",
    "vllm_xargs",
    "cache_salt",
    "watermarking",
    "mm_payload",
    "return_mm_kwargs",
];

/// Fields checked for their JSON type (null is their absence).
const SHAPES: &[Shape] = &[
    ("tool_choice", "an object", Value::is_object),
    ("thinking", "an object", Value::is_object),
    ("metadata", "an object", Value::is_object),
    ("output_config", "an object", Value::is_object),
    ("tools", "an array", Value::is_array),
    ("temperature", "a number", Value::is_number),
    ("top_p", "a number", Value::is_number),
    ("top_k", "an integer", Value::is_u64),
    ("chat_template_kwargs", "an object", Value::is_object),
    ("vllm_xargs", "an object", Value::is_object),
    ("cache_salt", "a string", Value::is_string),
    ("watermarking", "a boolean", Value::is_boolean),
    ("mm_payload", "a string", Value::is_string),
    ("return_mm_kwargs", "a boolean", Value::is_boolean),
];

/// What the answer needs of its request.
#[derive(Debug, Clone)]
pub struct MessageEcho {
    pub model: String,
    pub stream: bool,
}

/// Checks `body` and returns its echo and the chat completion body (always
/// streamed with usage: the router turns the chunks into the answer).
pub fn chat_body(body: &Map<String, Value>) -> Result<(MessageEcho, Value), ApiError> {
    let model = check_fields(body, "Messages", &[KNOWN, ENGINE], SHAPES)?;
    let Some(max_tokens) = body
        .get("max_tokens")
        .filter(|v| v.as_u64().is_some_and(|n| n > 0))
    else {
        return Err(bad(
            "`max_tokens` is required: a positive integer",
            "max_tokens",
        ));
    };
    let stream = flag(body, "stream", false)?;
    // As vLLM's own Messages route: thinking enabled is a budget, disabled is
    // no reasoning effort; what the model reasons comes back as thinking blocks.
    let thinking = body.get("thinking").filter(|t| !t.is_null());
    let (budget, effort) = match thinking.and_then(|t| t.get("type")).and_then(Value::as_str) {
        None => (None, None),
        Some("enabled") => (thinking.and_then(|t| t.get("budget_tokens")).cloned(), None),
        Some("disabled") => (None, Some(json!("none"))),
        Some("adaptive") => (None, None),
        Some(_) => {
            return Err(bad(
                "`thinking.type` must be enabled, disabled or adaptive",
                "thinking",
            ))
        }
    };
    let mut messages = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(system) => {
            messages.push(json!({"role": "system", "content": text_of(system, "system")?}))
        }
    }
    let Some(Value::Array(turns)) = body
        .get("messages")
        .filter(|m| m.as_array().is_some_and(|a| !a.is_empty()))
    else {
        return Err(bad("`messages` must be a non-empty array", "messages"));
    };
    for turn in turns {
        add_turn(&mut messages, turn)?;
    }
    let mut chat = json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    for key in ["temperature", "top_p", "top_k"] {
        if let Some(value) = body.get(key).filter(|v| !v.is_null()) {
            chat[key] = value.clone();
        }
    }
    if let Some(stops) = body.get("stop_sequences").filter(|v| !v.is_null()) {
        if !stops
            .as_array()
            .is_some_and(|s| s.iter().all(Value::is_string))
        {
            return Err(bad(
                "`stop_sequences` must be an array of strings",
                "stop_sequences",
            ));
        }
        chat["stop"] = stops.clone();
    }
    if let Some(tools) = body.get("tools").filter(|v| !v.is_null()) {
        chat["tools"] = chat_tools(tools)?;
    }
    if let Some(choice) = body.get("tool_choice").filter(|v| !v.is_null()) {
        if let Some(choice) = chat_tool_choice(choice)? {
            chat["tool_choice"] = choice;
        }
    }
    if let Some(user) = body
        .get("metadata")
        .and_then(|m| m.get("user_id"))
        .and_then(Value::as_str)
    {
        chat["user"] = json!(user);
    }
    if let Some(budget) = budget {
        chat["thinking_token_budget"] = budget;
    }
    if let Some(effort) = effort {
        chat["reasoning_effort"] = effort;
    }
    if let Some(config) = body.get("output_config").filter(|c| !c.is_null()) {
        if let Some(effort) = config.get("effort").filter(|e| !e.is_null()) {
            chat["reasoning_effort"] = effort.clone();
        }
        if let Some(schema) = config.get("format").and_then(|f| f.get("json_schema")) {
            chat["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}});
        }
    }
    if let Some(map) = chat.as_object_mut() {
        map.extend(engine_fields(body, ENGINE));
    }
    Ok((MessageEcho { model, stream }, chat))
}

/// The text of a string or of text blocks.
fn text_of(content: &Value, param: &'static str) -> Result<String, ApiError> {
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for block in blocks {
                match (block.get("type").and_then(Value::as_str), block.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(
                            format!(
                                "blocks of type `{}` are not served here (text only)",
                                kind.unwrap_or("?")
                            ),
                            param,
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad("content must be a string or an array of blocks", param)),
    }
}

/// Appends one Messages turn as chat messages: a user turn's tool results
/// become tool messages (first, as Anthropic puts them), an assistant turn's
/// tool uses become its tool calls.
fn add_turn(messages: &mut Vec<Value>, turn: &Value) -> Result<(), ApiError> {
    let role = turn.get("role").and_then(Value::as_str);
    let content = turn
        .get("content")
        .ok_or_else(|| bad("a message needs `content`", "messages"))?;
    let blocks = match content {
        Value::String(text) => vec![json!({"type": "text", "text": text})],
        Value::Array(blocks) => blocks.clone(),
        _ => {
            return Err(bad(
                "`content` must be a string or an array of blocks",
                "messages",
            ))
        }
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for block in &blocks {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(
                block
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
            ),
            Some("tool_use") if role == Some("assistant") => {
                let (Some(id), Some(name)) = (
                    block.get("id").and_then(Value::as_str),
                    block.get("name").and_then(Value::as_str),
                ) else {
                    return Err(bad("a tool_use block needs `id` and `name`", "messages"));
                };
                let input = block.get("input").cloned().unwrap_or(json!({}));
                calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input.to_string()}}));
            }
            Some("tool_result") if role == Some("user") => {
                let Some(id) = block.get("tool_use_id").and_then(Value::as_str) else {
                    return Err(bad("a tool_result block needs `tool_use_id`", "messages"));
                };
                let output = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(content) => text_of(content, "messages")?,
                };
                messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
            }
            // An earlier turn's thinking: chat templates drop it.
            Some("thinking" | "redacted_thinking") if role == Some("assistant") => {}
            kind => {
                return Err(bad(
                    format!(
                        "{} blocks of type `{}` are not served",
                        role.unwrap_or("?"),
                        kind.unwrap_or("?")
                    ),
                    "messages",
                ))
            }
        }
    }
    match role {
        Some("user") => {
            if !text.is_empty() || blocks.iter().all(|b| b["type"] == "text") {
                messages.push(json!({"role": "user", "content": text}));
            }
        }
        Some("assistant") => {
            let mut message = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                message["tool_calls"] = Value::Array(calls);
                if text.is_empty() {
                    message["content"] = Value::Null;
                }
            }
            messages.push(message);
        }
        _ => {
            return Err(bad(
                "a message's `role` must be user or assistant",
                "messages",
            ))
        }
    }
    Ok(())
}

fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(tools) = tools else {
        return Err(bad("`tools` must be an array", "tools"));
    };
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(bad("a tool needs a `name`", "tools"));
        };
        // Anthropic's own server tools have a `type` (web_search_...).
        if tool
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "custom")
        {
            return Err(bad(
                "only client tools (name, input_schema) are served",
                "tools",
            ));
        }
        let mut function = json!({"name": name,
            "parameters": tool.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
        if let Some(description) = tool.get("description").filter(|d| !d.is_null()) {
            function["description"] = description.clone();
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

fn chat_tool_choice(choice: &Value) -> Result<Option<Value>, ApiError> {
    match choice.get("type").and_then(Value::as_str) {
        Some("auto") => Ok(Some(json!("auto"))),
        Some("any") => Ok(Some(json!("required"))),
        Some("none") => Ok(Some(json!("none"))),
        Some("tool") => match choice.get("name").and_then(Value::as_str) {
            Some(name) => Ok(Some(
                json!({"type": "function", "function": {"name": name}}),
            )),
            None => Err(bad("a `tool` tool_choice needs a `name`", "tool_choice")),
        },
        _ => Err(bad(
            "`tool_choice.type` must be auto, any, tool or none",
            "tool_choice",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<Value, ApiError> {
        chat_body(body.as_object().unwrap_or(&Map::new())).map(|(_, chat)| chat)
    }

    #[test]
    fn system_text_tool_use_and_results_become_chat_messages() {
        let body = chat(json!({
            "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"], "tool_choice": {"type": "any"},
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "thanks"}]}
            ]
        }))
        .unwrap_or_default();
        assert_eq!(
            body["messages"],
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "calling", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                {"role": "user", "content": "thanks"}
            ])
        );
        assert_eq!(body["stop"], json!(["END"]));
        assert_eq!(body["tool_choice"], "required");
        assert_eq!(
            body["tools"][0]["function"]["parameters"],
            json!({"type": "object"})
        );
    }

    #[test]
    fn vllms_own_fields_reach_the_chat_as_they_are() {
        let body = chat(json!({
            "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"enable_thinking": false}, "vllm_xargs": {"k": 1},
            "cache_salt": "s", "watermarking": true, "mm_payload": "none",
            "return_mm_kwargs": false
        }))
        .unwrap_or_default();
        assert_eq!(
            body["chat_template_kwargs"],
            json!({"enable_thinking": false})
        );
        assert_eq!(body["vllm_xargs"], json!({"k": 1}));
        assert_eq!(body["cache_salt"], "s");
        assert_eq!(body["watermarking"], true);
        assert_eq!(body["mm_payload"], "none");
        assert_eq!(body["return_mm_kwargs"], false);
    }

    #[test]
    fn bad_requests_are_refused_by_name() {
        for (body, said) in [
            (
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": []}),
                "messages",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "top_n": 1}),
                "top_n",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                "image",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {"a": 1}}),
                "kv_transfer_params` is not taken from clients",
            ),
            (
                json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}),
                "chat_template_kwargs",
            ),
        ] {
            let error = chat(body.clone()).map(|_| ()).expect_err("refused");
            assert!(error.to_string().contains(said), "{body}: {error}");
        }
    }
}
