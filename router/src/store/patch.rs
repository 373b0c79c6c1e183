//! What changed in a JSON value since an earlier one, as appends where it
//! grew: a background response's checkpoint (`mirror.rs`) grows by its token
//! ids, its text and its events' state, and its writer sends the store only
//! that, not the whole value again every time (ten times a second: the
//! encoding is terse, for the bytes of each write).
//!
//! A patch says, for each part that changed: for an object, an object of a
//! patch per key changed (`[]`: the key is gone); for a string, the bytes of
//! the old one kept and the text after them (`[kept, "tail"]`, or `[kept,
//! n]`: the same tail as the patch's n-th string tail before it, in the
//! order `apply` meets them: the checkpoint's text grows in two places, its
//! decode progress and its open output segment, and is sent once); for an
//! array, the elements kept and those after them (`[kept, [..]]`), with a
//! patch of the last one kept (`[kept, [..], patch]`: the open segment,
//! whose text grows); anything else whole (`[value]`). Positions are the old
//! value's, so a patch applies to any value that has the old one's parts up
//! to them.

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
    let mut patch = diff_of(old, new)?;
    share_tails(&mut patch, &mut Vec::new());
    Some(patch)
}

fn diff_of(old: &Value, new: &Value) -> Option<Value> {
    if old == new {
        return None;
    }
    Some(match (old, new) {
        (Value::String(old), Value::String(new)) => {
            let kept = common_prefix(old, new);
            Value::Array(vec![kept.into(), new[kept..].into()])
        }
        (Value::Array(old), Value::Array(new)) => {
            let kept = old.iter().zip(new).take_while(|(a, b)| a == b).count();
            if kept < old.len() && kept < new.len() {
                // The first element that differs is patched in place (the
                // open segment, whose text grows).
                let tail = new[kept + 1..].to_vec().into();
                match diff_of(&old[kept], &new[kept]) {
                    Some(last) => Value::Array(vec![(kept + 1).into(), tail, last]),
                    None => Value::Array(vec![(kept + 1).into(), tail]),
                }
            } else {
                Value::Array(vec![kept.into(), new[kept..].to_vec().into()])
            }
        }
        (Value::Object(old), Value::Object(new)) => {
            let mut changed: Map<String, Value> = new
                .iter()
                .filter_map(|(key, value)| {
                    let patch = match old.get(key) {
                        Some(before) => diff_of(before, value)?,
                        None => Value::Array(vec![value.clone()]),
                    };
                    Some((key.clone(), patch))
                })
                .collect();
            for key in old.keys().filter(|key| !new.contains_key(*key)) {
                changed.insert(key.clone(), Value::Array(Vec::new()));
            }
            Value::Object(changed)
        }
        _ => Value::Array(vec![new.clone()]),
    })
}

/// Replaces each string tail of `patch` that an earlier one (in `apply`'s
/// order) already carries by its number among them.
fn share_tails(patch: &mut Value, tails: &mut Vec<String>) {
    match patch {
        Value::Object(changed) => {
            for change in changed.values_mut() {
                share_tails(change, tails);
            }
        }
        Value::Array(op) if op.len() == 3 => share_tails(&mut op[2], tails),
        Value::Array(op) if op.len() == 2 => {
            let Value::String(tail) = &op[1] else {
                return;
            };
            match tails.iter().position(|had| had == tail) {
                Some(n) if !tail.is_empty() => op[1] = n.into(),
                _ => tails.push(tail.clone()),
            }
        }
        _ => {}
    }
}

/// Applies `patch` (made by [`diff`]) to `value`.
pub fn apply(value: &mut Value, patch: &Value) -> Result<(), PatchError> {
    apply_with(value, patch, &mut Vec::new())
}

fn apply_with(value: &mut Value, patch: &Value, tails: &mut Vec<String>) -> Result<(), PatchError> {
    let op = match patch {
        Value::Object(changed) => {
            let Value::Object(fields) = value else {
                return Err(PatchError::Mismatch("an object patch on an object"));
            };
            for (key, change) in changed {
                if change.as_array().is_some_and(Vec::is_empty) {
                    fields.remove(key);
                    continue;
                }
                apply_with(
                    fields.entry(key.clone()).or_insert(Value::Null),
                    change,
                    tails,
                )?;
            }
            return Ok(());
        }
        Value::Array(op) => op.as_slice(),
        _ => return Err(PatchError::Mismatch("a patch is an object or an array")),
    };
    let (kept, tail, last) = match op {
        [whole] => {
            *value = whole.clone();
            return Ok(());
        }
        [kept, tail] => (kept, tail, None),
        [kept, tail, last] => (kept, tail, Some(last)),
        _ => return Err(PatchError::Mismatch("an unknown patch")),
    };
    let kept = kept
        .as_u64()
        .ok_or(PatchError::Mismatch("a patch keeps a count"))?;
    let kept = usize::try_from(kept).unwrap_or(usize::MAX);
    match (&mut *value, tail, last) {
        (Value::String(text), Value::String(_) | Value::Number(_), None) => {
            let tail = match tail {
                Value::String(tail) => {
                    tails.push(tail.clone());
                    tail
                }
                shared => shared
                    .as_u64()
                    .and_then(|n| tails.get(usize::try_from(n).ok()?))
                    .ok_or(PatchError::Mismatch("a string patch's shared tail"))?,
            };
            if !text.is_char_boundary(kept) {
                return Err(PatchError::Mismatch(
                    "a string patch keeps what the string has",
                ));
            }
            text.truncate(kept);
            text.push_str(tail);
            Ok(())
        }
        (Value::Array(items), Value::Array(tail), last) => {
            if kept > items.len() {
                return Err(PatchError::Mismatch(
                    "an array patch keeps what the array has",
                ));
            }
            items.truncate(kept);
            if let Some(last) = last {
                let Some(item) = items.last_mut() else {
                    return Err(PatchError::Mismatch("an array patch's last element"));
                };
                apply_with(item, last, tails)?;
            }
            items.extend(tail.iter().cloned());
            Ok(())
        }
        _ => Err(PatchError::Mismatch("a patch of the kind of its value")),
    }
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
        let patch = round_trip(old, new).to_string();
        // The constant parts are not in it, and the text's growth once.
        assert!(patch.len() < 120, "{patch}");
        assert_eq!(patch.matches(" wo").count(), 1, "{patch}");
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
        round_trip(
            json!({"a": "x", "b": "y"}),
            json!({"a": "xz", "b": "yz", "c": "z"}),
        );
        round_trip(json!(["a", "b"]), json!([]));
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
        assert!(apply(&mut json!("abc"), &json!([10, "x"])).is_err());
        assert!(apply(&mut json!([1]), &json!([5, []])).is_err());
        assert!(apply(&mut json!("é"), &json!([1, ""])).is_err());
        assert!(apply(&mut json!(1), &json!({})).is_err());
        assert!(apply(&mut json!(1), &json!(2)).is_err());
        assert!(apply(&mut json!([1]), &json!([0, "x"])).is_err());
        assert!(apply(&mut json!(1), &json!([1, 2, 3, 4])).is_err());
        // A shared tail that no string before it carries.
        assert!(apply(&mut json!({"a": "x"}), &json!({"a": [1, 0]})).is_err());
    }
}
