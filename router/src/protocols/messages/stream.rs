//! A chat completion's stream as Messages events (`message_start`, a
//! `content_block_start` / `_delta` / `_stop` run per thinking, text or
//! tool-use block, `message_delta` with the stop reason and usage,
//! `message_stop`), and the whole message they make.

use super::request::MessageEcho;
use crate::protocols::openai::chunk::Chunk;
use crate::protocols::segments::{Segment, Segmenter, Step};
use serde_json::{json, Value};

/// One message's events, built from its chat chunks.
#[derive(Debug)]
pub struct MessageEvents {
    id: String,
    echo: MessageEcho,
    segments: Segmenter,
    /// The finished content blocks.
    content: Vec<Value>,
    /// The block being streamed.
    open: Option<Segment>,
}

impl MessageEvents {
    pub fn new(id: String, echo: MessageEcho) -> Self {
        Self {
            id,
            echo,
            segments: Segmenter::default(),
            content: Vec::new(),
            open: None,
        }
    }

    fn usage(&self) -> Value {
        let usage = self.segments.usage.as_ref().unwrap_or(&Value::Null);
        let count = |key: &str| usage.get(key).and_then(Value::as_u64).unwrap_or(0);
        json!({"input_tokens": count("prompt_tokens"), "output_tokens": count("completion_tokens")})
    }

    /// The message as it stands.
    pub fn message(&self, stop: (Value, Value)) -> Value {
        json!({"id": self.id, "type": "message", "role": "assistant", "model": self.echo.model,
               "content": self.content, "stop_reason": stop.0, "stop_sequence": stop.1,
               "usage": self.usage()})
    }

    /// `message_start`.
    pub fn start(&mut self) -> Vec<Value> {
        let message = self.message((Value::Null, Value::Null));
        vec![json!({"type": "message_start", "message": message})]
    }

    /// The events of one chat chunk.
    pub fn chunk(&mut self, chunk: &Chunk<'_>) -> Vec<Value> {
        let steps = self.segments.chunk(chunk);
        self.render(steps)
    }

    fn render(&mut self, steps: Vec<Step<'_>>) -> Vec<Value> {
        let mut out = Vec::new();
        for step in steps {
            let index = self.content.len();
            match step {
                Step::Open(segment) => {
                    let block = match &segment {
                        Segment::Reasoning => {
                            json!({"type": "thinking", "thinking": "", "signature": ""})
                        }
                        Segment::Text => json!({"type": "text", "text": ""}),
                        Segment::Call { call_id, name, .. } => {
                            json!({"type": "tool_use", "id": call_id, "name": name, "input": {}})
                        }
                    };
                    out.push(json!({"type": "content_block_start", "index": index,
                                    "content_block": block}));
                    self.open = Some(segment);
                }
                Step::Delta(piece) => {
                    let delta = match &self.open {
                        Some(Segment::Reasoning) => {
                            json!({"type": "thinking_delta", "thinking": piece})
                        }
                        Some(Segment::Text) => json!({"type": "text_delta", "text": piece}),
                        Some(Segment::Call { .. }) => {
                            json!({"type": "input_json_delta", "partial_json": piece})
                        }
                        None => continue,
                    };
                    out.push(
                        json!({"type": "content_block_delta", "index": index, "delta": delta}),
                    );
                }
                Step::Close(segment, text) => {
                    if self.open.take().is_none() {
                        continue;
                    }
                    let block = match segment {
                        Segment::Reasoning => {
                            json!({"type": "thinking", "thinking": text, "signature": ""})
                        }
                        Segment::Text => json!({"type": "text", "text": text}),
                        Segment::Call { call_id, name, .. } => {
                            // Arguments that are not a JSON object (a call cut at
                            // max_tokens) stay visible as they are.
                            let input = serde_json::from_str::<Value>(&text)
                                .ok()
                                .filter(Value::is_object)
                                .unwrap_or_else(|| json!({"_raw_arguments": text}));
                            json!({"type": "tool_use", "id": call_id, "name": name, "input": input})
                        }
                    };
                    out.push(json!({"type": "content_block_stop", "index": index}));
                    self.content.push(block);
                }
            }
        }
        out
    }

    /// Anthropic's stop reason and stop sequence of the chat's end.
    fn stop(&self) -> (Value, Value) {
        let sequence = self.segments.stop_reason.clone().filter(Value::is_string);
        match self.segments.finish_reason.as_deref() {
            Some("length") => (json!("max_tokens"), Value::Null),
            Some("tool_calls") => (json!("tool_use"), Value::Null),
            _ if sequence.is_some() => (json!("stop_sequence"), sequence.unwrap_or_default()),
            _ if self.content.iter().any(|b| b["type"] == "tool_use") => {
                (json!("tool_use"), Value::Null)
            }
            _ => (json!("end_turn"), Value::Null),
        }
    }

    /// The last events (`message_delta`, `message_stop`) and the whole
    /// message, with `usage` (the chat's).
    pub fn finish(&mut self, usage: Value) -> (Vec<Value>, Value) {
        self.segments.usage = Some(usage);
        let steps = self.segments.end();
        let mut out = self.render(steps);
        let stop = self.stop();
        out.push(json!({"type": "message_delta",
            "delta": {"stop_reason": stop.0, "stop_sequence": stop.1}, "usage": self.usage()}));
        out.push(json!({"type": "message_stop"}));
        (out, self.message(stop))
    }

    /// The last event of a chat that failed (`error`), and the message so far.
    pub fn fail(&mut self, error: &Value) -> (Vec<Value>, Value) {
        let steps = self.segments.end();
        let mut out = self.render(steps);
        let message = error["message"].as_str().unwrap_or("the generation failed");
        out.push(json!({"type": "error", "error": {"type": "api_error", "message": message}}));
        (out, self.message((Value::Null, Value::Null)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::segments::{call_grows, call_opens, indices_of, with_parsed};

    fn chunk(delta: Value, finish: Option<&str>) -> Value {
        json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }

    fn run() -> (Vec<Value>, Value) {
        let echo = MessageEcho {
            model: "m".into(),
            stream: true,
        };
        let mut events = MessageEvents::new("msg_1".into(), echo);
        let mut all = events.start();
        for c in [
            chunk(json!({"reasoning": "hm"}), None),
            chunk(json!({"content": "Hi"}), None),
            chunk(call_opens(0, "call_1", "f", "{\"a\":"), None),
            chunk(call_grows(0, " 1}"), Some("tool_calls")),
        ] {
            all.extend(with_parsed(&c, |c| events.chunk(c)));
        }
        let (last, message) = events.finish(json!({"prompt_tokens": 3, "completion_tokens": 5}));
        all.extend(last);
        (all, message)
    }

    #[test]
    fn thinking_text_and_a_tool_use_stream_as_blocks() {
        let (events, message) = run();
        let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(kinds[0], "message_start");
        assert_eq!(&kinds[kinds.len() - 2..], ["message_delta", "message_stop"]);
        assert_eq!(
            kinds
                .iter()
                .filter(|k| **k == "content_block_start")
                .count(),
            3
        );
        assert_eq!(
            kinds.iter().filter(|k| **k == "content_block_stop").count(),
            3
        );
        assert_eq!(
            message["content"][0],
            json!({"type": "thinking", "thinking": "hm", "signature": ""})
        );
        assert_eq!(message["content"][1], json!({"type": "text", "text": "Hi"}));
        assert_eq!(message["content"][2]["input"], json!({"a": 1}));
        assert_eq!(message["content"][2]["id"], "call_1");
        assert_eq!(message["stop_reason"], "tool_use");
        assert_eq!(
            message["usage"],
            json!({"input_tokens": 3, "output_tokens": 5})
        );
        // Block indices count the shown blocks.
        let starts = indices_of(&events, "content_block_start", "index");
        assert_eq!(starts, [0, 1, 2]);
    }
}
