//! A request body for an engine: the client's JSON object with some keys
//! removed or replaced, serialized straight from the client's body. The body is
//! never cloned per phase (a prompt of token ids can be tens of MiB as a JSON
//! tree); each phase writes its bytes from the one copy the session keeps.

use super::client_body::ClientBody;
use bytes::Bytes;
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::value::RawValue;
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
    raw: Vec<(&'a str, &'a RawValue)>,
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

    /// The serialized body.
    pub fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }
}

impl Serialize for Patch<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        let kept =
            |key: &str| !self.set.iter().any(|(k, _)| *k == key) && !self.remove.contains(&key);
        for (key, value) in self.base {
            if kept(key) {
                map.serialize_entry(key, value)?;
            }
        }
        for (key, value) in &self.raw {
            if kept(key) {
                map.serialize_entry(key, value)?;
            }
        }
        for (key, value) in &self.set {
            map.serialize_entry(key, value)?;
        }
        map.end()
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
        let body = ClientBody::parse(sent.to_string().as_bytes()).expect("body");
        assert!(body.raw("messages").is_some());
        let out: Value =
            serde_json::from_slice(&Patch::new(&body, &["drop"]).to_bytes()).expect("JSON");
        assert_eq!(out, json!({"model": "m", "messages": sent["messages"]}));
        let removed: Value =
            serde_json::from_slice(&Patch::new(&body, &["messages"]).to_bytes()).expect("JSON");
        assert_eq!(removed, json!({"model": "m", "drop": [1]}));
    }
}
