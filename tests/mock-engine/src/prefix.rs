//! The engine's prefix cache: an LRU of full prompt blocks keyed by a chained
//! hash of their tokens, as vLLM's (with a hash of the mock's own, unrelated
//! to the router's: the router keys blocks by the token ids each event
//! carries). A prefill computes only the tokens past the cached prefix, and
//! every change is a KV event in vLLM's terms (BlockStored, BlockRemoved,
//! AllBlocksCleared) for the agent to forward, and (with `--kv-events-publish`)
//! for the ZMQ publisher ([`crate::publish`]): two queues, as the two readers
//! take them at their own pace. A request's `cache_salt` is mixed into its
//! first block's hash and reported as that block's extra key, as vLLM does:
//! one prompt under two salts shares no block.

use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};

/// Most events waiting to be forwarded; past it the oldest are dropped and an
/// AllBlocksCleared is sent instead of them... after the cache is cleared, so
/// that the router's index is never wrong, only emptier.
const MAX_PENDING: usize = 4096;

#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    cap: usize,
    /// Block hash -> LRU stamp.
    blocks: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    stamp: u64,
    /// Events not yet forwarded, oldest first.
    pending: Vec<Value>,
    /// Events not yet published over ZMQ (None: not published).
    published: Option<Vec<Value>>,
    /// Prompt tokens served from the cache so far.
    pub hit_tokens: u64,
}

fn cleared() -> Value {
    json!({"type": "AllBlocksCleared"})
}

/// The mock's hash of one block after `parent`.
fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0x6d6f_636b;
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    // Kept below 2^63 so that it is an int64 in msgpack and JSON alike.
    h >> 1
}

impl PrefixCache {
    /// A cache of `cap` blocks of `block_size` tokens; `publish`: keep a
    /// second queue of its events for the ZMQ publisher.
    pub fn new(block_size: usize, cap: usize, publish: bool) -> Self {
        Self {
            block_size: block_size.max(1),
            cap,
            blocks: HashMap::new(),
            order: BTreeMap::new(),
            stamp: 0,
            pending: vec![cleared()],
            published: publish.then(|| vec![cleared()]),
            hit_tokens: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Runs a prefill of `ids` (under `salt`) through the cache: returns the
    /// tokens already cached (whole blocks), and caches the prompt's full
    /// blocks.
    pub fn prefill(&mut self, ids: &[u32], salt: Option<&str>) -> usize {
        let mut parent: Option<u64> = None;
        // The first block's parent: the salt's own (vLLM puts the salt among
        // the first block's extra keys, in its hash).
        let root = salt.map_or(0, |salt| {
            salt.bytes().fold(0x7361_6c74_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
        });
        let mut cached = 0;
        let mut new_hashes = Vec::new();
        let mut new_tokens = Vec::new();
        let mut new_parent = None;
        for tokens in ids.chunks_exact(self.block_size) {
            let hash = block_hash(parent.unwrap_or(root), tokens);
            if new_hashes.is_empty() && self.blocks.contains_key(&hash) {
                cached += tokens.len();
                self.touch(hash);
            } else {
                if new_hashes.is_empty() {
                    new_parent = parent;
                }
                new_hashes.push(hash);
                new_tokens.extend_from_slice(tokens);
                self.touch(hash);
            }
            parent = Some(hash);
        }
        if !new_hashes.is_empty() {
            // The salt is the extra key of the prompt's first block only.
            let extra_keys = salt.filter(|_| new_parent.is_none()).map(|salt| {
                let mut keys = vec![json!([salt])];
                keys.resize(new_hashes.len(), Value::Null);
                keys
            });
            self.push(json!({
                "type": "BlockStored", "block_hashes": new_hashes,
                "parent_block_hash": new_parent, "token_ids": new_tokens,
                "block_size": self.block_size, "lora_id": null, "medium": "GPU",
                "lora_name": null, "extra_keys": extra_keys,
            }));
        }
        let mut evicted = Vec::new();
        while self.blocks.len() > self.cap {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.blocks.remove(&oldest);
            evicted.push(oldest);
        }
        if !evicted.is_empty() {
            self.push(json!({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"}));
        }
        self.hit_tokens += cached as u64;
        cached
    }

    fn touch(&mut self, hash: u64) {
        if let Some(old) = self.blocks.insert(hash, self.stamp) {
            self.order.remove(&old);
        }
        self.order.insert(self.stamp, hash);
        self.stamp += 1;
    }

    /// Forgets everything (the engine's cache was reset).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.order.clear();
        self.pending = vec![cleared()];
        if let Some(published) = &mut self.published {
            *published = vec![cleared()];
        }
    }

    fn push(&mut self, event: Value) {
        let published = self.published.as_ref().map_or(0, Vec::len);
        if self.pending.len().max(published) >= MAX_PENDING {
            self.clear();
            return;
        }
        if let Some(published) = &mut self.published {
            published.push(event.clone());
        }
        self.pending.push(event);
    }

    /// The events not published over ZMQ yet (none when not publishing).
    pub fn take_published(&mut self) -> Vec<Value> {
        self.published
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The events not forwarded yet.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.pending)
    }

    /// Events to send again after a failed forward (before newer ones).
    pub fn put_back(&mut self, mut events: Vec<Value>) {
        events.append(&mut self.pending);
        self.pending = events;
        if self.pending.len() > MAX_PENDING {
            self.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_computed_once_and_reported_as_stored_blocks() {
        let mut cache = PrefixCache::new(4, 3, true);
        let first: Vec<u32> = (0..10).collect();
        assert_eq!(cache.prefill(&first, None), 0);
        let events = cache.take_events();
        assert_eq!(events[0]["type"], "AllBlocksCleared");
        let second_block = events[1]["block_hashes"][1].clone();
        assert_eq!(events[1]["block_hashes"].as_array().map(Vec::len), Some(2));
        assert_eq!(events[1]["token_ids"].as_array().map(Vec::len), Some(8));
        let mut second: Vec<u32> = (0..8).collect();
        second.extend([99, 98, 97, 96]);
        assert_eq!(cache.prefill(&second, None), 8);
        let events = cache.take_events();
        assert_eq!(events[0]["parent_block_hash"], second_block);
        // A fourth block goes past the cap of 3: the least recently used goes.
        assert_eq!(cache.prefill(&[7, 7, 7, 7], None), 0);
        let events = cache.take_events();
        assert_eq!(events[1]["type"], "BlockRemoved");
        assert_eq!(cache.len(), 3);
        // The publisher's queue holds the same events, taken on its own.
        let published = cache.take_published();
        assert_eq!(published.len(), 5);
        assert_eq!(published[4]["type"], "BlockRemoved");
        assert!(cache.take_published().is_empty());
        assert!(PrefixCache::new(4, 3, false).take_published().is_empty());
    }

    #[test]
    fn a_salted_prompt_shares_no_block_with_another_salt() {
        let mut cache = PrefixCache::new(4, 64, false);
        let ids: Vec<u32> = (0..8).collect();
        assert_eq!(cache.prefill(&ids, Some("a")), 0);
        let events = cache.take_events();
        assert_eq!(events[1]["extra_keys"], json!([["a"], null]));
        assert_eq!(cache.prefill(&ids, Some("a")), 8);
        assert_eq!(cache.prefill(&ids, Some("b")), 0);
        assert_eq!(cache.prefill(&ids, None), 0);
        let events = cache.take_events();
        assert_eq!(
            events.last().unwrap_or(&Value::Null)["extra_keys"],
            Value::Null
        );
    }
}
