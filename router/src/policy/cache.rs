//! `cache_aware`: send a prompt to the instance whose KV cache holds the
//! longest prefix of it, unless that would pile load on one instance. The
//! thresholds are those of SGLang's and vllm-router's `cache_aware`:
//! - load is imbalanced when the most and least loaded candidates differ by
//!   more than `balance_abs` requests *and* the most has more than
//!   `balance_rel` times the least's load: then the least loaded wins;
//! - otherwise the longest cached prefix wins if it covers at least
//!   `cache` of the prompt; below that, the least loaded (a prompt with
//!   little to reuse goes where there is room).
//!
//! Cached prefixes come from each instance's [`crate::prefix::BlockIndex`]
//! (fed by its KV events); load from [`super::load::score`].

use crate::config::RoutingArgs;
use crate::membership::Instance;
use crate::prefix::hash::{self, Prompt};
use std::sync::Arc;

/// `--cache-threshold`, `--balance-abs-threshold`, `--balance-rel-threshold`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    pub cache: f64,
    pub balance_abs: f64,
    pub balance_rel: f64,
}

impl Thresholds {
    /// `cache_aware`'s three thresholds, from the routing group: the one
    /// place they are read, kept by each `Selector` as the value `choose` takes.
    pub fn of(routing: &RoutingArgs) -> Self {
        Self {
            cache: routing.cache_threshold,
            balance_abs: routing.balance_abs_threshold,
            balance_rel: routing.balance_rel_threshold,
        }
    }
}

/// Why `cache_aware` chose an instance (the `reason` label of
/// `connex_routing_decisions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// It holds the longest prefix of the prompt.
    Cache,
    /// Load was imbalanced past the thresholds: the least loaded.
    Load,
    /// No prefix worth reusing (or no prompt ids): the least loaded.
    Fallback,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Cache => "cache",
            Reason::Load => "load",
            Reason::Fallback => "fallback",
        }
    }
}

/// One candidate as `cache_aware` sees it.
#[derive(Debug, Clone)]
pub struct Scored<'a> {
    pub instance: &'a Arc<Instance>,
    pub load: f64,
    /// Prompt tokens its cache holds (whole blocks).
    pub hit_tokens: usize,
}

/// The prompt's cached tokens on each candidate (0 where the instance sent no
/// events), hashing the prompt once per block size in use.
pub fn hits(candidates: &[&Arc<Instance>], prompt: Prompt<'_>) -> Vec<usize> {
    let mut chains: Vec<(usize, Vec<u64>)> = Vec::new();
    candidates
        .iter()
        .map(|c| {
            c.with_blocks(|index| {
                let Some(size) = index.block_size().filter(|_| !index.is_empty()) else {
                    return 0;
                };
                let at = match chains.iter().position(|(s, _)| *s == size) {
                    Some(at) => at,
                    None => {
                        chains.push((size, hash::chain_from(prompt.root, prompt.ids, size)));
                        chains.len() - 1
                    }
                };
                index.matched_blocks(&chains[at].1) * size
            })
        })
        .collect()
}

/// The choice among `scored` (non-empty, in round-robin order so that ties
/// spread) for a prompt of `prompt_len` tokens.
pub fn choose(scored: &[Scored<'_>], prompt_len: usize, t: Thresholds) -> (usize, Reason) {
    let least = |scored: &[Scored<'_>]| {
        (0..scored.len())
            .min_by(|&a, &b| scored[a].load.total_cmp(&scored[b].load))
            .unwrap_or(0)
    };
    let (min, max) = scored
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), s| {
            (lo.min(s.load), hi.max(s.load))
        });
    if max - min > t.balance_abs && max > min * t.balance_rel {
        return (least(scored), Reason::Load);
    }
    let best = (0..scored.len()).max_by(|&a, &b| {
        scored[a]
            .hit_tokens
            .cmp(&scored[b].hit_tokens)
            // Equal hits: the less loaded (max_by keeps the last maximum).
            .then(scored[b].load.total_cmp(&scored[a].load))
            .then(b.cmp(&a))
    });
    match best {
        Some(best)
            if scored[best].hit_tokens > 0
                && scored[best].hit_tokens as f64 >= t.cache * prompt_len as f64 =>
        {
            (best, Reason::Cache)
        }
        _ => (least(scored), Reason::Fallback),
    }
}
