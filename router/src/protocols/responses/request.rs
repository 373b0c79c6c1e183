//! A Responses request, checked and translated to a chat completion body.

use crate::error::ApiError;
use crate::protocols::{bad, check_fields, engine_fields, flag, is_integer, Shape};
use serde_json::{json, Map, Value};

/// Request fields the response object repeats as they were asked.
const ECHOED: &[&str] = &[
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "metadata",
    "user",
    "truncation",
];

/// The other fields a Responses request may carry. Anything else is refused
/// (400), never dropped in silence.
const KNOWN: &[&str] = &[
    "model",
    "input",
    "stream",
    "store",
    "previous_response_id",
    "include",
    "background",
    "service_tier",
    "top_logprobs",
    "safety_identifier",
    "prompt_cache_key",
    "stream_options",
    "enable_response_messages",
];

/// vLLM's own Responses fields beyond OpenAI's (its `/v1/responses` takes
/// them: `vllm/entrypoints/openai/responses/protocol.py`), each one vLLM's
/// chat route reads with the same meaning: carried to the chat body as they
/// are, so that prefill, decode and a resume's continuation all get them.
/// Not echoed in the response object (vLLM's is not either).
const ENGINE: &[&str] = &[
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "include_reasoning",
    "watermarking",
    "structured_outputs",
    "chat_template_kwargs",
    "vllm_xargs",
    "priority",
    "cache_salt",
    "session_id",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "mm_payload",
    "return_mm_kwargs",
];

/// vLLM fields of its harmony-format models alone: known, and refused by name.
const NOT_SERVED: &[&str] = &["previous_input_messages"];

/// Fields checked for their JSON type (null is their absence).
const SHAPES: &[Shape] = &[
    ("include", "an array", Value::is_array),
    ("text", "an object", Value::is_object),
    ("reasoning", "an object", Value::is_object),
    ("metadata", "an object", Value::is_object),
    ("tools", "an array", Value::is_array),
    ("user", "a string", Value::is_string),
    ("parallel_tool_calls", "a boolean", Value::is_boolean),
    ("temperature", "a number", Value::is_number),
    ("top_p", "a number", Value::is_number),
    (
        "max_output_tokens",
        "a positive integer",
        is_positive_integer,
    ),
    ("top_k", "an integer", is_integer),
    ("seed", "an integer", is_integer),
    ("priority", "an integer", is_integer),
    ("min_p", "a number", Value::is_number),
    ("presence_penalty", "a number", Value::is_number),
    ("frequency_penalty", "a number", Value::is_number),
    ("repetition_penalty", "a number", Value::is_number),
    ("stop", "a string or an array of strings", is_stop),
    ("stop_token_ids", "an array of token ids", is_token_ids),
    ("ignore_eos", "a boolean", Value::is_boolean),
    ("include_stop_str_in_output", "a boolean", Value::is_boolean),
    ("skip_special_tokens", "a boolean", Value::is_boolean),
    ("include_reasoning", "a boolean", Value::is_boolean),
    ("watermarking", "a boolean", Value::is_boolean),
    ("enable_response_messages", "a boolean", Value::is_boolean),
    ("return_mm_kwargs", "a boolean", Value::is_boolean),
    ("logit_bias", "an object", Value::is_object),
    ("structured_outputs", "an object", Value::is_object),
    ("chat_template_kwargs", "an object", Value::is_object),
    ("vllm_xargs", "an object", Value::is_object),
    ("mm_processor_kwargs", "an object", Value::is_object),
    ("media_io_kwargs", "an object", Value::is_object),
    ("cache_salt", "a string", Value::is_string),
    ("session_id", "a string", Value::is_string),
    ("mm_payload", "a string", Value::is_string),
];

fn is_stop(value: &Value) -> bool {
    match value {
        Value::String(_) => true,
        Value::Array(stops) => stops.iter().all(Value::is_string),
        _ => false,
    }
}

fn is_token_ids(value: &Value) -> bool {
    value.as_array().is_some_and(|ids| {
        ids.iter()
            .all(|id| id.as_u64().is_some_and(|id| id <= u64::from(u32::MAX)))
    })
}

fn is_positive_integer(value: &Value) -> bool {
    value.as_u64().is_some_and(|n| n > 0)
}

/// What the response object echoes of its request, and how the router
/// serves it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ResponseEcho {
    pub model: String,
    pub stream: bool,
    pub store: bool,
    /// Run apart from the request: its events kept for any reader (`live.rs`).
    pub background: bool,
    pub previous_response_id: Option<String>,
    /// Request fields the response object repeats as they were asked.
    pub fields: Map<String, Value>,
    /// vLLM's `include_reasoning: false`: the model reasons, and the
    /// response shows no reasoning item.
    #[serde(default)]
    pub hide_reasoning: bool,
}

/// A Responses request, checked.
#[derive(Debug)]
pub struct Checked {
    pub echo: ResponseEcho,
    /// Its input items, each as the chat reads it (`canonical_item`: what the
    /// stored conversation keeps).
    pub input: Vec<Value>,
    /// vLLM's own fields it sets (`ENGINE`), for the chat body as they are.
    pub engine: Map<String, Value>,
}

/// Checks `body`: its echo, its input items and its engine fields.
pub fn check(body: &Map<String, Value>) -> Result<Checked, ApiError> {
    let model = check_fields(
        body,
        "Responses",
        &[ECHOED, KNOWN, ENGINE, NOT_SERVED],
        SHAPES,
    )?;
    super::limits::check_echoed(body)?;
    let flag = |key, default| flag(body, key, default);
    if let Some(key) = NOT_SERVED
        .iter()
        .find(|k| body.get(**k).is_some_and(|v| !v.is_null()))
    {
        return Err(bad(
            format!("`{key}` (vLLM's, for harmony-format models) is not served by this router"),
            key,
        ));
    }
    if flag("enable_response_messages", false)? {
        return Err(bad(
            "`enable_response_messages: true` (vLLM's, for harmony-format models) is not served by this router",
            "enable_response_messages",
        ));
    }
    let text_format = body
        .get("text")
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null());
    if text_format.is_some() && body.get("structured_outputs").is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "`structured_outputs` and `text.format` cannot both be given",
            "structured_outputs",
        ));
    }
    let background = flag("background", false)?;
    if background && !flag("store", true)? {
        return Err(bad(
            "`background: true` needs `store` (not false)",
            "background",
        ));
    }
    match body.get("truncation") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "disabled" => {}
        Some(_) => {
            return Err(bad(
                "only `truncation: \"disabled\"` is served",
                "truncation",
            ))
        }
    }
    let input = match body.get("input") {
        Some(Value::String(text)) => {
            vec![json!({"type": "message", "role": "user", "content": text})]
        }
        Some(Value::Array(items)) if !items.is_empty() => {
            let mut canonical = Vec::with_capacity(items.len());
            for item in items {
                canonical.extend(canonical_item(item)?);
            }
            canonical
        }
        _ => {
            return Err(bad(
                "`input` must be a string or a non-empty array of items",
                "input",
            ))
        }
    };
    let previous_response_id = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if super::valid_response_id(id) => Some(id.clone()),
        Some(_) => {
            return Err(bad(
                "`previous_response_id` must be a response id",
                "previous_response_id",
            ))
        }
    };
    let mut fields = Map::new();
    for &key in ECHOED {
        if let Some(value) = body.get(key) {
            fields.insert(key.into(), value.clone());
        }
    }
    let echo = ResponseEcho {
        model,
        stream: flag("stream", false)?,
        store: flag("store", true)?,
        background,
        previous_response_id,
        fields,
        hide_reasoning: !flag("include_reasoning", true)?,
    };
    Ok(Checked {
        echo,
        input,
        engine: engine_fields(body, ENGINE),
    })
}

/// The chat completion body for `echo`'s request over `items` (the stored
/// conversation first, then this request's input), with vLLM's own fields
/// `engine` as they are. Always streamed with usage: the router turns the
/// chunks into events or one response.
pub fn chat_body(
    echo: &ResponseEcho,
    items: &[Value],
    engine: &Map<String, Value>,
) -> Result<Value, ApiError> {
    let mut messages = Vec::new();
    if let Some(instructions) = echo.fields.get("instructions").filter(|v| !v.is_null()) {
        let Value::String(text) = instructions else {
            return Err(bad("`instructions` must be a string", "instructions"));
        };
        messages.push(json!({"role": "system", "content": text}));
    }
    for item in items {
        add_item(&mut messages, item)?;
    }
    let mut chat = json!({
        "model": echo.model,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let fields = &echo.fields;
    let map = chat
        .as_object_mut()
        .ok_or_else(|| bad("internal", "input"))?;
    if let Some(max) = fields.get("max_output_tokens").filter(|v| !v.is_null()) {
        map.insert("max_tokens".into(), max.clone());
    }
    for key in ["temperature", "top_p", "parallel_tool_calls", "user"] {
        if let Some(value) = fields.get(key).filter(|v| !v.is_null()) {
            map.insert(key.into(), value.clone());
        }
    }
    if let Some(tools) = fields.get("tools").filter(|v| !v.is_null()) {
        map.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = fields.get("tool_choice").filter(|v| !v.is_null()) {
        map.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    if let Some(format) = fields.get("text").and_then(|t| t.get("format")) {
        if let Some(response_format) = chat_response_format(format)? {
            map.insert("response_format".into(), response_format);
        }
    }
    if let Some(effort) = fields.get("reasoning").and_then(|r| r.get("effort")) {
        if !effort.is_null() {
            map.insert("reasoning_effort".into(), effort.clone());
        }
    }
    for (key, value) in engine {
        map.insert(key.clone(), value.clone());
    }
    Ok(chat)
}

/// The text of a content given as a string or as parts.
fn content_text(content: &Value, param: &'static str) -> Result<String, ApiError> {
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("input_text" | "output_text" | "text"), Some(Value::String(t))) => {
                        text.push_str(t)
                    }
                    (Some(kind), _) => {
                        return Err(bad(
                            format!("content parts of type `{kind}` are not served (text only)"),
                            param,
                        ))
                    }
                    (None, _) => return Err(bad("a content part needs a `type`", param)),
                }
            }
            Ok(text)
        }
        _ => Err(bad(
            "`content` must be a string or an array of parts",
            param,
        )),
    }
}

/// An input item as the chat reads it, and as the conversation keeps it for
/// the next turn: a message's text, a call's id, name and arguments, an
/// output's text. None for a reasoning item (chat templates drop it). What
/// no engine reads (a reasoning item's text, an item's other fields) is not
/// kept: only what reaches the engine, which the body's limit bounds.
fn canonical_item(item: &Value) -> Result<Option<Value>, ApiError> {
    let Some(object) = item.as_object() else {
        return Err(bad("every input item must be an object", "input"));
    };
    let field = |key: &str| object.get(key).and_then(Value::as_str);
    match object.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            let role = match field("role") {
                Some(role @ ("developer" | "system" | "user" | "assistant")) => role,
                _ => {
                    return Err(bad(
                        "a message item's `role` must be user, assistant, system or developer",
                        "input",
                    ))
                }
            };
            let content = object
                .get("content")
                .ok_or_else(|| bad("a message item needs `content`", "input"))?;
            Ok(Some(json!({"type": "message", "role": role,
                           "content": content_text(content, "input")?})))
        }
        Some("function_call") => {
            let (Some(call_id), Some(name)) = (field("call_id"), field("name")) else {
                return Err(bad(
                    "a function_call item needs `call_id` and `name`",
                    "input",
                ));
            };
            Ok(Some(
                json!({"type": "function_call", "call_id": call_id, "name": name,
                           "arguments": field("arguments").unwrap_or("{}")}),
            ))
        }
        Some("function_call_output") => {
            let Some(call_id) = field("call_id") else {
                return Err(bad("a function_call_output item needs `call_id`", "input"));
            };
            let output = match object.get("output") {
                Some(Value::String(text)) => text.clone(),
                Some(other @ Value::Array(_)) => content_text(other, "input")?,
                _ => return Err(bad("a function_call_output item needs `output`", "input")),
            };
            Ok(Some(
                json!({"type": "function_call_output", "call_id": call_id,
                           "output": output}),
            ))
        }
        // The model's reasoning of an earlier turn: chat templates drop it.
        Some("reasoning") => Ok(None),
        Some(other) => Err(bad(
            format!("input items of type `{other}` are not served"),
            "input",
        )),
    }
}

/// Appends one input item to the chat messages (checked again: a stored
/// conversation is read back from the store).
fn add_item(messages: &mut Vec<Value>, item: &Value) -> Result<(), ApiError> {
    let Some(item) = canonical_item(item)? else {
        return Ok(());
    };
    let text = |key: &str| item.get(key).and_then(Value::as_str).unwrap_or_default();
    match text("type") {
        "function_call" => {
            let call = json!({"id": text("call_id"), "type": "function",
                "function": {"name": text("name"), "arguments": text("arguments")}});
            // Calls made in one turn are one assistant message.
            let previous = messages.last_mut().filter(|m| {
                m["role"] == "assistant" && m.get("tool_calls").is_some() && m["content"].is_null()
            });
            match previous.and_then(|m| m["tool_calls"].as_array_mut()) {
                Some(calls) => calls.push(call),
                None => messages
                    .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => messages.push(
            json!({"role": "tool", "tool_call_id": text("call_id"), "content": text("output")}),
        ),
        _ => {
            let role = match text("role") {
                "developer" | "system" => "system",
                role => role,
            };
            messages.push(json!({"role": role, "content": text("content")}));
        }
    }
    Ok(())
}

/// Responses function tools (flat) as chat tools (nested under `function`).
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(tools) = tools else {
        return Err(bad("`tools` must be an array", "tools"));
    };
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("only function tools are served", "tools"));
        }
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return Err(bad("a function tool needs a `name`", "tools"));
        };
        let mut function = json!({"name": name});
        for key in ["description", "parameters", "strict"] {
            if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
                function[key] = value.clone();
            }
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(mode) if ["auto", "none", "required"].contains(&mode.as_str()) => {
            Ok(choice.clone())
        }
        Value::Object(named) if named.get("type").and_then(Value::as_str) == Some("function") => {
            match named.get("name").and_then(Value::as_str) {
                Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
                None => Err(bad("a function tool choice needs a `name`", "tool_choice")),
            }
        }
        _ => Err(bad(
            "`tool_choice` must be auto, none, required or a function",
            "tool_choice",
        )),
    }
}

/// `text.format` as chat's `response_format` (None for plain text).
fn chat_response_format(format: &Value) -> Result<Option<Value>, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        None | Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = json!({
                "name": format.get("name").cloned().unwrap_or(json!("response")),
                "schema": format.get("schema").cloned().unwrap_or(json!({})),
            });
            if let Some(strict) = format.get("strict") {
                schema["strict"] = strict.clone();
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        Some(other) => Err(bad(
            format!("`text.format` of type `{other}` is not served"),
            "text",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<Value, ApiError> {
        let checked = check(body.as_object().unwrap_or(&Map::new()))?;
        chat_body(&checked.echo, &checked.input, &checked.engine)
    }

    #[test]
    fn a_conversation_with_tool_calls_becomes_chat_messages() {
        let body = chat(json!({
            "model": "m", "instructions": "be brief", "max_output_tokens": 9,
            "reasoning": {"effort": "low"},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\":1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "developer", "content": "more"}
            ]
        }))
        .unwrap_or_default();
        assert_eq!(
            body["messages"],
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}
                ]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "system", "content": "more"}
            ])
        );
        assert_eq!(body["max_tokens"], 9);
        assert_eq!(body["reasoning_effort"], "low");
        assert_eq!(body["tools"][0]["function"]["name"], "f");
        assert_eq!(
            body["tool_choice"],
            json!({"type": "function", "function": {"name": "f"}})
        );
        assert_eq!(body["stream"], true);
    }

    #[test]
    fn input_items_are_kept_as_the_chat_reads_them() {
        let body = json!({"model": "m", "input": [
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x".repeat(1000)},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}], "extra": "y".repeat(1000)},
            {"type": "function_call", "call_id": "c1", "name": "f", "id": "fc_1"}
        ]});
        let items = check(body.as_object().unwrap_or(&Map::new()))
            .map(|checked| checked.input)
            .unwrap_or_default();
        assert_eq!(
            items,
            vec![
                json!({"type": "message", "role": "user", "content": "hi"}),
                json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
            ]
        );
    }

    #[test]
    fn vllms_own_fields_reach_the_chat_as_they_are() {
        let extras = json!({
            "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "seed": -3,
            "stop": ["END"], "stop_token_ids": [7], "ignore_eos": true,
            "include_stop_str_in_output": true, "skip_special_tokens": false,
            "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {"9": -1},
            "structured_outputs": {"regex": "a+"},
            "chat_template_kwargs": {"enable_thinking": false},
            "vllm_xargs": {"k": [1, "v"]}, "priority": 2, "cache_salt": "s",
            "session_id": "sess", "watermarking": false, "include_reasoning": false,
            "mm_processor_kwargs": {}, "media_io_kwargs": {}, "mm_payload": "none",
            "return_mm_kwargs": false
        });
        let mut body = json!({"model": "m", "input": "x", "enable_response_messages": false});
        for (key, value) in extras.as_object().unwrap_or(&Map::new()) {
            body[key] = value.clone();
        }
        let chat = chat(body.clone()).unwrap_or_default();
        for (key, value) in extras.as_object().unwrap_or(&Map::new()) {
            assert_eq!(&chat[key], value, "{key}: {chat}");
        }
        assert!(chat.get("enable_response_messages").is_none(), "{chat}");
        // Not repeated by the response object (vLLM's does not either).
        let checked = check(body.as_object().unwrap_or(&Map::new())).map_err(|e| e.to_string());
        let echo = checked.map(|c| c.echo);
        assert!(echo.as_ref().is_ok_and(|e| e.hide_reasoning), "{echo:?}");
        assert!(echo.is_ok_and(|e| !e.fields.contains_key("top_k")));
    }

    #[test]
    fn unknown_and_unserved_fields_are_refused_by_name() {
        for (body, said) in [
            (
                json!({"model": "m", "input": "x", "temprature": 1}),
                "temprature",
            ),
            (
                json!({"model": "m", "input": "x", "background": true, "store": false}),
                "background",
            ),
            (json!({"model": "m", "input": []}), "input"),
            (
                json!({"model": "m", "input": [{"type": "web_search_call"}]}),
                "web_search_call",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "file_search"}]}),
                "function tools",
            ),
            (json!({"input": "x"}), "model"),
            // vLLM's chat knows it, vLLM's Responses does not.
            (
                json!({"model": "m", "input": "x", "min_tokens": 2}),
                "min_tokens",
            ),
            (
                json!({"model": "m", "input": "x", "kv_transfer_params": {}}),
                "kv_transfer_params` is not taken from clients",
            ),
            (
                json!({"model": "m", "input": "x", "request_id": "r"}),
                "x-request-id",
            ),
            (
                json!({"model": "m", "input": "x", "previous_input_messages": []}),
                "harmony",
            ),
            (
                json!({"model": "m", "input": "x", "enable_response_messages": true}),
                "harmony",
            ),
            (
                json!({"model": "m", "input": "x", "structured_outputs": {"regex": "a"},
                       "text": {"format": {"type": "json_object"}}}),
                "cannot both",
            ),
            (
                json!({"model": "m", "input": "x", "chat_template_kwargs": "no"}),
                "chat_template_kwargs",
            ),
            (
                json!({"model": "m", "input": "x", "stop_token_ids": [-1]}),
                "stop_token_ids",
            ),
            // Not a response id's shape: it would name a key in the store.
            (
                json!({"model": "m", "input": "x", "previous_response_id": "resp_a}:stored"}),
                "previous_response_id",
            ),
            (
                json!({"model": "m", "input": "x", "previous_response_id": "r".repeat(129)}),
                "previous_response_id",
            ),
        ] {
            let error = chat(body.clone()).map(|_| ()).expect_err("refused");
            assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST);
            assert!(error.to_string().contains(said), "{body}: {error}");
        }
    }
}
