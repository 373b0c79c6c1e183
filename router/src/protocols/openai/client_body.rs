//! A client's request body as the router keeps it for the request's life.
//!
//! The router reads a few fields (model, stream, limits, stop strings...);
//! everything else passes through to the engines untouched. Parsing the whole
//! body into `serde_json::Value`s costs far more than its bytes where it
//! matters: a prompt of token ids is one 32-byte `Value` per id (a 30 MB body
//! of ids became ~0.5 GB), a long chat history one map per message. So a
//! top-level field whose JSON text is longer than [`RAW_FIELD_BYTES`] (an
//! array, an object or a string) is kept as its raw text: a slice of the
//! body buffer the client's bytes were read into, never a copy. That one
//! buffer is what the engine calls send (`patch.rs` writes each call's body
//! as the router's few changed fields between slices of it) and what the
//! request keeps for a resume: a body costs its size once while admitted
//! (`--max-inflight-body-bytes`). Large fields are read through typed,
//! compact parses by the few places that need it (validation, the prompt ids
//! of `cache_aware`, an echoed prompt). The fields the router reads as values
//! (the model, stop strings, stream options, the tool choice) must stay
//! small: larger ones are refused.

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// A top-level array, object or string longer than this (as JSON text) is
/// kept raw.
pub const RAW_FIELD_BYTES: usize = 16 * 1024;
/// Most top-level fields a body may have (each parsed field is a map entry).
pub const MAX_FIELDS: usize = 256;
/// Fields the router reads as values, and their largest JSON text: a
/// request's stop strings are bounded again by validation (64 of at most
/// 1,024 characters).
const READ_AS_VALUES: &[(&str, usize)] = &[
    ("model", RAW_FIELD_BYTES),
    ("stop", 512 * 1024),
    ("stream_options", 4 * 1024),
    ("tool_choice", 64 * 1024),
    ("kv_transfer_params", 64 * 1024),
];

/// Why a body is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    #[error("invalid JSON body: {0}")]
    Json(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("request body has more than {MAX_FIELDS} fields")]
    TooManyFields,
    #[error("`{0}` is too large")]
    FieldTooLarge(&'static str),
}

/// A client's body: small fields as values, large ones as slices of the
/// client's body buffer (cheap to clone: the slices are shared).
#[derive(Debug, Default, Clone)]
pub struct ClientBody {
    fields: Map<String, Value>,
    /// Each large field's JSON text, a slice of the one body buffer.
    raw: BTreeMap<String, Bytes>,
}

impl ClientBody {
    /// Parses a body read whole. Large fields keep `bytes` (the buffer, not
    /// a copy of it) alive; without one, nothing of it is kept.
    pub fn parse(bytes: &Bytes) -> Result<Self, BodyError> {
        let text = bytes
            .iter()
            .find(|b| !b.is_ascii_whitespace())
            .ok_or_else(|| BodyError::Json("EOF while parsing a value".into()))?;
        if *text != b'{' {
            // Reported as serde_json would (and a JSON array is not an object).
            return match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
                Err(err) => Err(BodyError::Json(err.to_string())),
                Ok(_) => Err(BodyError::NotAnObject),
            };
        }
        // A body no larger than the raw threshold has no field to keep raw:
        // one parse, as values (the common case, on every request's path).
        if bytes.len() <= RAW_FIELD_BYTES {
            let fields: Map<String, Value> =
                serde_json::from_slice(bytes).map_err(|err| BodyError::Json(err.to_string()))?;
            if fields.len() > MAX_FIELDS {
                return Err(BodyError::TooManyFields);
            }
            return Ok(Self {
                fields,
                raw: BTreeMap::new(),
            });
        }
        // Each field's text borrowed from `bytes`: nothing copied yet.
        let top: BTreeMap<String, &RawValue> =
            serde_json::from_slice(bytes).map_err(|err| BodyError::Json(err.to_string()))?;
        if top.len() > MAX_FIELDS {
            return Err(BodyError::TooManyFields);
        }
        let mut body = Self::default();
        for (key, raw) in top {
            let text = raw.get();
            if let Some((name, max)) = READ_AS_VALUES.iter().find(|(name, _)| *name == key) {
                if text.len() > *max {
                    return Err(BodyError::FieldTooLarge(name));
                }
            } else if text.len() > RAW_FIELD_BYTES && text.starts_with(['[', '{', '"']) {
                // The field's slice of the buffer it was parsed from.
                body.raw.insert(key, bytes.slice_ref(text.as_bytes()));
                continue;
            }
            let value =
                serde_json::from_str(text).map_err(|err| BodyError::Json(err.to_string()))?;
            body.fields.insert(key, value);
        }
        Ok(body)
    }

    /// The body of a JSON object value, every field a value (bodies the
    /// router makes, and tests).
    pub fn of(value: Value) -> Self {
        match value {
            Value::Object(fields) => Self {
                fields,
                raw: BTreeMap::new(),
            },
            _ => Self::default(),
        }
    }

    /// A field held as a value (`None` for a large one: see [`Self::raw`]).
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.fields.get(key)
    }

    /// A large field, as its JSON text.
    pub fn raw(&self, key: &str) -> Option<&Bytes> {
        self.raw.get(key)
    }

    /// Whether the body has `key` set: present, and neither null nor false.
    pub fn is_set(&self, key: &str) -> bool {
        self.raw.contains_key(key)
            || self
                .fields
                .get(key)
                .is_some_and(|v| !v.is_null() && *v != Value::Bool(false))
    }

    /// `key` read as `T`, whichever way it is held; `None` when absent or not
    /// a `T`. For a large field, `T` should be compact (ids as `u32`s, fields
    /// it ignores skipped).
    pub fn typed<T: DeserializeOwned>(&self, key: &str) -> Option<T> {
        match (self.fields.get(key), self.raw.get(key)) {
            (Some(value), _) => T::deserialize(value).ok(),
            (None, Some(raw)) => serde_json::from_slice(raw).ok(),
            (None, None) => None,
        }
    }

    /// Whether `key` is a non-empty JSON array.
    pub fn has_items(&self, key: &str) -> bool {
        match (self.fields.get(key), self.raw.get(key)) {
            (Some(Value::Array(items)), _) => !items.is_empty(),
            // Raw fields are longer than any empty array.
            (None, Some(raw)) => raw.starts_with(b"["),
            _ => false,
        }
    }

    /// Sets `key` to `value` (replacing it, however it was held).
    pub fn set(&mut self, key: &str, value: Value) {
        self.raw.remove(key);
        self.fields.insert(key.to_string(), value);
    }

    /// The fields held as values.
    pub fn fields(&self) -> &Map<String, Value> {
        &self.fields
    }

    /// The large fields, raw.
    pub fn raw_fields(&self) -> impl Iterator<Item = (&String, &Bytes)> {
        self.raw.iter()
    }
}

/// The `type` of an object field (such as `response_format`), read without
/// the rest of it.
#[derive(Deserialize)]
pub struct TypeOnly {
    #[serde(rename = "type")]
    pub kind: String,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(text: &str) -> Result<ClientBody, BodyError> {
        ClientBody::parse(&Bytes::copy_from_slice(text.as_bytes()))
    }

    #[test]
    fn large_fields_stay_raw_and_small_fields_are_values() {
        let ids: Vec<u32> = (0..10_000).collect();
        let schema: Map<String, Value> =
            (0..2_000).map(|i| (format!("k{i}"), json!("v"))).collect();
        let text = "x".repeat(100_000);
        let body = json!({"model": "m", "prompt": ids, "stream": true, "response_format":
            {"type": "json_schema", "schema": schema}, "suffix": text, "stop": ["a"]});
        let parsed = parse(&body.to_string()).unwrap();
        assert_eq!(parsed.get("model"), Some(&json!("m")));
        assert!(parsed.get("prompt").is_none());
        assert!(parsed.raw("prompt").is_some());
        assert_eq!(parsed.typed::<Vec<u32>>("prompt"), Some(ids));
        assert!(parsed.has_items("prompt"));
        assert!(parsed.is_set("response_format"));
        assert_eq!(
            parsed.typed::<TypeOnly>("response_format").unwrap().kind,
            "json_schema"
        );
        // A long string is raw too (a value would be a copy of its bytes).
        assert!(parsed.get("suffix").is_none());
        assert_eq!(parsed.typed::<String>("suffix"), Some(text));
        assert!(!parsed.has_items("suffix"));
        assert_eq!(parsed.get("stop"), Some(&json!(["a"])));
        assert!(parsed.is_set("stream") && !parsed.is_set("echo"));
    }

    #[test]
    fn large_fields_are_slices_of_the_body_read_not_copies() {
        let ids: Vec<u32> = (0..10_000).collect();
        let sent = Bytes::from(json!({"model": "m", "prompt": ids}).to_string());
        let parsed = ClientBody::parse(&sent).unwrap();
        let prompt = parsed.raw("prompt").unwrap();
        let start = prompt.as_ptr() as usize - sent.as_ptr() as usize;
        assert!(start + prompt.len() <= sent.len());
        assert_eq!(&sent[start..start + prompt.len()], prompt.as_ref());
        // A clone of the body shares the slices too.
        let clone = parsed.clone();
        assert_eq!(clone.raw("prompt").unwrap().as_ptr(), prompt.as_ptr());
    }

    #[test]
    fn refused_bodies_say_why() {
        assert_eq!(parse("[1]").unwrap_err(), BodyError::NotAnObject);
        assert!(matches!(parse("{\"a\":").unwrap_err(), BodyError::Json(_)));
        assert!(matches!(parse("  ").unwrap_err(), BodyError::Json(_)));
        let many: Map<String, Value> = (0..=MAX_FIELDS)
            .map(|i| (format!("f{i}"), json!(1)))
            .collect();
        assert_eq!(
            parse(&Value::Object(many).to_string()).unwrap_err(),
            BodyError::TooManyFields
        );
        let stops: Vec<String> = (0..100_000).map(|i| format!("s{i}")).collect();
        let body = json!({"stop": stops}).to_string();
        assert_eq!(parse(&body).unwrap_err(), BodyError::FieldTooLarge("stop"));
        let model = json!({"model": "m".repeat(RAW_FIELD_BYTES), "prompt": "x"}).to_string();
        assert_eq!(
            parse(&model).unwrap_err(),
            BodyError::FieldTooLarge("model")
        );
    }
}
