//! One instance's index of the prompt blocks its KV cache holds, bounded: past
//! its cap the oldest stored block is forgotten (the engine may still hold it;
//! the router then merely misses a hit).

use super::events::{EngineHash, KvEvent};
use super::hash::{self, Prompt};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

/// The blocks all instances' indexes may hold together
/// (`--prefix-index-total-blocks`): each registrant's index has its own cap,
/// and this bounds them all, however many instances register (at 16,384 a
/// piece, 1,024 registrants' KV events could hold 16 M blocks, about 1.3 GB).
/// An index that would pass it forgets its own oldest block first; one with
/// none to forget indexes nothing new until others' blocks go.
#[derive(Debug)]
pub struct BlockBudget {
    held: AtomicUsize,
    cap: AtomicUsize,
}

impl BlockBudget {
    pub fn new(cap: usize) -> Self {
        Self {
            held: AtomicUsize::new(0),
            cap: AtomicUsize::new(cap),
        }
    }

    /// The process's budget, which every index shares (its cap set at start).
    pub fn process() -> Arc<Self> {
        static PROCESS: LazyLock<Arc<BlockBudget>> =
            LazyLock::new(|| Arc::new(BlockBudget::new(usize::MAX)));
        PROCESS.clone()
    }

    pub fn set_cap(&self, cap: usize) {
        self.cap.store(cap, Ordering::Relaxed);
    }

    /// Blocks held by all indexes.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    fn full(&self) -> bool {
        self.held() > self.cap.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Clone, Copy)]
struct BlockEntry {
    stamp: u64,
    engine: EngineHash,
}

/// Block chain hashes (the router's, [`hash::chain`]) an instance holds.
#[derive(Debug)]
pub struct BlockIndex {
    /// The engine's block size, from its events.
    block_size: Option<usize>,
    entries: HashMap<u64, BlockEntry>,
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
    /// What all indexes hold together.
    budget: Arc<BlockBudget>,
}

impl Default for BlockIndex {
    fn default() -> Self {
        Self::with_budget(BlockBudget::process())
    }
}

impl Drop for BlockIndex {
    fn drop(&mut self) {
        self.budget
            .held
            .fetch_sub(self.entries.len(), Ordering::Relaxed);
    }
}

impl BlockIndex {
    /// An empty index counted in `budget`.
    pub fn with_budget(budget: Arc<BlockBudget>) -> Self {
        Self {
            block_size: None,
            entries: HashMap::new(),
            by_engine: HashMap::new(),
            order: BTreeMap::new(),
            next_stamp: 0,
            reported: false,
            budget,
        }
    }

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
        *self = Self::with_budget(self.budget.clone());
    }

    /// Whether the index comes from the engine's KV events (else from the
    /// prompts the router sent there, or nothing).
    pub fn is_reported(&self) -> bool {
        self.reported
    }

    /// The approximate index of an engine that sends no KV events: the full
    /// blocks of a prompt the router sent there, assumed cached until the cap
    /// pushes them out (the oldest first, as an engine's LRU would).
    pub fn remember(&mut self, prompt: Prompt<'_>, block_size: usize, cap: usize) {
        if self.reported || block_size == 0 {
            return;
        }
        if self.block_size != Some(block_size) {
            self.clear();
            self.block_size = Some(block_size);
        }
        for chain in hash::chain_from(prompt.root, prompt.ids, block_size) {
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
                            self.budget.held.fetch_sub(1, Ordering::Relaxed);
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
                let Some(salt) = event.prefix_salt() else {
                    return;
                };
                if *block_size == 0 {
                    return;
                }
                if self.block_size != Some(*block_size) {
                    self.clear();
                    self.reported = true;
                    self.block_size = Some(*block_size);
                }
                let parent = match parent_block_hash {
                    // A salted prompt's chain starts at its salt's root.
                    None => hash::root(salt),
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
        match self.entries.remove(&chain) {
            Some(old) => {
                self.order.remove(&old.stamp);
                self.by_engine.remove(&old.engine);
            }
            None => {
                self.budget.held.fetch_add(1, Ordering::Relaxed);
            }
        }
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        self.entries.insert(chain, BlockEntry { stamp, engine });
        self.by_engine.insert(engine, chain);
        self.order.insert(stamp, chain);
        // Past its own cap, or past what all indexes may hold: its own
        // oldest go (the new block last of all).
        while self.entries.len() > cap || (self.budget.full() && !self.entries.is_empty()) {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some(entry) = self.entries.remove(&oldest) {
                self.by_engine.remove(&entry.engine);
                self.budget.held.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], size: usize) -> KvEvent {
        salted(hashes, parent, tokens, size, None)
    }

    fn salted(
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        size: usize,
        salt: Option<&str>,
    ) -> KvEvent {
        let extra_keys = salt.map(|salt| {
            let mut keys = vec![serde_json::json!([salt])];
            keys.resize(hashes.len(), serde_json::Value::Null);
            Box::new(serde_json::Value::Array(keys))
        });
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: tokens.to_vec(),
            block_size: size,
            lora_id: None,
            lora_name: None,
            medium: None,
            extra_keys,
            group_idx: None,
        }
    }

    #[test]
    fn a_salted_prompt_matches_only_under_its_own_salt() {
        let mut index = BlockIndex::default();
        // Tenant a's prompt, stored under its salt in two events.
        index.apply(
            &salted(&[100, 101], None, &[1, 2, 3, 4], 2, Some("tenant:a")),
            64,
        );
        index.apply(&stored(&[102], Some(101), &[5, 6], 2), 64);
        let ids = [1, 2, 3, 4, 5, 6, 7];
        let under = |salt| hash::chain_from(hash::root(salt), &ids, 2);
        assert_eq!(index.matched_blocks(&under(Some("tenant:a"))), 3);
        assert_eq!(index.matched_blocks(&under(Some("tenant:b"))), 0);
        assert_eq!(
            index.matched_blocks(&under(None)),
            0,
            "not an unsalted prefix"
        );
        // The same tokens unsalted are a chain of their own.
        index.apply(&stored(&[200], None, &[1, 2], 2), 64);
        assert_eq!(index.matched_blocks(&under(None)), 1);
        assert_eq!(index.matched_blocks(&under(Some("tenant:b"))), 0);
        // Without events, what the router sent is remembered under its salt.
        let mut guessed = BlockIndex::default();
        let root = hash::root(Some("tenant:a"));
        guessed.remember(Prompt::new(&ids, root), 2, 64);
        assert_eq!(guessed.matched_blocks(&under(Some("tenant:a"))), 3);
        assert_eq!(guessed.matched_blocks(&under(Some("tenant:b"))), 0);
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
        index.remember(Prompt::new(&ids, hash::ROOT), 4, 64);
        assert_eq!(index.matched_blocks(&hash::chain(&ids, 4)), 2);
        assert!(!index.is_reported());
        index.apply(&stored(&[1], None, &[9, 9, 9, 9], 4), 64);
        assert!(index.is_reported());
        assert_eq!(index.matched_blocks(&hash::chain(&ids, 4)), 0);
        index.remember(Prompt::new(&ids, hash::ROOT), 4, 64);
        assert_eq!(index.len(), 1, "an engine that reports is not guessed");
    }

    #[test]
    fn all_indexes_together_keep_at_most_the_total() {
        let budget = Arc::new(BlockBudget::new(6));
        let mut first = BlockIndex::with_budget(budget.clone());
        let mut second = BlockIndex::with_budget(budget.clone());
        let tokens: Vec<u32> = (0..20).collect();
        let hashes: Vec<u64> = (0..10).collect();
        // Each under its own cap of 100; together at most 6.
        first.apply(&stored(&hashes, None, &tokens, 2), 100);
        assert_eq!((first.len(), budget.held()), (6, 6));
        let other: Vec<u64> = (50..60).collect();
        second.apply(&stored(&other, None, &tokens, 2), 100);
        // The second has none of its own to forget: it indexes nothing new.
        assert_eq!((second.len(), budget.held()), (0, 6));
        first.apply(&KvEvent::AllBlocksCleared {}, 100);
        assert_eq!(budget.held(), 0);
        second.apply(&stored(&other, None, &tokens, 2), 100);
        assert_eq!((second.len(), budget.held()), (6, 6));
        drop(second);
        assert_eq!(budget.held(), 0, "a removed instance gives its blocks back");
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
