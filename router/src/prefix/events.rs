//! The KV events an agent forwards (`POST /v1/instances/{id}/kv-events`), in
//! vLLM's terms: its `BlockStored`, `BlockRemoved` and `AllBlocksCleared`
//! (vllm/distributed/kv_events.py), as JSON. Fields the router does not read
//! are ignored, so an agent may forward vLLM's events whole.

use serde::{Deserialize, Deserializer};

/// Most events in one batch.
pub const MAX_EVENTS: usize = 4096;
/// Largest block size accepted (vLLM's are 16 to a few hundred tokens).
pub const MAX_BLOCK_SIZE: usize = 4096;

/// A batch of events, oldest first.
#[derive(Debug, Clone, Deserialize)]
pub struct KvEventBatch {
    pub events: Vec<KvEvent>,
}

/// One KV cache event of an engine.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Full blocks computed and cached: `block_hashes[i]` holds
    /// `token_ids[i * block_size..(i + 1) * block_size]`, and block 0 follows
    /// `parent_block_hash` (none: the prompt's first block).
    BlockStored {
        block_hashes: Vec<EngineHash>,
        #[serde(default)]
        parent_block_hash: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: usize,
        /// Blocks of a LoRA adapter's requests (`lora_id` in vLLM 0.32,
        /// `lora_name` later): not the base model's cache.
        /// (Boxed, as is `extra_keys`: an order-keeping JSON value is large
        /// and most events carry neither.)
        #[serde(default)]
        lora_id: Option<Box<serde_json::Value>>,
        #[serde(default)]
        lora_name: Option<String>,
        /// Where the blocks live: `GPU` (or absent) is the engine's own cache.
        #[serde(default)]
        medium: Option<String>,
        /// Per block: multimodal hashes, LoRA, cache_salt. A block with any is
        /// not a plain token prefix the router can match.
        #[serde(default)]
        extra_keys: Option<Box<serde_json::Value>>,
        /// KV cache group (hybrid models); only group 0 is indexed.
        #[serde(default)]
        group_idx: Option<u32>,
    },
    BlockRemoved {
        block_hashes: Vec<EngineHash>,
        #[serde(default)]
        medium: Option<String>,
    },
    AllBlocksCleared {},
}

/// An engine's block hash: vLLM sends an integer or bytes (which an agent
/// forwards as a hex or base64 string). Only compared for equality, so a
/// string is folded to 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineHash(pub u64);

impl<'de> Deserialize<'de> for EngineHash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Unsigned(u64),
            Signed(i64),
            Text(String),
        }
        Ok(EngineHash(match Raw::deserialize(deserializer)? {
            Raw::Unsigned(n) => n,
            Raw::Signed(n) => n as u64,
            Raw::Text(text) => {
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for b in text.bytes() {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
                h
            }
        }))
    }
}

/// A batch that cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadEvents {
    #[error("a batch holds at most {MAX_EVENTS} events")]
    TooMany,
    #[error("event {0}: block_size must be 1 to {MAX_BLOCK_SIZE}")]
    BlockSize(usize),
    #[error("event {0}: token_ids must hold block_size tokens per block hash")]
    TokenCount(usize),
}

impl KvEventBatch {
    /// Checks the shape of every event before any is applied.
    pub fn check(&self) -> Result<(), BadEvents> {
        if self.events.len() > MAX_EVENTS {
            return Err(BadEvents::TooMany);
        }
        for (i, event) in self.events.iter().enumerate() {
            if let KvEvent::BlockStored {
                block_hashes,
                token_ids,
                block_size,
                ..
            } = event
            {
                if !(1..=MAX_BLOCK_SIZE).contains(block_size) {
                    return Err(BadEvents::BlockSize(i));
                }
                if block_hashes.len().checked_mul(*block_size) != Some(token_ids.len()) {
                    return Err(BadEvents::TokenCount(i));
                }
            }
        }
        Ok(())
    }
}

impl KvEvent {
    /// Whether a BlockStored describes plain token blocks of the engine's own
    /// (GPU) cache, group 0: the only ones a prompt's tokens can match.
    pub fn is_plain_prefix(&self) -> bool {
        self.prefix_salt() == Some(None)
    }

    /// The `cache_salt` a BlockStored's blocks were stored under, for one
    /// the router can index: `Some(None)` for plain token blocks of the
    /// engine's own (GPU) cache, group 0; `Some(Some(salt))` for the same
    /// whose first block, a prompt's first (no parent), carries one string
    /// key, its salt (vLLM mixes a request's `cache_salt` into its first
    /// block only); `None` for any other (LoRA, multimodal, another medium
    /// or group), which no prompt's tokens can match.
    pub fn prefix_salt(&self) -> Option<Option<&str>> {
        let KvEvent::BlockStored {
            lora_id,
            lora_name,
            medium,
            extra_keys,
            group_idx,
            parent_block_hash,
            ..
        } = self
        else {
            return None;
        };
        let own_cache = lora_id.as_deref().is_none_or(serde_json::Value::is_null)
            && lora_name.is_none()
            && medium.as_deref().is_none_or(|m| m == "GPU")
            && group_idx.unwrap_or(0) == 0;
        if !own_cache {
            return None;
        }
        let none = |k: &serde_json::Value| k.is_null() || k.as_array().is_some_and(Vec::is_empty);
        match extra_keys.as_deref() {
            None | Some(serde_json::Value::Null) => Some(None),
            Some(serde_json::Value::Array(per_block)) => match per_block.split_first() {
                None => Some(None),
                Some((first, rest)) if rest.iter().all(none) => {
                    if none(first) {
                        return Some(None);
                    }
                    let salt = match first.as_array().map(Vec::as_slice) {
                        Some([serde_json::Value::String(salt)]) => salt.as_str(),
                        _ => return None,
                    };
                    parent_block_hash.is_none().then_some(Some(salt))
                }
                Some(_) => None,
            },
            Some(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn vllm_events_parse_with_fields_the_router_ignores() {
        let batch: KvEventBatch = serde_json::from_value(json!({"events": [
            {"type": "BlockStored", "block_hashes": [-5, "ab12"], "parent_block_hash": null,
             "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": null, "medium": "GPU",
             "extra_keys": [null, null], "group_idx": 0, "future_field": 1},
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            {"type": "AllBlocksCleared"}
        ]}))
        .unwrap();
        batch.check().unwrap();
        assert!(batch.events[0].is_plain_prefix());
        assert!(matches!(batch.events[2], KvEvent::AllBlocksCleared {}));
        let bad: KvEventBatch = serde_json::from_value(json!({"events": [
            {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 2}
        ]}))
        .unwrap();
        assert_eq!(bad.check(), Err(BadEvents::TokenCount(0)));
        let salted: KvEventBatch = serde_json::from_value(json!({"events": [
            {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
             "extra_keys": [["salt"]]}
        ]}))
        .unwrap();
        assert!(!salted.events[0].is_plain_prefix());
        assert_eq!(salted.events[0].prefix_salt(), Some(Some("salt")));
        let odd: KvEventBatch = serde_json::from_value(json!({"events": [
            {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [1, 2], "block_size": 1,
             "extra_keys": [null, ["salt"]]},
            {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
             "parent_block_hash": 7, "extra_keys": [["salt"]]},
            {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
             "extra_keys": [["salt", "mm-hash"]]}
        ]}))
        .unwrap();
        for event in &odd.events {
            assert_eq!(event.prefix_salt(), None, "{event:?}");
        }
    }
}
