//! A chat completion's stream cut into segments: the reasoning, the text and
//! each tool call, in the order the model produced them, each opened, grown
//! by deltas and closed with its whole text. Responses' output items and
//! Messages' content blocks are these segments in their own wire formats.

use crate::protocols::openai::chunk::Chunk;
use serde_json::Value;

/// What a segment is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Segment {
    Reasoning,
    Text,
    /// A tool call: chat's index of it, its id and function name.
    Call {
        chat_index: u64,
        call_id: String,
        name: String,
    },
}

/// One step of the segments (a delta borrowed from its chunk: one per
/// token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<'a> {
    Open(Segment),
    /// More of the open segment (a tool call's: more of its arguments).
    Delta(&'a str),
    /// The open segment ended; its whole text (a call's: its arguments).
    Close(Segment, String),
}

/// The segmenter of one chat stream (its first choice: these protocols have
/// no `n`), and what the chat said of its end.
/// Serializable: a background response's checkpoint carries it to the replica
/// that takes the generation over.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Segmenter {
    open: Option<(Segment, String)>,
    /// Chat's `finish_reason`, and its `stop_reason` (the stop string matched).
    pub finish_reason: Option<String>,
    pub stop_reason: Option<Value>,
    /// The chat's usage (the router's count), set by the protocol once the
    /// chat ended: kept here, with the rest of the chat's end, because a
    /// background response's checkpoint carries the segmenter.
    pub usage: Option<Value>,
}

impl Segmenter {
    /// The steps of one chat chunk, as the relay parsed it (a resumed chat's
    /// completions chunk brings its text as `text`).
    pub fn chunk<'c>(&mut self, chunk: &'c Chunk<'_>) -> Vec<Step<'c>> {
        let mut steps = Vec::new();
        let Some(choice) = chunk.choices.first() else {
            return steps;
        };
        let delta = choice.delta.as_ref();
        let reasoning = delta
            .and_then(|d| d.reasoning.as_deref().or(d.reasoning_content.as_deref()))
            .unwrap_or_default();
        if !reasoning.is_empty() {
            self.grow(&mut steps, Segment::Reasoning, reasoning);
        }
        let text = choice.text();
        if !text.is_empty() {
            self.grow(&mut steps, Segment::Text, text);
        }
        for call in delta
            .and_then(|d| d.tool_calls.as_ref())
            .into_iter()
            .flatten()
        {
            let chat_index = call.index as u64;
            let same = matches!(&self.open,
                Some((Segment::Call { chat_index: open, .. }, _)) if *open == chat_index);
            let segment = if same {
                self.open
                    .as_ref()
                    .map(|(s, _)| s.clone())
                    .unwrap_or(Segment::Text)
            } else {
                Segment::Call {
                    chat_index,
                    call_id: call.id.as_deref().unwrap_or_default().to_string(),
                    name: call
                        .function
                        .name
                        .as_deref()
                        .unwrap_or_default()
                        .to_string(),
                }
            };
            let piece = call.function.arguments.as_deref().unwrap_or_default();
            self.grow(&mut steps, segment, piece);
        }
        if let Some(reason) = &choice.finish_reason {
            self.finish_reason = Some(reason.to_string());
            self.stop_reason = choice
                .stop_reason
                .and_then(|r| serde_json::from_str::<Value>(r.get()).ok())
                .filter(|r| !r.is_null());
        }
        steps
    }

    /// Opens `segment` unless it is the open one, then adds `piece` to it.
    fn grow<'c>(&mut self, steps: &mut Vec<Step<'c>>, segment: Segment, piece: &'c str) {
        if self.open.as_ref().is_none_or(|(open, _)| *open != segment) {
            self.close(steps);
            steps.push(Step::Open(segment.clone()));
            self.open = Some((segment, String::new()));
        }
        if let (false, Some((_, text))) = (piece.is_empty(), &mut self.open) {
            text.push_str(piece);
            steps.push(Step::Delta(piece));
        }
    }

    fn close(&mut self, steps: &mut Vec<Step<'_>>) {
        if let Some((segment, text)) = self.open.take() {
            steps.push(Step::Close(segment, text));
        }
    }

    /// The last steps: the open segment closed.
    pub fn end(&mut self) -> Vec<Step<'static>> {
        let mut steps = Vec::new();
        self.close(&mut steps);
        steps
    }
}

/// Runs `f` on a chat chunk given as a JSON value, parsed as the relay
/// parses it (tests write their chunks with `json!`).
#[cfg(test)]
pub fn with_parsed<R>(chunk: &Value, f: impl FnOnce(&Chunk<'_>) -> R) -> R {
    let data = serde_json::to_vec(chunk).unwrap_or_default();
    let parsed = crate::protocols::openai::chunk::parse(&data)
        .unwrap_or_else(|| panic!("not a chat chunk: {chunk}"));
    f(&parsed)
}

/// A chat delta opening tool call `index`: its `id`, its function's `name`
/// and the first piece of its `arguments`.
#[cfg(test)]
pub fn call_opens(index: u32, id: &str, name: &str, arguments: &str) -> Value {
    serde_json::json!({"tool_calls": [{"index": index, "id": id,
        "function": {"name": name, "arguments": arguments}}]})
}

/// A chat delta adding `arguments` to tool call `index`.
#[cfg(test)]
pub fn call_grows(index: u32, arguments: &str) -> Value {
    serde_json::json!({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
}

/// The `key` of each event of type `kind`, in order: the indices a client
/// reads its stream's blocks or items by.
#[cfg(test)]
pub fn indices_of(events: &[Value], kind: &str, key: &str) -> Vec<u64> {
    events
        .iter()
        .filter(|e| e["type"] == kind)
        .filter_map(|e| e[key].as_u64())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chunk(delta: Value, finish: Option<&str>) -> Value {
        json!({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    }

    /// Steps as they print (a delta borrows its chunk, which a test's
    /// chunk does not outlive).
    fn seen(steps: &[Step<'_>]) -> Vec<String> {
        steps.iter().map(|step| format!("{step:?}")).collect()
    }

    #[test]
    fn reasoning_text_and_calls_open_grow_and_close_in_order() {
        let mut s = Segmenter::default();
        let mut steps = Vec::new();
        for c in [
            chunk(json!({"role": "assistant", "content": ""}), None),
            chunk(json!({"reasoning": "hm"}), None),
            chunk(json!({"content": "Hi"}), None),
            chunk(call_opens(0, "a", "f", "{"), None),
            chunk(call_grows(0, "}"), None),
            chunk(call_opens(1, "b", "g", ""), Some("tool_calls")),
        ] {
            steps.extend(with_parsed(&c, |c| seen(&s.chunk(c))));
        }
        steps.extend(seen(&s.end()));
        let a = Segment::Call {
            chat_index: 0,
            call_id: "a".into(),
            name: "f".into(),
        };
        let b = Segment::Call {
            chat_index: 1,
            call_id: "b".into(),
            name: "g".into(),
        };
        assert_eq!(
            steps,
            seen(&[
                Step::Open(Segment::Reasoning),
                Step::Delta("hm"),
                Step::Close(Segment::Reasoning, "hm".into()),
                Step::Open(Segment::Text),
                Step::Delta("Hi"),
                Step::Close(Segment::Text, "Hi".into()),
                Step::Open(a.clone()),
                Step::Delta("{"),
                Step::Delta("}"),
                Step::Close(a, "{}".into()),
                Step::Open(b.clone()),
                Step::Close(b, String::new()),
            ])
        );
        assert_eq!(s.finish_reason.as_deref(), Some("tool_calls"));
    }

    #[test]
    fn nulls_where_chat_chunks_may_have_them_read_as_absent() {
        let mut s = Segmenter::default();
        let data = br#"{"choices": [{"index": 0, "delta": {"content": "a\"b", "reasoning": null,
                "tool_calls": [{"index": null, "id": "c", "function": null}]},
                "finish_reason": null}], "usage": null}"#;
        let chunk =
            crate::protocols::openai::chunk::parse(data).unwrap_or_else(|| panic!("not parsed"));
        let steps = s.chunk(&chunk);
        assert_eq!(steps[1], Step::Delta("a\"b"));
    }

    #[test]
    fn a_resumed_chats_completions_text_is_its_text() {
        let mut s = Segmenter::default();
        let steps = with_parsed(
            &json!({"choices": [{"index": 0, "text": "go on", "finish_reason": "length"}]}),
            |c| seen(&s.chunk(c)),
        );
        assert_eq!(
            steps,
            seen(&[Step::Open(Segment::Text), Step::Delta("go on")])
        );
        assert_eq!(s.finish_reason.as_deref(), Some("length"));
    }
}
