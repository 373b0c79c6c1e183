//! A chat completion's stream as Responses events: each chunk's reasoning,
//! text and tool-call deltas open, grow and close output items, every event
//! numbered (`sequence_number`), and the last one carries the whole response.

use super::new_id;
use super::output::{
    function_call_item, message_item, reasoning_item, response, status_of, text_part, usage,
};
use super::request::Echo;
use crate::protocols::object_of;
use crate::protocols::segments::{ChatChunk, Segment, Segmenter, Step};
use serde_json::{json, Value};

/// A delta event of the open item: its type, and whether it has a
/// `content_index` and `logprobs`.
#[derive(Debug, Clone, Copy)]
struct DeltaShape {
    kind: &'static str,
    content_index: bool,
    logprobs: bool,
}

/// One response's events, built from its chat chunks. Serializable: a
/// background response's checkpoint carries it to the replica that takes the
/// generation over, which goes on numbering from where it stopped.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Events {
    id: String,
    created_at: u64,
    echo: Echo,
    sequence: u64,
    items: Vec<Value>,
    segments: Segmenter,
    /// The item being streamed: its id and segment.
    open_id: String,
    open_segment: Option<Segment>,
}

impl Events {
    pub fn new(id: String, created_at: u64, echo: Echo) -> Self {
        Self {
            id,
            created_at,
            echo,
            sequence: 0,
            items: Vec::new(),
            segments: Segmenter::default(),
            open_id: String::new(),
            open_segment: None,
        }
    }

    fn emit(&mut self, out: &mut Vec<Value>, kind: &str, mut event: Value) {
        event["type"] = Value::String(kind.to_string());
        event["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        out.push(event);
    }

    /// The response as it stands (`status` given).
    pub fn response(&self, status: &str, incomplete: Value) -> Value {
        let usage = usage(self.segments.usage.as_ref().unwrap_or(&Value::Null));
        response(
            &self.id,
            self.created_at,
            &self.echo,
            status,
            self.items.clone(),
            usage,
            incomplete,
        )
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        let now = self.response("in_progress", Value::Null);
        self.emit(
            &mut out,
            "response.created",
            object_of("response", now.clone()),
        );
        self.emit(&mut out, "response.in_progress", object_of("response", now));
        out
    }

    /// The events of one chat chunk.
    pub fn chunk(&mut self, chunk: &ChatChunk<'_>) -> Vec<Value> {
        let steps = self.segments.chunk(chunk);
        self.render(steps)
    }

    /// The events of one chat chunk as SSE into `out`: `chunk`'s events, but
    /// a delta (one per token: nearly every chunk) written straight from its
    /// parts, with no JSON value built and serialized.
    pub fn write_chunk(&mut self, chunk: &ChatChunk<'_>, out: &mut Vec<u8>) {
        for step in self.segments.chunk(chunk) {
            let index = self.items.len();
            match (step, self.delta_shape()) {
                (Step::Delta(delta), Some(shape)) => {
                    out.extend_from_slice(b"event: ");
                    out.extend_from_slice(shape.kind.as_bytes());
                    out.extend_from_slice(b"\ndata: ");
                    self.write_delta(out, shape, index, &delta);
                    out.extend_from_slice(b"\n\n");
                }
                (Step::Delta(_), None) => {}
                (step, _) => crate::protocols::sse::write_typed(out, &self.render(vec![step])),
            }
        }
    }

    fn render(&mut self, steps: Vec<Step>) -> Vec<Value> {
        let mut out = Vec::new();
        for step in steps {
            let index = self.items.len();
            match step {
                Step::Open(segment) => self.open(&mut out, index, &segment),
                Step::Delta(delta) => self.delta(&mut out, index, delta),
                Step::Close(segment, text) => self.close(&mut out, index, &segment, &text),
            }
        }
        out
    }

    fn current(&self) -> Option<&Segment> {
        // The segmenter's open segment is the item being streamed.
        self.open_segment.as_ref()
    }

    fn open(&mut self, out: &mut Vec<Value>, index: usize, segment: &Segment) {
        let (id, item) = match segment {
            Segment::Reasoning => {
                let id = new_id("rs");
                let item = json!({"type": "reasoning", "id": id, "summary": [], "content": [],
                                  "status": "in_progress"});
                (id, item)
            }
            Segment::Text => {
                let id = new_id("msg");
                let item = json!({"type": "message", "id": id, "status": "in_progress",
                                  "role": "assistant", "content": []});
                (id, item)
            }
            Segment::Call { call_id, name, .. } => {
                let id = new_id("fc");
                let mut item = function_call_item(&id, call_id, name, "");
                item["status"] = json!("in_progress");
                (id, item)
            }
        };
        self.emit(
            out,
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        let part = match segment {
            Segment::Reasoning => Some(json!({"type": "reasoning_text", "text": ""})),
            Segment::Text => Some(text_part("")),
            Segment::Call { .. } => None,
        };
        if let Some(part) = part {
            self.emit(
                out,
                "response.content_part.added",
                json!({"item_id": id,
                "output_index": index, "content_index": 0, "part": part}),
            );
        }
        self.open_id = id;
        self.open_segment = Some(segment.clone());
    }

    /// One delta event as a JSON value: the one `write_delta` writes, read
    /// back (the events kept of a background response, and a non-stream
    /// answer's, which never go out one by one).
    fn delta(&mut self, out: &mut Vec<Value>, index: usize, delta: String) {
        let Some(shape) = self.delta_shape() else {
            return;
        };
        let mut written = Vec::with_capacity(128 + delta.len());
        self.write_delta(&mut written, shape, index, &delta);
        match serde_json::from_slice(&written) {
            Ok(event) => out.push(event),
            Err(err) => tracing::error!(%err, "a delta event written as no JSON"),
        }
    }

    /// What a delta of the open item looks like; None when none is open.
    fn delta_shape(&self) -> Option<DeltaShape> {
        let (kind, content_index, logprobs) = match self.current()? {
            Segment::Reasoning => ("response.reasoning_text.delta", true, false),
            Segment::Text => ("response.output_text.delta", true, true),
            Segment::Call { .. } => ("response.function_call_arguments.delta", false, false),
        };
        Some(DeltaShape {
            kind,
            content_index,
            logprobs,
        })
    }

    /// Writes one delta event (its JSON object) into `out` and numbers it:
    /// per token, so from its parts, nothing allocated but `out`'s growth.
    fn write_delta(&mut self, out: &mut Vec<u8>, shape: DeltaShape, index: usize, delta: &str) {
        use std::io::Write;
        // Writing into a Vec cannot fail.
        let _ = write!(
            out,
            r#"{{"type":"{}","sequence_number":{},"item_id":"#,
            shape.kind, self.sequence
        );
        let _ = serde_json::to_writer(&mut *out, &self.open_id);
        let _ = write!(out, r#","output_index":{index}"#);
        if shape.content_index {
            out.extend_from_slice(br#","content_index":0"#);
        }
        out.extend_from_slice(br#","delta":"#);
        let _ = serde_json::to_writer(&mut *out, delta);
        if shape.logprobs {
            out.extend_from_slice(br#","logprobs":[]"#);
        }
        out.push(b'}');
        self.sequence += 1;
    }

    /// Ends an item: its `.done` events, and it joins the output.
    fn close(&mut self, out: &mut Vec<Value>, index: usize, segment: &Segment, text: &str) {
        let id = std::mem::take(&mut self.open_id);
        self.open_segment = None;
        let item = match segment {
            Segment::Reasoning => {
                self.emit(
                    out,
                    "response.reasoning_text.done",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0, "text": text}),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0,
                    "part": {"type": "reasoning_text", "text": text}}),
                );
                reasoning_item(&id, text)
            }
            Segment::Text => {
                self.emit(
                    out,
                    "response.output_text.done",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0, "part": text_part(text)}),
                );
                message_item(&id, text)
            }
            Segment::Call { call_id, name, .. } => {
                self.emit(
                    out,
                    "response.function_call_arguments.done",
                    json!({"item_id": id,
                    "output_index": index, "name": name, "arguments": text}),
                );
                function_call_item(&id, call_id, name, text)
            }
        };
        self.emit(
            out,
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        self.items.push(item);
    }

    /// The last events of a chat that ended: the open item closed, then
    /// `response.completed` with the whole response (also returned), whose
    /// status says `incomplete` when the chat stopped at its length. As vLLM's
    /// own stream ends, and what the OpenAI SDK's stream helper waits for.
    pub fn finish(&mut self) -> (Vec<Value>, Value) {
        let steps = self.segments.end();
        let mut out = self.render(steps);
        let (status, incomplete) = status_of(self.segments.finish_reason.as_deref());
        let whole = self.response(status, incomplete);
        self.emit(
            &mut out,
            "response.completed",
            object_of("response", whole.clone()),
        );
        (out, whole)
    }

    /// The last events of a chat that failed: `error`, then `response.failed`.
    pub fn fail(&mut self, error: &Value) -> (Vec<Value>, Value) {
        let steps = self.segments.end();
        let mut out = self.render(steps);
        let message = error["message"].as_str().unwrap_or("the generation failed");
        let code = error.get("code").cloned().unwrap_or(Value::Null);
        self.emit(
            &mut out,
            "error",
            json!({"code": code, "message": message, "param": null}),
        );
        let mut whole = self.response("failed", Value::Null);
        super::output::fail(&mut whole, message);
        self.emit(
            &mut out,
            "response.failed",
            object_of("response", whole.clone()),
        );
        (out, whole)
    }

    /// The last events of a generation cancelled (`POST .../cancel`): the
    /// open item closed; the response's status `cancelled`, and no terminal
    /// event (the stream just ends, as vLLM's).
    pub fn cancel(&mut self) -> (Vec<Value>, Value) {
        let steps = self.segments.end();
        let out = self.render(steps);
        (out, self.response("cancelled", Value::Null))
    }

    /// The output items so far (the finished ones).
    pub fn items(&self) -> &[Value] {
        &self.items
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::segments::parsed;
    use std::collections::BTreeMap;

    fn echo() -> Echo {
        Echo {
            model: "m".into(),
            stream: true,
            store: true,
            background: false,
            previous_response_id: None,
            fields: serde_json::Map::new(),
        }
    }

    fn chunk(delta: Value, finish: Option<&str>) -> Value {
        json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }

    #[test]
    fn reasoning_text_and_a_call_become_three_items_with_numbered_events() {
        let mut events = Events::new("resp_1".into(), 7, echo());
        let mut all = events.start();
        for c in [
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"reasoning": "let me "}), None),
            chunk(json!({"reasoning": "think"}), None),
            chunk(json!({"content": "Hi"}), None),
            chunk(json!({"content": "!"}), None),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                "function": {"name": "f", "arguments": "{\"a\""}}]}),
                None,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
                Some("tool_calls"),
            ),
            json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}}),
        ] {
            all.extend(events.chunk(&parsed(&c)));
        }
        let (last, whole) = events.finish();
        all.extend(last);
        let numbers: Vec<u64> = all
            .iter()
            .filter_map(|e| e["sequence_number"].as_u64())
            .collect();
        assert_eq!(numbers, (0..all.len() as u64).collect::<Vec<_>>());
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for e in &all {
            *kinds
                .entry(e["type"].as_str().unwrap_or_default())
                .or_default() += 1;
        }
        assert_eq!(kinds["response.output_item.added"], 3);
        assert_eq!(kinds["response.output_item.done"], 3);
        assert_eq!(kinds["response.reasoning_text.delta"], 2);
        assert_eq!(kinds["response.output_text.delta"], 2);
        assert_eq!(kinds["response.function_call_arguments.delta"], 2);
        assert_eq!(
            all.last().map(|e| e["type"].clone()),
            Some(json!("response.completed"))
        );
        assert_eq!(whole["status"], "completed");
        assert_eq!(whole["output"][0]["content"][0]["text"], "let me think");
        assert_eq!(whole["output"][1]["content"][0]["text"], "Hi!");
        assert_eq!(whole["output"][2]["arguments"], "{\"a\": 1}");
        assert_eq!(whole["output"][2]["call_id"], "call_a");
        assert_eq!(whole["usage"]["output_tokens"], 6);
        // Each item's events name its output index.
        let done: Vec<u64> = all
            .iter()
            .filter(|e| e["type"] == "response.output_item.done")
            .filter_map(|e| e["output_index"].as_u64())
            .collect();
        assert_eq!(done, [0, 1, 2]);
    }

    /// An SSE stream's events as (type, event), every item id (`rs_`,
    /// `msg_`, `fc_`: each `Events` draws its own) as `ID`.
    fn read_sse(bytes: &[u8]) -> Vec<(String, Value)> {
        fn ids_out(value: &mut Value) {
            match value {
                Value::String(s) if ["rs_", "msg_", "fc_"].iter().any(|p| s.starts_with(p)) => {
                    *s = "ID".into()
                }
                Value::Array(items) => items.iter_mut().for_each(ids_out),
                Value::Object(map) => map.values_mut().for_each(ids_out),
                _ => {}
            }
        }
        let text = std::str::from_utf8(bytes).unwrap_or_else(|err| panic!("{err}"));
        let mut out = Vec::new();
        for frame in text.split_terminator("\n\n") {
            let (kind, data) = frame
                .strip_prefix("event: ")
                .and_then(|rest| rest.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not an SSE event: {frame:?}"));
            let mut event: Value =
                serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}"));
            ids_out(&mut event);
            out.push((kind.to_string(), event));
        }
        out
    }

    #[test]
    fn events_written_per_chunk_are_the_events_as_values() {
        let chunks = [
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"reasoning": "a \"quoted\"\n"}), None),
            chunk(json!({"reasoning": "think"}), None),
            chunk(json!({"content": "Hi"}), None),
            chunk(json!({"content": "\u{e9}!"}), None),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                "function": {"name": "f", "arguments": "{\"a\""}}]}),
                None,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
                Some("tool_calls"),
            ),
        ];
        let mut as_values = Events::new("resp_1".into(), 7, echo());
        let mut written = Events::new("resp_1".into(), 7, echo());
        let mut want = as_values.start();
        let mut out = Vec::new();
        crate::protocols::sse::write_typed(&mut out, &written.start());
        for c in &chunks {
            want.extend(as_values.chunk(&parsed(c)));
            written.write_chunk(&parsed(c), &mut out);
        }
        want.extend(as_values.finish().0);
        crate::protocols::sse::write_typed(&mut out, &written.finish().0);
        let want: Vec<(String, Value)> = read_sse(&{
            let mut bytes = Vec::new();
            crate::protocols::sse::write_typed(&mut bytes, &want);
            bytes
        });
        let got = read_sse(&out);
        assert_eq!(got.len(), 22, "{got:?}");
        assert_eq!(got, want);
        let deltas: Vec<&Value> = got
            .iter()
            .filter(|(kind, _)| kind.ends_with(".delta"))
            .map(|(_, event)| &event["delta"])
            .collect();
        assert_eq!(
            deltas,
            ["a \"quoted\"\n", "think", "Hi", "\u{e9}!", "{\"a\"", ": 1}"]
        );
    }

    #[test]
    fn a_chat_cut_at_its_length_is_incomplete() {
        let mut events = Events::new("resp_2".into(), 7, echo());
        events.start();
        events.chunk(&parsed(&chunk(json!({"content": "abc"}), Some("length"))));
        let (last, whole) = events.finish();
        assert_eq!(
            last.last().map(|e| e["type"].clone()),
            Some(json!("response.completed"))
        );
        assert_eq!(whole["status"], "incomplete");
        assert_eq!(whole["incomplete_details"]["reason"], "max_output_tokens");
    }
}
