//! Request fields the router keeps but no engine reads (and `user`, which
//! it passes on), held to the limits OpenAI's API sets for them (`user`
//! has none documented: a `metadata` value's): the response object echoes
//! them (three times
//! for a background response's events, once more in its stored copy), so a
//! field without a bound is memory any client could make the router keep.
//! A field past its limit is refused (400 naming it), never cut in silence.

use crate::error::ApiError;
use crate::protocols::bad;
use serde_json::{Map, Value};

/// Most `metadata` pairs (OpenAI's limit).
pub const METADATA_MAX_PAIRS: usize = 16;
/// Longest `metadata` key, in characters (OpenAI's limit).
pub const METADATA_MAX_KEY_CHARS: usize = 64;
/// Longest `metadata` value, in characters (OpenAI's limit).
pub const METADATA_MAX_VALUE_CHARS: usize = 512;
/// Longest `user`, in characters: OpenAI documents no limit for this end-user
/// identifier (it gives way to `safety_identifier` and `prompt_cache_key`),
/// so it is held to a `metadata` value's.
pub const USER_MAX_CHARS: usize = METADATA_MAX_VALUE_CHARS;
/// Keys `reasoning` may carry (`generate_summary` is the older `summary`).
const REASONING_KEYS: &[&str] = &["effort", "summary", "generate_summary"];
/// Keys `text` may carry.
const TEXT_KEYS: &[&str] = &["format", "verbosity"];
/// Longest setting in `reasoning` or `text.verbosity` (a word: "medium",
/// "detailed").
pub const SETTING_MAX_CHARS: usize = 32;

/// Checks the echoed fields of a Responses request against their limits.
pub fn check_echoed(body: &Map<String, Value>) -> Result<(), ApiError> {
    if let Some(Value::Object(metadata)) = body.get("metadata") {
        check_metadata(metadata)?;
    }
    if let Some(Value::String(user)) = body.get("user") {
        if user.chars().count() > USER_MAX_CHARS {
            return Err(bad(
                format!("`user` may be at most {USER_MAX_CHARS} characters"),
                "user",
            ));
        }
    }
    if let Some(Value::Object(reasoning)) = body.get("reasoning") {
        check_settings(reasoning, "reasoning", REASONING_KEYS)?;
    }
    if let Some(Value::Object(text)) = body.get("text") {
        check_keys(text, "text", TEXT_KEYS)?;
        if let Some(verbosity) = text.get("verbosity") {
            check_setting(verbosity, "text.verbosity", "text")?;
        }
    }
    Ok(())
}

/// At most 16 pairs of strings, keys of at most 64 characters, values of at
/// most 512.
fn check_metadata(metadata: &Map<String, Value>) -> Result<(), ApiError> {
    if metadata.len() > METADATA_MAX_PAIRS {
        return Err(bad(
            format!("`metadata` may hold at most {METADATA_MAX_PAIRS} pairs"),
            "metadata",
        ));
    }
    for (key, value) in metadata {
        if key.chars().count() > METADATA_MAX_KEY_CHARS {
            return Err(bad(
                format!("`metadata` keys may be at most {METADATA_MAX_KEY_CHARS} characters"),
                "metadata",
            ));
        }
        let Value::String(value) = value else {
            return Err(bad("`metadata` values must be strings", "metadata"));
        };
        if value.chars().count() > METADATA_MAX_VALUE_CHARS {
            return Err(bad(
                format!("`metadata` values may be at most {METADATA_MAX_VALUE_CHARS} characters"),
                "metadata",
            ));
        }
    }
    Ok(())
}

/// An object of `known` keys only.
fn check_keys(
    object: &Map<String, Value>,
    param: &'static str,
    known: &[&str],
) -> Result<(), ApiError> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(unknown) => Err(bad(
            format!(
                "`{param}.{}` is not served (`{param}` takes {})",
                truncated(unknown),
                known.join(", ")
            ),
            param,
        )),
        None => Ok(()),
    }
}

/// An object of `known` keys, each a short string or null.
fn check_settings(
    object: &Map<String, Value>,
    param: &'static str,
    known: &[&str],
) -> Result<(), ApiError> {
    check_keys(object, param, known)?;
    for (key, value) in object {
        check_setting(value, &format!("{param}.{key}"), param)?;
    }
    Ok(())
}

fn check_setting(value: &Value, name: &str, param: &'static str) -> Result<(), ApiError> {
    match value {
        Value::Null => Ok(()),
        Value::String(s) if s.chars().count() <= SETTING_MAX_CHARS => Ok(()),
        _ => Err(bad(
            format!("`{name}` must be a string of at most {SETTING_MAX_CHARS} characters"),
            param,
        )),
    }
}

/// A client's key as an error message repeats it: its first characters.
fn truncated(key: &str) -> String {
    key.chars().take(METADATA_MAX_KEY_CHARS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn checked(body: Value) -> Result<(), ApiError> {
        check_echoed(body.as_object().unwrap_or(&Map::new()))
    }

    #[test]
    fn metadata_within_openais_limits_passes_and_past_them_is_refused() {
        let sixteen: Map<String, Value> = (0..16)
            .map(|i| (format!("k{i}"), json!("v".repeat(512))))
            .collect();
        assert!(checked(json!({"metadata": sixteen})).is_ok());
        let mut seventeen = sixteen.clone();
        seventeen.insert("k16".into(), json!("v"));
        for (body, said) in [
            (json!({"metadata": seventeen}), "16 pairs"),
            (json!({"metadata": {"k".repeat(65): "v"}}), "64 characters"),
            (
                json!({"metadata": {"k": "v".repeat(513)}}),
                "512 characters",
            ),
            (json!({"metadata": {"k": 1}}), "strings"),
            (
                json!({"user": "u".repeat(513)}),
                "`user` may be at most 512",
            ),
            (
                json!({"reasoning": {"effort": "low", "notes": "x"}}),
                "reasoning.notes",
            ),
            (
                json!({"reasoning": {"effort": "x".repeat(33)}}),
                "reasoning.effort",
            ),
            (
                json!({"reasoning": {"summary": {"a": 1}}}),
                "reasoning.summary",
            ),
            (
                json!({"text": {"format": {"type": "text"}, "extra": 1}}),
                "text.extra",
            ),
            (
                json!({"text": {"verbosity": "v".repeat(40)}}),
                "text.verbosity",
            ),
        ] {
            let error = checked(body.clone()).expect_err("refused");
            assert_eq!(error.status(), axum::http::StatusCode::BAD_REQUEST);
            assert!(error.to_string().contains(said), "{body}: {error}");
        }
        assert!(checked(json!({"reasoning": {"effort": "high", "summary": null}})).is_ok());
        assert!(checked(json!({"user": "é".repeat(512)})).is_ok());
        assert!(checked(json!({"text": {"format": {"type": "text"}, "verbosity": "low"}})).is_ok());
    }
}
