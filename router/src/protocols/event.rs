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
pub struct Event {
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

impl Event {
    /// `body` as an event of type `kind` (its JSON has them: `type` and,
    /// where the protocol numbers its events, `sequence_number`).
    pub fn serialize(kind: &str, sequence: Option<u64>, body: &impl Serialize) -> Self {
        // Writing into a Vec fails only for a map with non-string keys,
        // which no event has.
        Self::write(kind, sequence, |json| {
            let _ = serde_json::to_writer(json, body);
        })
    }

    /// An event whose JSON `write_json` writes (its `type` and sequence
    /// number among it).
    pub fn write(kind: &str, sequence: Option<u64>, write_json: impl FnOnce(&mut Vec<u8>)) -> Self {
        let mut frame = Vec::with_capacity(kind.len() + 160);
        frame.extend_from_slice(b"event: ");
        frame.extend_from_slice(kind.as_bytes());
        frame.extend_from_slice(b"\ndata: ");
        let start = frame.len();
        write_json(&mut frame);
        let end = frame.len();
        frame.extend_from_slice(b"\n\n");
        Self {
            frame: frame.into(),
            data: start..end,
            sequence,
            carries_response: false,
        }
    }

    /// The same event, marked as carrying the whole response (its JSON's
    /// `response`).
    pub fn carrying_response(mut self) -> Self {
        self.carries_response = true;
        self
    }

    /// An event given as a JSON object with its `type`.
    pub fn from_value(value: &Value) -> Self {
        let kind = value["type"].as_str().unwrap_or("message");
        let mut event = Self::serialize(kind, value["sequence_number"].as_u64(), value);
        event.carries_response = value.get("response").is_some();
        event
    }

    /// An event from its JSON (as the shared store keeps it).
    pub fn parse(json: &[u8]) -> Result<Self, serde_json::Error> {
        let head: Head<'_> = serde_json::from_slice(json)?;
        let mut frame = Vec::with_capacity(json.len() + head.kind.len() + 16);
        frame.extend_from_slice(b"event: ");
        frame.extend_from_slice(head.kind.as_bytes());
        frame.extend_from_slice(b"\ndata: ");
        let start = frame.len();
        frame.extend_from_slice(json);
        let end = frame.len();
        frame.extend_from_slice(b"\n\n");
        Ok(Self {
            frame: frame.into(),
            data: start..end,
            sequence: head.sequence_number,
            carries_response: head.response.is_some(),
        })
    }

    pub fn sequence(&self) -> Option<u64> {
        self.sequence
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

/// `value` as JSON kept whole (a response or message as it is answered,
/// stored or embedded in an event: written once).
pub fn json_of(value: &impl Serialize) -> Box<RawValue> {
    // Fails only for a map with non-string keys, which none of these has.
    serde_json::value::to_raw_value(value).unwrap_or_else(|_| RawValue::NULL.to_owned())
}

/// Events as one SSE write (one event's frame as it is).
pub fn frames(events: &[Event]) -> bytes::Bytes {
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
        let event = Event::from_value(&value);
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
        let again = Event::parse(event.json()).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(again, event);
        let plain = Event::from_value(&json!({"type": "message_stop"}));
        assert_eq!((plain.sequence(), plain.response()), (None, None));
        assert!(Event::parse(b"{\"no type\": 1}").is_err());
    }
}
