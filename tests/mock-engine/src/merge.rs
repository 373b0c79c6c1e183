//! Several token chunks merged into one, as vLLM's API server merges a
//! request's outputs when it lags behind its engine (`--tokens-per-chunk`):
//! text and token ids concatenated, logprobs joined, the last chunk's finish.

use serde_json::Value;

/// The one chunk of a stream event that carries choices, if `event` is just
/// that (`data: {...}\n\n`): the events a merge may join. Tool-call deltas
/// are not joined (their arguments merge by index, which this does not do).
pub fn token_chunk(event: &[u8]) -> Option<Value> {
    let text = std::str::from_utf8(event).ok()?;
    let json = text.strip_prefix("data: ")?.strip_suffix("\n\n")?;
    if json.contains("\n\n") {
        return None;
    }
    let chunk: Value = serde_json::from_str(json).ok()?;
    let choices = chunk.get("choices")?.as_array()?;
    let tool_calls = choices
        .iter()
        .any(|c| c.pointer("/delta/tool_calls").is_some());
    (!choices.is_empty() && chunk.get("usage").is_none() && !tool_calls).then_some(chunk)
}

/// `next` joined onto `merged`, choice by choice.
pub fn join(merged: &mut Value, next: &Value) {
    for key in ["system_fingerprint"] {
        if let Some(value) = next.get(key) {
            merged[key] = value.clone();
        }
    }
    let (Some(choices), Some(more)) = (
        merged.get_mut("choices").and_then(Value::as_array_mut),
        next.get("choices").and_then(Value::as_array),
    ) else {
        return;
    };
    for (choice, next) in choices.iter_mut().zip(more) {
        join_choice(choice, next);
    }
}

fn join_choice(choice: &mut Value, next: &Value) {
    append(choice, next, "text");
    append(choice, next, "token_ids");
    if let (Some(delta), Some(more)) = (choice.get_mut("delta"), next.get("delta")) {
        for key in ["content", "reasoning_content", "reasoning"] {
            append(delta, more, key);
        }
    }
    if let (Some(logprobs), Some(more)) = (choice.get_mut("logprobs"), next.get("logprobs")) {
        for key in [
            "content",
            "tokens",
            "token_logprobs",
            "top_logprobs",
            "text_offset",
        ] {
            append(logprobs, more, key);
        }
    }
    for key in ["finish_reason", "stop_reason"] {
        if let Some(value) = next.get(key) {
            choice[key] = value.clone();
        }
    }
}

/// `next[key]` joined onto `into[key]` (text appended, a list extended),
/// or set when `into` has none.
fn append(into: &mut Value, next: &Value, key: &str) {
    let Some(more) = next.get(key).filter(|m| !m.is_null()) else {
        return;
    };
    match (into.get_mut(key), more) {
        (Some(Value::String(text)), Value::String(more)) => text.push_str(more),
        (Some(Value::Array(list)), Value::Array(more)) => list.extend(more.iter().cloned()),
        (Some(Value::Null) | None, more) => into[key] = more.clone(),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn joins_text_ids_and_logprobs_and_takes_the_last_finish() {
        let event = |text: &str, id: u32, finish: Value| {
            format!(
                "data: {}\n\n",
                json!({"id": "x", "choices": [{"index": 0, "text": text, "token_ids": [id],
                    "logprobs": {"tokens": [text], "token_logprobs": [-1.0]},
                    "finish_reason": finish}]})
            )
        };
        let mut merged = token_chunk(event(" a", 1, Value::Null).as_bytes()).expect("chunk");
        join(
            &mut merged,
            &token_chunk(event(" b", 2, json!("length")).as_bytes()).expect("chunk"),
        );
        let choice = &merged["choices"][0];
        assert_eq!(choice["text"], " a b");
        assert_eq!(choice["token_ids"], json!([1, 2]));
        assert_eq!(choice["logprobs"]["tokens"], json!([" a", " b"]));
        assert_eq!(choice["finish_reason"], "length");
        assert!(token_chunk(b"data: [DONE]\n\n").is_none());
        let with_usage = format!("{}data: {{}}\n\n", event(" c", 3, Value::Null));
        assert!(token_chunk(with_usage.as_bytes()).is_none());
    }

    #[test]
    fn joins_what_the_first_chunk_lacked_and_leaves_tool_calls_alone() {
        let mut merged = json!({"choices": [{"index": 0, "delta": {"role": "assistant",
            "reasoning_content": "think"}}]});
        join(
            &mut merged,
            &json!({"choices": [{"index": 0, "delta": {"reasoning_content": "ing",
                "content": "Hi"}, "token_ids": [5]}]}),
        );
        let choice = &merged["choices"][0];
        assert_eq!(choice["delta"]["reasoning_content"], "thinking");
        assert_eq!(choice["delta"]["content"], "Hi");
        assert_eq!(choice["token_ids"], json!([5]));
        let tool = json!({"choices": [{"index": 0, "delta": {"tool_calls": []}}]});
        assert!(token_chunk(format!("data: {tool}\n\n").as_bytes()).is_none());
    }
}
