//! Choosing an instance: one `select` call over the eligible candidates, and
//! the outliers ([`outlier`]) that new requests avoid.

pub mod load;
pub mod outlier;

use crate::registry::Instance;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Defined with the flags that name it (config is a leaf).
pub use crate::config::PolicyKind;

/// A policy with its state (the round-robin cursor).
#[derive(Debug)]
pub struct Selector {
    kind: PolicyKind,
    cursor: AtomicUsize,
    /// Engine-reported load older than this is ignored (the heartbeat TTL).
    report_max_age: Duration,
}

impl Selector {
    pub fn new(kind: PolicyKind, report_max_age: Duration) -> Self {
        Self {
            kind,
            cursor: AtomicUsize::new(0),
            report_max_age,
        }
    }

    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// The load score of `instance` (see [`load::score`]).
    pub fn load(&self, instance: &Instance) -> f64 {
        load::score(instance, self.report_max_age)
    }

    /// The least loaded of `pool` by [`Selector::load`], ties broken round
    /// robin so that equal loads still spread.
    fn least_load<'a>(&self, pool: &[&'a Arc<Instance>]) -> Option<&'a Arc<Instance>> {
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let n = pool.len();
        (0..n)
            .map(|i| pool[(start + i) % n])
            .map(|c| (c, self.load(c)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(c, _)| c)
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
            PolicyKind::LoadAware => self.least_load(&pool)?,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::registry::load::EngineLoad;
    use crate::registry::{Claim, Phase, Registration, Registry, RegistryConfig, Role};

    async fn decoders(n: usize) -> (Registry, Vec<String>) {
        let registry = Registry::new(&RegistryConfig::memory(Duration::from_secs(10)));
        let mut credentials = Vec::new();
        for i in 0..n {
            let reg = Registration {
                role: Role::Decode,
                url: format!("http://10.0.0.{i}:8000"),
                model: "m".into(),
                ctrl: None,
                id: Some(format!("d{i}")),
                credential: None,
            };
            let (_, credential) = registry
                .register(reg, Claim::Registrant(None))
                .await
                .unwrap();
            credentials.push(credential);
        }
        (registry, credentials)
    }

    #[tokio::test]
    async fn load_aware_steers_by_reported_load_and_local_inflight() {
        let (registry, credentials) = decoders(2).await;
        let busy = EngineLoad {
            running: 4,
            waiting: 6,
            kv_usage: 0.0,
        };
        registry
            .heartbeat("d0", Some(&credentials[0]), Some(busy))
            .await
            .unwrap();
        let selector = Selector::new(PolicyKind::LoadAware, Duration::from_secs(10));
        let candidates = registry.eligible("m", Phase::Decode);
        for _ in 0..4 {
            assert_eq!(selector.select(&candidates, &[]).unwrap().id, "d1");
        }
        // This replica's own requests count too: eleven in flight on d1 weigh
        // more than d0's reported ten.
        let _held: Vec<_> = (0..11)
            .map(|_| crate::registry::LoadGuard::new(candidates[1].clone()))
            .collect();
        assert_eq!(selector.select(&candidates, &[]).unwrap().id, "d0");
        // A stale report is ignored.
        let stale = Selector::new(PolicyKind::LoadAware, Duration::ZERO);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(stale.select(&candidates, &[]).unwrap().id, "d0");
    }
}
