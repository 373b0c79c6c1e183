//! One event of a translated protocol's stream (Responses, Messages),
//! serialized once, as it is made: its SSE frame (`event:` its type,
//! `data:` its JSON) goes to a streaming client as it is, and a background
//! response keeps the same bytes for its readers and the shared store.

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;
use std::borrow::Cow;
use std::ops::Range;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientEvent {
    /// `event: TYPE\ndata: JSON\n\n`.
    frame: bytes::Bytes,
    /// Where the JSON is in the frame.
    data: Range<usize>,
    /// Its `sequence_number` (Responses' events have one).
    sequence: Option<u64>,
    /// Whether it carries the whole response (`response.created`...): a
    /// background response's state follows it.
    carries_response: bool,
}

/// What a stored event's JSON says of itself.
#[derive(serde::Deserialize)]
struct Head<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    sequence_number: Option<u64>,
    #[serde(default)]
    response: Option<serde::de::IgnoredAny>,
}

impl ClientEvent {
    /// `body` as an event of type `kind` (its JSON has them: `type` and,
    /// where the protocol numbers its events, `sequence_number`).
    #[cfg(test)]
    pub fn serialize(kind: &str, sequence: Option<u64>, body: &impl Serialize) -> Self {
        Self::write(kind, sequence, |json| write_json(json, body))
    }

    /// An event whose JSON `write_json` writes (its `type` and sequence
    /// number among it).
    pub fn write(kind: &str, sequence: Option<u64>, write_json: impl FnOnce(&mut Vec<u8>)) -> Self {
        let mut frame = Vec::new();
        let data = write_frame(&mut frame, kind, write_json);
        Self {
            frame: frame.into(),
            data,
            sequence,
            carries_response: false,
        }
    }

    /// An event given as a JSON object with its `type`.
    pub fn from_value(value: &Value) -> Self {
        let (kind, sequence, carries_response) = head_of(value);
        let mut event = Self::write(kind, sequence, |json| write_json(json, value));
        event.carries_response = carries_response;
        event
    }

    /// An event from its JSON (as the shared store keeps it). The store is
    /// input: its bytes go into a client's SSE stream as they are, so its
    /// `type` must be a name (no line break or anything else that would end
    /// the `event:` line) and the JSON one line (its own `data:` line).
    pub fn parse(json: &[u8]) -> Result<Self, ParseError> {
        if json.iter().any(|b| matches!(b, b'\n' | b'\r')) {
            return Err(ParseError::LineBreak);
        }
        let head: Head<'_> = serde_json::from_slice(json)?;
        if !valid_kind(&head.kind) {
            return Err(ParseError::Kind(head.kind.len()));
        }
        let mut frame = Vec::new();
        let data = write_frame(&mut frame, &head.kind, |out| out.extend_from_slice(json));
        Ok(Self {
            frame: frame.into(),
            data,
            sequence: head.sequence_number,
            carries_response: head.response.is_some(),
        })
    }

    pub fn sequence(&self) -> Option<u64> {
        self.sequence
    }

    /// The bytes of its frame.
    pub fn frame_len(&self) -> usize {
        self.frame.len()
    }

    /// Its SSE frame, shared (a reader's copy is a reference).
    pub fn frame(&self) -> bytes::Bytes {
        self.frame.clone()
    }

    /// Its JSON.
    pub fn json(&self) -> &[u8] {
        &self.frame[self.data.clone()]
    }

    /// Its JSON as a value (tests, and the response an event carries).
    pub fn value(&self) -> Value {
        serde_json::from_slice(self.json()).unwrap_or_default()
    }

    /// The whole response it carries, if it carries one.
    pub fn response(&self) -> Option<Value> {
        if !self.carries_response {
            return None;
        }
        match self.value() {
            Value::Object(mut object) => object.remove("response"),
            _ => None,
        }
    }
}

/// Why bytes read back are not an event.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("an event is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("an event's JSON spans lines")]
    LineBreak,
    /// (Its length: the type itself is not repeated to anyone.)
    #[error("an event's type ({0} bytes) is not an event name")]
    Kind(usize),
}

/// Longest event type accepted back (the longest Responses one is 40).
const MAX_KIND_LEN: usize = 64;

/// Whether `kind` is an event name as the protocols write them (letters,
/// digits, `.`, `_`, `-`): safe on an SSE `event:` line.
fn valid_kind(kind: &str) -> bool {
    !kind.is_empty()
        && kind.len() <= MAX_KIND_LEN
        && kind
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Appends `event: KIND\ndata: JSON\n\n` to `frame` (`write_json` writes
/// the JSON); returns where the JSON is.
fn write_frame(
    frame: &mut Vec<u8>,
    kind: &str,
    write_json: impl FnOnce(&mut Vec<u8>),
) -> Range<usize> {
    // Most events are a delta: their frame fits.
    frame.reserve(kind.len() + 160);
    frame.extend_from_slice(b"event: ");
    frame.extend_from_slice(kind.as_bytes());
    frame.extend_from_slice(b"\ndata: ");
    let start = frame.len();
    write_json(frame);
    let end = frame.len();
    frame.extend_from_slice(b"\n\n");
    start..end
}

/// Where a translated request's events go, chosen once per request: to a
/// streaming client, into a background response's log (`Log`: the log, or
/// `()` where only the choice matters), or nowhere (a non-stream client gets
/// the whole answer, so its events are never written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination<Log = ()> {
    Client,
    Log(Log),
    Nowhere,
}

impl<Log> Destination<Log> {
    /// The choice alone.
    pub fn kind(&self) -> Destination {
        match self {
            Self::Client => Destination::Client,
            Self::Log(_) => Destination::Log(()),
            Self::Nowhere => Destination::Nowhere,
        }
    }
}

/// A translation's events as it makes them, written for their destination:
/// for a streaming client each event's frame appended, so that what one chat
/// chunk makes goes out as one write with no event kept; for a log each
/// event kept whole; for nowhere, nothing.
#[derive(Debug)]
pub struct EventWriter {
    to: Destination,
    frames: Vec<u8>,
    events: Vec<ClientEvent>,
}

impl EventWriter {
    pub fn new(to: Destination) -> Self {
        Self {
            to,
            frames: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Whether what it is given is written at all.
    pub fn writes(&self) -> bool {
        self.to != Destination::Nowhere
    }

    /// An event whose JSON `write_json` writes (its `type` and sequence
    /// number among it).
    pub fn write(
        &mut self,
        kind: &str,
        sequence: Option<u64>,
        write_json: impl FnOnce(&mut Vec<u8>),
    ) {
        self.add(kind, sequence, false, write_json);
    }

    /// `body` as an event of type `kind`.
    pub fn serialize(&mut self, kind: &str, sequence: Option<u64>, body: &impl Serialize) {
        self.add(kind, sequence, false, |json| write_json(json, body));
    }

    /// `body` as an event of type `kind` that carries the whole response.
    pub fn serialize_carrying_response(
        &mut self,
        kind: &str,
        sequence: u64,
        body: &impl Serialize,
    ) {
        self.add(kind, Some(sequence), true, |json| write_json(json, body));
    }

    /// An event given as a JSON object with its `type`.
    pub fn value(&mut self, value: &Value) {
        let (kind, sequence, carries_response) = head_of(value);
        self.add(kind, sequence, carries_response, |json| {
            write_json(json, value)
        });
    }

    fn add(
        &mut self,
        kind: &str,
        sequence: Option<u64>,
        carries_response: bool,
        write_json: impl FnOnce(&mut Vec<u8>),
    ) {
        match self.to {
            Destination::Client => {
                write_frame(&mut self.frames, kind, write_json);
            }
            Destination::Log(()) => {
                let mut event = ClientEvent::write(kind, sequence, write_json);
                event.carries_response = carries_response;
                self.events.push(event);
            }
            Destination::Nowhere => {}
        }
    }

    /// The frames written for a client (none for another destination).
    pub fn into_frames(self) -> Vec<u8> {
        self.frames
    }

    /// The events written for a log (none for another destination).
    pub fn into_events(self) -> Vec<ClientEvent> {
        self.events
    }
}

/// An event's type, sequence number and whether it carries the whole
/// response, from its JSON object.
fn head_of(value: &Value) -> (&str, Option<u64>, bool) {
    let kind = value["type"].as_str().unwrap_or("message");
    (
        kind,
        value["sequence_number"].as_u64(),
        value.get("response").is_some(),
    )
}

/// `body`'s JSON appended to `json`.
fn write_json(json: &mut Vec<u8>, body: &impl Serialize) {
    // Writing into a Vec fails only for a map with non-string keys, which
    // no event has.
    let _ = serde_json::to_writer(json, body);
}

/// `value` as JSON kept whole (a response or message as it is answered,
/// stored or embedded in an event: written once).
pub fn json_of(value: &impl Serialize) -> Box<RawValue> {
    // Fails only for a map with non-string keys, which none of these has.
    serde_json::value::to_raw_value(value).unwrap_or_else(|_| RawValue::NULL.to_owned())
}

/// Events as one SSE write (one event's frame as it is).
pub fn frames(events: &[ClientEvent]) -> bytes::Bytes {
    if let [one] = events {
        return one.frame.clone();
    }
    let mut out = Vec::with_capacity(events.iter().map(|e| e.frame.len()).sum());
    for event in events {
        out.extend_from_slice(&event.frame);
    }
    out.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_event_is_framed_once_and_read_back_from_its_json() {
        let value = json!({"type": "response.created", "sequence_number": 3,
                           "response": {"id": "resp_1"}});
        let event = ClientEvent::from_value(&value);
        let framed = frames(std::slice::from_ref(&event));
        let text = std::str::from_utf8(&framed).unwrap_or_default();
        assert!(
            text.starts_with("event: response.created\ndata: {"),
            "{text}"
        );
        assert!(text.ends_with("}\n\n"), "{text}");
        assert_eq!(event.sequence(), Some(3));
        assert_eq!(event.value(), value);
        assert_eq!(event.response(), Some(json!({"id": "resp_1"})));
        let again = ClientEvent::parse(event.json()).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(again, event);
        let plain = ClientEvent::from_value(&json!({"type": "message_stop"}));
        assert_eq!((plain.sequence(), plain.response()), (None, None));
        assert!(ClientEvent::parse(b"{\"no type\": 1}").is_err());
    }

    /// What the shared store hands back is input: a `type` that would end
    /// the `event:` line (and forge events of its own in a reader's stream)
    /// and JSON over several lines are refused, not framed.
    #[test]
    fn an_event_read_back_with_a_forged_type_or_lines_is_refused() {
        let forged = json!({"type": "x\ndata: {\"forged\": true}\n\nevent: response.completed",
                            "sequence_number": 1});
        let bytes = serde_json::to_vec(&forged).unwrap_or_default();
        assert!(matches!(
            ClientEvent::parse(&bytes),
            Err(ParseError::Kind(_))
        ));
        for kind in ["", "a b", "a:b", &"a".repeat(65)] {
            let bytes = serde_json::to_vec(&json!({"type": kind})).unwrap_or_default();
            assert!(ClientEvent::parse(&bytes).is_err(), "{kind:?}");
        }
        let split = b"{\"type\": \"x\",\n\n\"sequence_number\": 1}";
        assert!(matches!(
            ClientEvent::parse(split),
            Err(ParseError::LineBreak)
        ));
        // Every type the protocols write is a name.
        for kind in [
            "response.output_text.delta",
            "message_stop",
            "error",
            "response.mcp_call.in-progress",
        ] {
            let bytes = serde_json::to_vec(&json!({"type": kind})).unwrap_or_default();
            assert!(ClientEvent::parse(&bytes).is_ok(), "{kind}");
        }
    }

    #[test]
    fn a_client_gets_the_frames_of_the_events_kept_and_nowhere_writes_none() {
        let events = [
            json!({"type": "response.created", "sequence_number": 0, "response": {"id": "r"}}),
            json!({"type": "response.output_text.delta", "sequence_number": 1, "delta": "a\n"}),
        ];
        let (mut frames_out, mut kept, mut nowhere) = (
            EventWriter::new(Destination::Client),
            EventWriter::new(Destination::Log(())),
            EventWriter::new(Destination::Nowhere),
        );
        let mut written = false;
        for out in [&mut frames_out, &mut kept, &mut nowhere] {
            out.value(&events[0]);
            out.write("response.output_text.delta", Some(1), |json| {
                written = true;
                write_json(json, &events[1]);
            });
        }
        assert!(written);
        let kept = kept.into_events();
        assert_eq!(kept.len(), 2);
        assert_eq!(kept[0].response(), Some(json!({"id": "r"})));
        assert_eq!(kept[1].sequence(), Some(1));
        assert_eq!(
            frames_out.into_frames(),
            frames(&kept),
            "the same bytes either way"
        );
        assert!(!nowhere.writes());
        assert!(nowhere.into_events().is_empty());
        let mut skipped = EventWriter::new(Destination::Nowhere);
        skipped.write("x", None, |_| panic!("nothing is written for nowhere"));
    }
}
