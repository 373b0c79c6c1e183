//! Choosing an instance: one `select` call over the eligible candidates, and
//! the outliers ([`outlier`]) that new requests avoid.

pub mod outlier;

use crate::registry::Instance;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Defined with the flags that name it (config is a leaf).
pub use crate::config::PolicyKind;

/// A policy with its state (the round-robin cursor).
#[derive(Debug)]
pub struct Selector {
    kind: PolicyKind,
    cursor: AtomicUsize,
}

impl Selector {
    pub fn new(kind: PolicyKind) -> Self {
        Self {
            kind,
            cursor: AtomicUsize::new(0),
        }
    }

    /// Picks one of `candidates` whose id is not in `exclude`.
    pub fn select(
        &self,
        candidates: &[Arc<Instance>],
        exclude: &[String],
    ) -> Option<Arc<Instance>> {
        let pool: Vec<&Arc<Instance>> = candidates
            .iter()
            .filter(|c| !exclude.contains(&c.id))
            .collect();
        if pool.is_empty() {
            return None;
        }
        let chosen = match self.kind {
            PolicyKind::RoundRobin => {
                pool[self.cursor.fetch_add(1, Ordering::Relaxed) % pool.len()]
            }
            PolicyKind::LeastLoaded => {
                // Ties broken round-robin so equal loads still spread.
                let start = self.cursor.fetch_add(1, Ordering::Relaxed);
                let n = pool.len();
                (0..n)
                    .map(|i| pool[(start + i) % n])
                    .min_by_key(|c| c.inflight())?
            }
            PolicyKind::PowerOfTwo => {
                let a = pool[rand::random_range(0..pool.len())];
                let b = pool[rand::random_range(0..pool.len())];
                if b.inflight() < a.inflight() {
                    b
                } else {
                    a
                }
            }
        };
        Some(chosen.clone())
    }
}
