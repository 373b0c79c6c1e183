//! A chat completion's stream as Responses events: each chunk's reasoning,
//! text and tool-call deltas open, grow and close output items, every event
//! numbered (`sequence_number`), and the last one carries the whole response.

use super::new_id;
use super::output::{
    function_call_item, message_item, reasoning_item, status_of, usage, ResponseObject,
};
use super::request::ResponseEcho;
use crate::protocols::client_event::{json_of, EventWriter};
use crate::protocols::openai::chunk::Chunk;
use crate::protocols::segments::{Segment, Segmenter, Step};
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// One response's events, built from its chat chunks. Serializable: a
/// background response's checkpoint carries it to the replica that takes the
/// generation over, which goes on numbering from where it stopped.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ResponseEvents {
    id: String,
    created_at: u64,
    echo: ResponseEcho,
    sequence: u64,
    items: Vec<Value>,
    segments: Segmenter,
    /// The item being streamed: its id and segment.
    open_id: String,
    open_segment: Option<Segment>,
    /// A reasoning segment is open that the response does not show
    /// (`include_reasoning: false`).
    #[serde(default)]
    hiding: bool,
}

impl ResponseEvents {
    pub fn new(id: String, created_at: u64, echo: ResponseEcho) -> Self {
        Self {
            id,
            created_at,
            echo,
            sequence: 0,
            items: Vec::new(),
            segments: Segmenter::default(),
            open_id: String::new(),
            open_segment: None,
            hiding: false,
        }
    }

    fn emit(&mut self, out: &mut EventWriter, kind: &str, mut event: Value) {
        event["type"] = Value::String(kind.to_string());
        event["sequence_number"] = self.next_sequence().into();
        out.value(&event);
    }

    /// `event` written with the next sequence number (every event's is
    /// one more than the last's).
    fn push(&mut self, out: &mut EventWriter, event: ItemEvent<'_>) {
        let event = ItemEvent {
            sequence_number: self.next_sequence(),
            ..event
        };
        out.serialize(event.kind, Some(event.sequence_number), &event);
    }

    /// An output item's `kind` event (added, done) with the whole item.
    fn push_item(&mut self, out: &mut EventWriter, kind: &str, index: usize, item: &Value) {
        self.push(
            out,
            ItemEvent {
                kind,
                output_index: index,
                item: Some(item),
                ..ItemEvent::default()
            },
        );
    }

    fn next_sequence(&mut self) -> u64 {
        self.sequence += 1;
        self.sequence - 1
    }

    /// The response object as it stands (`status` given).
    fn object<'a>(&'a self, status: &'a str, incomplete: &'a Value) -> ResponseObject<'a> {
        let usage = usage(self.segments.usage.as_ref().unwrap_or(&Value::Null));
        ResponseObject::new(
            &self.id,
            self.created_at,
            &self.echo,
            status,
            &self.items,
            usage,
            incomplete,
        )
    }

    /// The response as it stands (`status` given), as a JSON value.
    pub fn response(&self, status: &str, incomplete: Value) -> Value {
        self.object(status, &incomplete).value()
    }

    /// `response.created` and `response.in_progress` (the response written
    /// once for both).
    pub fn start(&mut self, out: &mut EventWriter) {
        let (created, in_progress) = (self.next_sequence(), self.next_sequence());
        if !out.writes() {
            return;
        }
        let now = json_of(&self.object("in_progress", &Value::Null));
        response_event(out, "response.created", created, &now);
        response_event(out, "response.in_progress", in_progress, &now);
    }

    /// The events of one chat chunk.
    pub fn chunk(&mut self, chunk: &Chunk<'_>, out: &mut EventWriter) {
        let steps = self.segments.chunk(chunk);
        self.render(steps, out);
    }

    fn render(&mut self, steps: Vec<Step<'_>>, out: &mut EventWriter) {
        for step in steps {
            if self.echo.hide_reasoning && self.hidden(&step) {
                continue;
            }
            let index = self.items.len();
            match step {
                Step::Open(segment) => self.open(out, index, &segment),
                Step::Delta(delta) => self.delta(out, index, delta),
                Step::Close(segment, text) => self.close(out, index, &segment, &text),
            }
        }
    }

    /// Whether `step` is one of a reasoning segment's, which a response that
    /// hides reasoning makes no events of (the segmenter opens one segment
    /// at a time: a delta is the open one's).
    fn hidden(&mut self, step: &Step<'_>) -> bool {
        match step {
            Step::Open(Segment::Reasoning) => {
                self.hiding = true;
                true
            }
            Step::Close(Segment::Reasoning, _) => {
                self.hiding = false;
                true
            }
            Step::Delta(_) => self.hiding,
            _ => false,
        }
    }

    fn current(&self) -> Option<&Segment> {
        // The segmenter's open segment is the item being streamed.
        self.open_segment.as_ref()
    }

    fn open(&mut self, out: &mut EventWriter, index: usize, segment: &Segment) {
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
        self.push_item(out, "response.output_item.added", index, &item);
        if let Some(part) = Part::of(segment, "") {
            self.push(
                out,
                ItemEvent {
                    kind: "response.content_part.added",
                    item_id: Some(&id),
                    output_index: index,
                    content_index: Some(0),
                    part: Some(part),
                    ..ItemEvent::default()
                },
            );
        }
        self.open_id = id;
        self.open_segment = Some(segment.clone());
    }

    /// One delta event (per token).
    fn delta(&mut self, out: &mut EventWriter, index: usize, delta: &str) {
        let (kind, content_index, logprobs) = match self.current() {
            Some(Segment::Reasoning) => ("response.reasoning_text.delta", Some(0), None),
            Some(Segment::Text) => ("response.output_text.delta", Some(0), Some([])),
            Some(Segment::Call { .. }) => ("response.function_call_arguments.delta", None, None),
            None => return,
        };
        let sequence_number = self.next_sequence();
        let event = ItemEvent {
            kind,
            sequence_number,
            item_id: Some(&self.open_id),
            output_index: index,
            content_index,
            delta: Some(delta),
            logprobs,
            ..ItemEvent::default()
        };
        event.write_delta(out);
    }

    /// Ends an item: its `.done` events, and it joins the output.
    fn close(&mut self, out: &mut EventWriter, index: usize, segment: &Segment, text: &str) {
        let id = std::mem::take(&mut self.open_id);
        self.open_segment = None;
        let done = ItemEvent {
            item_id: Some(&id),
            output_index: index,
            ..ItemEvent::default()
        };
        let item = match segment {
            Segment::Reasoning | Segment::Text => {
                let (kind, logprobs) = match segment {
                    Segment::Reasoning => ("response.reasoning_text.done", None),
                    _ => ("response.output_text.done", Some([])),
                };
                self.push(
                    out,
                    ItemEvent {
                        kind,
                        content_index: Some(0),
                        text: Some(text),
                        logprobs,
                        ..done
                    },
                );
                self.push(
                    out,
                    ItemEvent {
                        kind: "response.content_part.done",
                        content_index: Some(0),
                        part: Part::of(segment, text),
                        ..done
                    },
                );
                match segment {
                    Segment::Reasoning => reasoning_item(&id, text),
                    _ => message_item(&id, text),
                }
            }
            Segment::Call { call_id, name, .. } => {
                self.push(
                    out,
                    ItemEvent {
                        kind: "response.function_call_arguments.done",
                        name: Some(name),
                        arguments: Some(text),
                        ..done
                    },
                );
                function_call_item(&id, call_id, name, text)
            }
        };
        self.push_item(out, "response.output_item.done", index, &item);
        self.items.push(item);
    }

    /// The last events of a chat that ended (`usage`: the chat's): the open
    /// item closed, then `response.completed` with the whole response (also
    /// returned), whose
    /// status says `incomplete` when the chat stopped at its length. As vLLM's
    /// own stream ends, and what the OpenAI SDK's stream helper waits for.
    pub fn finish(&mut self, usage: Value, out: &mut EventWriter) -> Box<RawValue> {
        self.segments.usage = Some(usage);
        let steps = self.segments.end();
        self.render(steps, out);
        let (status, incomplete) = status_of(self.segments.finish_reason.as_deref());
        let sequence = self.next_sequence();
        let whole = json_of(&self.object(status, &incomplete));
        response_event(out, "response.completed", sequence, &whole);
        whole
    }

    /// The last events of a chat that failed: `error`, then `response.failed`.
    pub fn fail(&mut self, error: &Value, out: &mut EventWriter) -> Box<RawValue> {
        let steps = self.segments.end();
        self.render(steps, out);
        let message = error["message"].as_str().unwrap_or("the generation failed");
        let code = error.get("code").cloned().unwrap_or(Value::Null);
        self.emit(
            out,
            "error",
            json!({"code": code, "message": message, "param": null}),
        );
        let mut whole = self.response("failed", Value::Null);
        super::output::fail(&mut whole, message);
        let whole = json_of(&whole);
        let sequence = self.next_sequence();
        response_event(out, "response.failed", sequence, &whole);
        whole
    }

    /// The last events of a generation cancelled (`POST .../cancel`): the
    /// open item closed; the response's status `cancelled`, and no terminal
    /// event (the stream just ends, as vLLM's).
    pub fn cancel(&mut self, out: &mut EventWriter) -> Box<RawValue> {
        let steps = self.segments.end();
        self.render(steps, out);
        json_of(&self.object("cancelled", &Value::Null))
    }

    /// The response's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The output items so far (the finished ones).
    pub fn items(&self) -> &[Value] {
        &self.items
    }
}

/// An event of an output item (added, its part added, its deltas, its
/// `.done` events), serialized from borrowed fields: no JSON object is built
/// for it (deltas are per token, the rest per item).
#[derive(Default, serde::Serialize)]
struct ItemEvent<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    sequence_number: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    item_id: Option<&'a str>,
    output_index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    content_index: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<[u8; 0]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    part: Option<Part<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    item: Option<&'a Value>,
}

impl ItemEvent<'_> {
    /// A delta event, written by hand: one per token, and serde's writer
    /// checks every key it writes for characters to escape (`bench/run
    /// router_overhead` measured the serialized deltas at over a third of
    /// the Responses translation's own cost per token). The same JSON as
    /// its serialization (a test holds them equal).
    fn write_delta(&self, out: &mut EventWriter) {
        out.write(self.kind, Some(self.sequence_number), |json| {
            // Numbers and strings are written by serde_json (escaped).
            json.extend_from_slice(b"{\"type\":");
            let _ = serde_json::to_writer(&mut *json, self.kind);
            json.extend_from_slice(b",\"sequence_number\":");
            let _ = serde_json::to_writer(&mut *json, &self.sequence_number);
            if let Some(item_id) = self.item_id {
                json.extend_from_slice(b",\"item_id\":");
                let _ = serde_json::to_writer(&mut *json, item_id);
            }
            json.extend_from_slice(b",\"output_index\":");
            let _ = serde_json::to_writer(&mut *json, &self.output_index);
            if let Some(content_index) = self.content_index {
                json.extend_from_slice(b",\"content_index\":");
                let _ = serde_json::to_writer(&mut *json, &content_index);
            }
            json.extend_from_slice(b",\"delta\":");
            let _ = serde_json::to_writer(&mut *json, self.delta.unwrap_or_default());
            if self.logprobs.is_some() {
                json.extend_from_slice(b",\"logprobs\":[]");
            }
            json.push(b'}');
        })
    }
}

/// A reasoning or text item's content part.
#[derive(Clone, Copy, serde::Serialize)]
struct Part<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    text: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    annotations: Option<[u8; 0]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<[u8; 0]>,
}

impl<'a> Part<'a> {
    /// The part of `segment`'s item, with `text` (a call has none).
    fn of(segment: &Segment, text: &'a str) -> Option<Self> {
        let (kind, listed) = match segment {
            Segment::Reasoning => ("reasoning_text", None),
            Segment::Text => ("output_text", Some([])),
            Segment::Call { .. } => return None,
        };
        Some(Self {
            kind,
            text,
            annotations: listed,
            logprobs: listed,
        })
    }
}

/// An event carrying the whole response (written as it is: no copy of it).
fn response_event(out: &mut EventWriter, kind: &str, sequence_number: u64, response: &RawValue) {
    #[derive(serde::Serialize)]
    struct WithResponse<'a> {
        #[serde(rename = "type")]
        kind: &'a str,
        sequence_number: u64,
        response: &'a RawValue,
    }
    let body = WithResponse {
        kind,
        sequence_number,
        response,
    };
    out.serialize_carrying_response(kind, sequence_number, &body);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocols::client_event::{ClientEvent, Destination};
    use crate::protocols::segments::{call_grows, indices_of, with_parsed};
    use std::collections::BTreeMap;

    fn echo() -> ResponseEcho {
        ResponseEcho {
            model: "m".into(),
            stream: true,
            store: true,
            background: false,
            previous_response_id: None,
            fields: serde_json::Map::new(),
            hide_reasoning: false,
        }
    }

    fn chunk(delta: Value, finish: Option<&str>) -> Value {
        json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }

    #[test]
    fn reasoning_text_and_a_call_become_three_items_with_numbered_events() {
        let mut events = ResponseEvents::new("resp_1".into(), 7, echo());
        let mut out = EventWriter::new(Destination::Log(()));
        events.start(&mut out);
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
            chunk(call_grows(0, ": 1}"), Some("tool_calls")),
        ] {
            with_parsed(&c, |c| events.chunk(c, &mut out));
        }
        let usage = json!({"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11});
        let whole = events.finish(usage, &mut out);
        let whole: Value = serde_json::from_str(whole.get()).unwrap_or_default();
        let all: Vec<Value> = out.into_events().iter().map(ClientEvent::value).collect();
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
        let done = indices_of(&all, "response.output_item.done", "output_index");
        assert_eq!(done, [0, 1, 2]);
    }

    #[test]
    fn a_response_that_hides_reasoning_shows_only_the_rest() {
        let mut events = ResponseEvents::new(
            "resp_3".into(),
            7,
            ResponseEcho {
                hide_reasoning: true,
                ..echo()
            },
        );
        let mut out = EventWriter::new(Destination::Log(()));
        events.start(&mut out);
        for c in [
            chunk(json!({"role": "assistant", "reasoning": "hm"}), None),
            chunk(json!({"reasoning": "m"}), None),
            chunk(json!({"content": "Hi"}), Some("stop")),
        ] {
            with_parsed(&c, |c| events.chunk(c, &mut out));
        }
        let whole = events.finish(json!({}), &mut out);
        let whole: Value = serde_json::from_str(whole.get()).unwrap_or_default();
        let all: Vec<Value> = out.into_events().iter().map(ClientEvent::value).collect();
        let text = serde_json::to_string(&all).unwrap_or_default();
        for hidden in ["reasoning_text", "\"type\":\"reasoning\"", "hm"] {
            assert!(!text.contains(hidden), "{hidden}: {text}");
        }
        let numbers: Vec<u64> = all
            .iter()
            .filter_map(|e| e["sequence_number"].as_u64())
            .collect();
        assert_eq!(numbers, (0..all.len() as u64).collect::<Vec<_>>());
        assert_eq!(whole["output"].as_array().map(Vec::len), Some(1));
        assert_eq!(whole["output"][0]["content"][0]["text"], "Hi");
        assert_eq!(
            indices_of(&all, "response.output_item.done", "output_index"),
            [0]
        );
    }

    #[test]
    fn a_delta_is_written_as_it_serializes() {
        for (kind, content_index, logprobs) in [
            ("response.output_text.delta", Some(0), Some([])),
            ("response.reasoning_text.delta", Some(0), None),
            ("response.function_call_arguments.delta", None, None),
        ] {
            let event = ItemEvent {
                kind,
                sequence_number: 12,
                item_id: Some("msg_1"),
                output_index: 2,
                content_index,
                delta: Some("a \"quoted\"\n\u{1F600} piece"),
                logprobs,
                ..ItemEvent::default()
            };
            let mut written = EventWriter::new(Destination::Log(()));
            event.write_delta(&mut written);
            let written = written.into_events().remove(0);
            let serialized = ClientEvent::serialize(kind, Some(12), &event);
            assert_eq!(written.value(), serialized.value(), "{kind}");
            assert_eq!(written.json(), serialized.json(), "{kind}: the same bytes");
        }
    }

    #[test]
    fn a_chat_cut_at_its_length_is_incomplete() {
        let mut events = ResponseEvents::new("resp_2".into(), 7, echo());
        events.start(&mut EventWriter::new(Destination::Nowhere));
        with_parsed(&chunk(json!({"content": "abc"}), Some("length")), |c| {
            events.chunk(c, &mut EventWriter::new(Destination::Nowhere))
        });
        let mut last = EventWriter::new(Destination::Log(()));
        let whole = events.finish(json!({}), &mut last);
        let whole: Value = serde_json::from_str(whole.get()).unwrap_or_default();
        assert_eq!(
            last.into_events().last().map(|e| e.value()["type"].clone()),
            Some(json!("response.completed"))
        );
        assert_eq!(whole["status"], "incomplete");
        assert_eq!(whole["incomplete_details"]["reason"], "max_output_tokens");
    }
}
