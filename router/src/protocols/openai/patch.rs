//! A request body for an engine: the client's JSON object with some keys
//! removed or replaced, written straight from the client's body. The body is
//! never cloned per phase (a prompt of token ids can be tens of MiB): each
//! phase's body is a [`Payload`] whose pieces are the few bytes written here
//! (the small fields and the replaced ones) between slices of the client's
//! own body buffer (its large fields, as it sent them), so every call to a
//! prefill or a decoder shares the one copy the session keeps.

use super::client_body::ClientBody;
use crate::engines::http::Payload;
use bytes::Bytes;
use serde::ser::{Serialize, SerializeSeq, Serializer};
use serde_json::{Map, Value};

/// A replaced value.
pub enum Set<'a> {
    Value(Value),
    /// Token ids: `first` then `then` (a resume's prompt + generated).
    Ids(&'a [u32], &'a [u32]),
}

/// The client's object with `remove` keys dropped and `set` keys replaced.
pub struct Patch<'a> {
    base: &'a Map<String, Value>,
    /// The body's large fields, written as the client sent them.
    raw: Vec<(&'a str, &'a Bytes)>,
    remove: &'a [&'a str],
    set: Vec<(&'static str, Set<'a>)>,
}

static EMPTY: std::sync::LazyLock<Map<String, Value>> = std::sync::LazyLock::new(Map::new);

impl<'a> Patch<'a> {
    /// A patch of a client's body.
    pub fn new(body: &'a ClientBody, remove: &'a [&'a str]) -> Self {
        Self {
            base: body.fields(),
            raw: body.raw_fields().map(|(k, v)| (k.as_str(), v)).collect(),
            remove,
            set: Vec::new(),
        }
    }

    /// A patch of a JSON object value (an engine's answer).
    pub fn of_value(body: &'a Value, remove: &'a [&'a str]) -> Self {
        Self {
            base: body.as_object().unwrap_or(&EMPTY),
            raw: Vec::new(),
            remove,
            set: Vec::new(),
        }
    }

    pub fn set(mut self, key: &'static str, value: Set<'a>) -> Self {
        self.set.retain(|(k, _)| *k != key);
        self.set.push((key, value));
        self
    }

    pub fn value(self, key: &'static str, value: Value) -> Self {
        self.set(key, Set::Value(value))
    }

    /// The body, in pieces: its large fields are the client's slices, shared.
    pub fn to_payload(&self) -> Payload {
        self.write().unwrap_or_default()
    }

    /// The body in one buffer (a copy of its large fields: for bodies without
    /// any, and tests).
    pub fn to_bytes(&self) -> Bytes {
        self.to_payload().to_bytes()
    }

    /// Writes the object as serde_json's compact form would: the kept
    /// fields, then the large ones, then the replaced ones. Writing JSON
    /// into a `Vec` fails only on a value that cannot be JSON (none here).
    fn write(&self) -> serde_json::Result<Payload> {
        let kept =
            |key: &str| !self.set.iter().any(|(k, _)| *k == key) && !self.remove.contains(&key);
        let mut payload = Payload::new();
        let mut out = vec![b'{'];
        let mut first = true;
        let mut key = |out: &mut Vec<u8>, key: &str| -> serde_json::Result<()> {
            if !std::mem::take(&mut first) {
                out.push(b',');
            }
            serde_json::to_writer(&mut *out, key)?;
            out.push(b':');
            Ok(())
        };
        for (name, value) in self.base {
            if kept(name) {
                key(&mut out, name)?;
                serde_json::to_writer(&mut out, value)?;
            }
        }
        for (name, raw) in &self.raw {
            if kept(name) {
                key(&mut out, name)?;
                payload.push(Bytes::from(std::mem::take(&mut out)));
                payload.push((*raw).clone());
            }
        }
        for (name, value) in &self.set {
            key(&mut out, name)?;
            serde_json::to_writer(&mut out, value)?;
        }
        out.push(b'}');
        payload.push(Bytes::from(out));
        Ok(payload)
    }
}

impl Serialize for Set<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Set::Value(value) => value.serialize(serializer),
            Set::Ids(first, then) => {
                let mut seq = serializer.serialize_seq(Some(first.len() + then.len()))?;
                for id in first.iter().chain(then.iter()) {
                    seq.serialize_element(id)?;
                }
                seq.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_removed_replaced_and_added_once() {
        let body = ClientBody::of(json!({"model": "m", "stream": false, "drop": 1, "prompt": "x"}));
        let bytes = Patch::new(&body, &["drop"])
            .value("stream", json!(true))
            .set("prompt", Set::Ids(&[1, 2], &[3]))
            .value("stream", json!(true))
            .to_bytes();
        let out: Value = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(
            out,
            json!({"model": "m", "stream": true, "prompt": [1, 2, 3]})
        );
        let text = String::from_utf8_lossy(&bytes);
        assert_eq!(text.matches("\"stream\"").count(), 1);
    }

    #[test]
    fn large_fields_are_written_as_the_client_sent_them() {
        let messages: Vec<Value> = (0..2_000)
            .map(|i| json!({"role": "user", "content": format!("m{i}")}))
            .collect();
        let sent = json!({"model": "m", "messages": messages, "drop": [1]});
        let body = ClientBody::parse(&Bytes::from(sent.to_string())).expect("body");
        assert!(body.raw("messages").is_some());
        let out: Value =
            serde_json::from_slice(&Patch::new(&body, &["drop"]).to_bytes()).expect("JSON");
        assert_eq!(out, json!({"model": "m", "messages": sent["messages"]}));
        let removed: Value =
            serde_json::from_slice(&Patch::new(&body, &["messages"]).to_bytes()).expect("JSON");
        assert_eq!(removed, json!({"model": "m", "drop": [1]}));
    }

    #[test]
    fn a_payload_shares_the_clients_large_fields_and_reads_as_serde_would_write_it() {
        let ids: Vec<u32> = (0..20_000).collect();
        let text = "y".repeat(40_000);
        let sent = json!({"model": "m", "prompt": ids, "suffix": text, "n": 2, "stop": "z"});
        let body = ClientBody::parse(&Bytes::from(sent.to_string())).expect("body");
        let patch = Patch::new(&body, &["stop"])
            .value("n", json!(1))
            .value("stream", json!(true));
        let payload = patch.to_payload();
        // The client's slices themselves are pieces of the payload.
        for key in ["prompt", "suffix"] {
            let raw = body.raw(key).expect("raw");
            assert!(
                payload.pieces().iter().any(|p| p.as_ptr() == raw.as_ptr()),
                "{key} copied"
            );
        }
        // The bytes are those of the whole object written by serde_json.
        let mut expected = sent.as_object().expect("object").clone();
        expected.remove("stop");
        expected.remove("n");
        let small: Map<String, Value> = expected
            .iter()
            .filter(|(k, _)| body.raw(k).is_none())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut written = serde_json::to_string(&small).expect("JSON");
        written.pop();
        for key in ["prompt", "suffix"] {
            written.push_str(&format!(",\"{key}\":{}", expected[key]));
        }
        written.push_str(",\"n\":1,\"stream\":true}");
        assert_eq!(payload.to_bytes(), Bytes::from(written));
        assert_eq!(payload.len(), payload.to_bytes().len());
    }
}
