//! One instance's index of the prompt blocks its KV cache holds, bounded: past
//! its cap the oldest stored block is forgotten (the engine may still hold it;
//! the router then merely misses a hit).

use super::events::{EngineHash, KvEvent};
use super::hash;
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy)]
struct Entry {
    stamp: u64,
    engine: EngineHash,
}

/// Block chain hashes (the router's, [`hash::chain`]) an instance holds.
#[derive(Debug, Default)]
pub struct BlockIndex {
    /// The engine's block size, from its events.
    block_size: Option<usize>,
    entries: HashMap<u64, Entry>,
    /// The engine's hash of each indexed block, to apply removals and to
    /// place a stored block after its parent.
    by_engine: HashMap<EngineHash, u64>,
    /// Insertion order, oldest first, for the cap.
    order: BTreeMap<u64, u64>,
    next_stamp: u64,
    /// The engine reports KV events: the index is exact, and the router's
    /// own record of the prompts it sent there ([`BlockIndex::remember`]) is
    /// not wanted.
    reported: bool,
}

impl BlockIndex {
    /// Blocks indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The block size of the engine's events (none before the first).
    pub fn block_size(&self) -> Option<usize> {
        self.block_size
    }

    /// Forgets everything, events or not (a new registration).
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Whether the index comes from the engine's KV events (else from the
    /// prompts the router sent there, or nothing).
    pub fn is_reported(&self) -> bool {
        self.reported
    }

    /// The approximate index of an engine that sends no KV events: the full
    /// blocks of a prompt the router sent there, assumed cached until the cap
    /// pushes them out (the oldest first, as an engine's LRU would).
    pub fn remember(&mut self, ids: &[u32], block_size: usize, cap: usize) {
        if self.reported || block_size == 0 {
            return;
        }
        if self.block_size != Some(block_size) {
            self.clear();
            self.block_size = Some(block_size);
        }
        for chain in hash::chain(ids, block_size) {
            self.insert(chain, EngineHash(chain), cap);
        }
    }

    /// How many leading blocks of `chain` (a prompt's [`hash::chain`] at
    /// this index's block size) the instance holds.
    pub fn matched_blocks(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count()
    }

    /// Applies one event, keeping at most `cap` blocks.
    pub fn apply(&mut self, event: &KvEvent, cap: usize) {
        if !self.reported {
            // The first event: what the router guessed goes.
            self.clear();
            self.reported = true;
        }
        match event {
            KvEvent::AllBlocksCleared {} => {
                self.clear();
                self.reported = true;
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for engine in block_hashes {
                    if let Some(chain) = self.by_engine.remove(engine) {
                        if let Some(entry) = self.entries.remove(&chain) {
                            self.order.remove(&entry.stamp);
                        }
                    }
                }
            }
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..
            } => {
                if !event.is_plain_prefix() || *block_size == 0 {
                    return;
                }
                if self.block_size != Some(*block_size) {
                    self.clear();
                    self.reported = true;
                    self.block_size = Some(*block_size);
                }
                let parent = match parent_block_hash {
                    None => hash::ROOT,
                    Some(engine) => match self.by_engine.get(engine) {
                        Some(chain) => *chain,
                        // A parent never reported or forgotten: these blocks
                        // cannot be placed in a prompt's chain.
                        None => return,
                    },
                };
                let mut parent = parent;
                for (engine, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(*block_size))
                {
                    parent = hash::block(parent, tokens);
                    self.insert(parent, *engine, cap);
                }
            }
        }
    }

    fn insert(&mut self, chain: u64, engine: EngineHash, cap: usize) {
        if let Some(old) = self.entries.remove(&chain) {
            self.order.remove(&old.stamp);
            self.by_engine.remove(&old.engine);
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.entries.insert(chain, Entry { stamp, engine });
        self.by_engine.insert(engine, chain);
        self.order.insert(stamp, chain);
        while self.entries.len() > cap {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(entry) = self.entries.remove(&oldest) {
                self.by_engine.remove(&entry.engine);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], size: usize) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: tokens.to_vec(),
            block_size: size,
            lora_id: None,
            lora_name: None,
            medium: None,
            extra_keys: None,
            group_idx: None,
        }
    }

    #[test]
    fn stored_blocks_chained_across_events_match_the_prompt() {
        let mut index = BlockIndex::default();
        // The engine stores a prompt's blocks in two steps (chunked prefill),
        // under hashes of its own.
        index.apply(&stored(&[100, 101], None, &[1, 2, 3, 4], 2), 64);
        index.apply(&stored(&[102], Some(101), &[5, 6], 2), 64);
        let prompt = hash::chain(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 2);
        assert_eq!(index.matched_blocks(&prompt), 3);
        assert_eq!(index.matched_blocks(&hash::chain(&[1, 2, 9, 9], 2)), 1);
        // A parent it never heard of: not placeable, ignored.
        index.apply(&stored(&[200], Some(999), &[7, 8], 2), 64);
        assert_eq!(index.len(), 3);
        index.apply(
            &KvEvent::BlockRemoved {
                block_hashes: vec![EngineHash(101)],
                medium: None,
            },
            64,
        );
        assert_eq!(index.matched_blocks(&prompt), 1, "a hole ends the prefix");
        index.apply(&KvEvent::AllBlocksCleared {}, 64);
        assert!(index.is_empty());
    }

    #[test]
    fn sent_prompts_stand_in_for_events_until_the_first_event() {
        let mut index = BlockIndex::default();
        let ids: Vec<u32> = (0..10).collect();
        index.remember(&ids, 4, 64);
        assert_eq!(index.matched_blocks(&hash::chain(&ids, 4)), 2);
        assert!(!index.is_reported());
        index.apply(&stored(&[1], None, &[9, 9, 9, 9], 4), 64);
        assert!(index.is_reported());
        assert_eq!(index.matched_blocks(&hash::chain(&ids, 4)), 0);
        index.remember(&ids, 4, 64);
        assert_eq!(index.len(), 1, "an engine that reports is not guessed");
    }

    #[test]
    fn the_index_keeps_at_most_its_cap_dropping_the_oldest() {
        let mut index = BlockIndex::default();
        let tokens: Vec<u32> = (0..20).collect();
        let hashes: Vec<u64> = (0..10).collect();
        index.apply(&stored(&hashes, None, &tokens, 2), 4);
        assert_eq!(index.len(), 4);
        assert_eq!(index.by_engine.len(), 4);
        // The newest four (the prompt's tail) are what is left.
        let prompt = hash::chain(&tokens, 2);
        assert_eq!(index.matched_blocks(&prompt), 0);
        assert!(index.entries.contains_key(&prompt[9]));
    }
}
