//! What changed in a JSON value since an earlier one, as appends where it
//! grew: a background response's checkpoint (`mirror.rs`) grows by its token
//! ids, its text and its events' state, and its writer sends the store only
//! that, not the whole value again every time.
//!
//! A patch says, for each part that changed: for a string, the bytes of the
//! old one kept and the text after them (`{"s": kept, "t": tail}`); for an
//! array, the elements kept, a patch of the last one kept and the elements
//! after it (`{"a": kept, "l": patch, "t": [..]}`); for an object, a patch
//! per key changed and the keys gone (`{"o": {..}, "d": [..]}`); anything
//! else whole (`{"v": value}`). Positions are the old value's, so a patch
//! applies to any value that has the old one's parts up to them.

use serde_json::{Map, Value};

/// Why a patch does not apply: the value it is applied to is not the one it
/// was made from (a store that lost a write, or data not the writer's).
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("a patch does not fit the checkpoint it applies to: {0}")]
    Mismatch(&'static str),
}

/// The patch that makes `new` of `old`; None when they are equal.
pub fn diff(old: &Value, new: &Value) -> Option<Value> {
    if old == new {
        return None;
    }
    Some(match (old, new) {
        (Value::String(old), Value::String(new)) => {
            let kept = common_prefix(old, new);
            single("s", kept.into(), "t", new[kept..].into())
        }
        (Value::Array(old), Value::Array(new)) => {
            let kept = old.iter().zip(new).take_while(|(a, b)| a == b).count();
            let mut patch = Map::new();
            if kept < old.len() && kept < new.len() {
                // The first element that differs is patched in place (the
                // open segment, whose text grows).
                patch.insert("a".into(), (kept + 1).into());
                if let Some(last) = diff(&old[kept], &new[kept]) {
                    patch.insert("l".into(), last);
                }
                patch.insert("t".into(), new[kept + 1..].to_vec().into());
            } else {
                patch.insert("a".into(), kept.into());
                patch.insert("t".into(), new[kept..].to_vec().into());
            }
            Value::Object(patch)
        }
        (Value::Object(old), Value::Object(new)) => {
            let changed: Map<String, Value> = new
                .iter()
                .filter_map(|(key, value)| {
                    let patch = match old.get(key) {
                        Some(before) => diff(before, value)?,
                        None => single_value(value.clone()),
                    };
                    Some((key.clone(), patch))
                })
                .collect();
            let gone: Vec<Value> = old
                .keys()
                .filter(|key| !new.contains_key(*key))
                .map(|key| Value::String(key.clone()))
                .collect();
            let mut patch = Map::new();
            patch.insert("o".into(), Value::Object(changed));
            if !gone.is_empty() {
                patch.insert("d".into(), gone.into());
            }
            Value::Object(patch)
        }
        _ => single_value(new.clone()),
    })
}

/// Applies `patch` (made by [`diff`]) to `value`.
pub fn apply(value: &mut Value, patch: &Value) -> Result<(), PatchError> {
    let Value::Object(patch) = patch else {
        return Err(PatchError::Mismatch("a patch is an object"));
    };
    if let Some(whole) = patch.get("v") {
        *value = whole.clone();
        return Ok(());
    }
    if let Some(kept) = patch.get("s") {
        let (Value::String(text), Some(kept), Some(Value::String(tail))) =
            (&mut *value, kept.as_u64(), patch.get("t"))
        else {
            return Err(PatchError::Mismatch("a string patch on a string"));
        };
        let kept = usize::try_from(kept).unwrap_or(usize::MAX);
        if !text.is_char_boundary(kept) {
            return Err(PatchError::Mismatch(
                "a string patch keeps what the string has",
            ));
        }
        text.truncate(kept);
        text.push_str(tail);
        return Ok(());
    }
    if let Some(kept) = patch.get("a") {
        let (Value::Array(items), Some(kept), Some(Value::Array(tail))) =
            (&mut *value, kept.as_u64(), patch.get("t"))
        else {
            return Err(PatchError::Mismatch("an array patch on an array"));
        };
        let kept = usize::try_from(kept).unwrap_or(usize::MAX);
        if kept > items.len() {
            return Err(PatchError::Mismatch(
                "an array patch keeps what the array has",
            ));
        }
        items.truncate(kept);
        if let Some(last) = patch.get("l") {
            let Some(item) = items.last_mut() else {
                return Err(PatchError::Mismatch("an array patch's last element"));
            };
            apply(item, last)?;
        }
        items.extend(tail.iter().cloned());
        return Ok(());
    }
    if let Some(Value::Object(changed)) = patch.get("o") {
        let Value::Object(fields) = value else {
            return Err(PatchError::Mismatch("an object patch on an object"));
        };
        for (key, change) in changed {
            apply(fields.entry(key.clone()).or_insert(Value::Null), change)?;
        }
        for key in patch
            .get("d")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(key) = key.as_str() {
                fields.remove(key);
            }
        }
        return Ok(());
    }
    Err(PatchError::Mismatch("an unknown patch"))
}

fn single(a: &str, x: Value, b: &str, y: Value) -> Value {
    let mut patch = Map::new();
    patch.insert(a.into(), x);
    patch.insert(b.into(), y);
    Value::Object(patch)
}

fn single_value(value: Value) -> Value {
    let mut patch = Map::new();
    patch.insert("v".into(), value);
    Value::Object(patch)
}

/// The bytes `old` and `new` share from their start, at a character boundary.
fn common_prefix(old: &str, new: &str) -> usize {
    let mut kept = old
        .bytes()
        .zip(new.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    while !new.is_char_boundary(kept) {
        kept -= 1;
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn round_trip(old: Value, new: Value) -> Value {
        let patch = diff(&old, &new).unwrap_or_else(|| panic!("no patch"));
        let mut value = old;
        apply(&mut value, &patch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(value, new);
        patch
    }

    #[test]
    fn a_growing_checkpoint_patches_to_its_growth_only() {
        let echo = "m".repeat(10_000);
        let old = json!({"decode": {"token_ids": [1, 2, 3], "text": "héllo", "epoch": 0},
                         "translation": {"echo": echo, "sequence": 7,
                                         "open": [{"kind": "text"}, "héllo"]}});
        let new = json!({"decode": {"token_ids": [1, 2, 3, 4, 5], "text": "héllo wo", "epoch": 0},
                         "translation": {"echo": echo, "sequence": 9,
                                         "open": [{"kind": "text"}, "héllo wo"]}});
        let patch = round_trip(old, new);
        // The constant parts are not in it.
        assert!(patch.to_string().len() < 200, "{patch}");
        assert!(diff(&json!({"a": 1}), &json!({"a": 1})).is_none());
    }

    #[test]
    fn anything_else_changes_whole_and_a_patch_applies_again_over_itself() {
        round_trip(
            json!({"a": "abc", "b": [1, 2], "c": 1}),
            json!({"a": "xy", "b": [3], "d": null}),
        );
        round_trip(json!([1, {"t": "ab"}]), json!([1, {"t": "abc"}, 2]));
        round_trip(json!("é"), json!("è"));
        round_trip(json!({"a": 1}), json!([1]));
        // A write that landed though its answer was lost, then the next one
        // made from the same earlier value: the same result.
        let (old, mid, new) = (
            json!({"t": "ab", "n": [1]}),
            json!({"t": "abc", "n": [1, 2]}),
            json!({"t": "abcd", "n": [1, 2, 3]}),
        );
        let mut value = old.clone();
        apply(&mut value, &diff(&old, &mid).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
        apply(&mut value, &diff(&old, &new).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(value, new);
    }

    #[test]
    fn a_patch_that_does_not_fit_is_refused() {
        let patch = json!({"s": 10, "t": "x"});
        assert!(apply(&mut json!("abc"), &patch).is_err());
        assert!(apply(&mut json!([1]), &json!({"a": 5, "t": []})).is_err());
        assert!(apply(&mut json!("é"), &json!({"s": 1, "t": ""})).is_err());
        assert!(apply(&mut json!(1), &json!({"o": {}})).is_err());
        assert!(apply(&mut json!(1), &json!(2)).is_err());
    }
}
