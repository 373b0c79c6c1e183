//! Choosing an instance: one `select` call over the eligible candidates, and
//! the outliers ([`outlier`]) that new requests avoid.

pub mod cache;
pub mod health;
pub mod load;
pub mod outlier;

use crate::membership::Instance;
use crate::prefix::hash::Prompt;
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
    thresholds: cache::Thresholds,
}

/// What [`Selector::select_for`] chose, and why.
#[derive(Debug, Clone)]
pub struct Decision {
    pub instance: Arc<Instance>,
    /// `cache_aware` only: why this one.
    pub reason: Option<cache::Reason>,
    /// Prompt tokens its cache holds (`cache_aware` only; else 0).
    pub hit_tokens: usize,
}

impl Selector {
    /// The policy `kind`; `thresholds` are `cache_aware`'s (the others
    /// ignore them).
    pub fn new(kind: PolicyKind, report_max_age: Duration, thresholds: cache::Thresholds) -> Self {
        Self {
            kind,
            cursor: AtomicUsize::new(0),
            report_max_age,
            thresholds,
        }
    }

    /// Whether the policy reads the prompt's token ids (the caller then gets
    /// them before choosing).
    pub fn wants_prompt(&self) -> bool {
        self.kind == PolicyKind::CacheAware
    }

    /// Like [`Selector::select`], with the prompt's token ids for `cache_aware`.
    pub fn select_for(
        &self,
        candidates: &[Arc<Instance>],
        exclude: &[String],
        prompt: Option<Prompt<'_>>,
    ) -> Option<Decision> {
        if self.kind != PolicyKind::CacheAware {
            return self.select(candidates, exclude).map(|instance| Decision {
                instance,
                reason: None,
                hit_tokens: 0,
            });
        }
        // Round-robin order, so that ties spread.
        let pool: Vec<&Arc<Instance>> = self.rotated(&eligible(candidates, exclude)?).collect();
        let hits = match prompt {
            Some(prompt) => cache::hits(&pool, prompt),
            None => vec![0; pool.len()],
        };
        let scored: Vec<cache::Scored> = pool
            .iter()
            .zip(hits)
            .map(|(instance, hit_tokens)| cache::Scored {
                instance,
                load: self.load(instance),
                hit_tokens,
            })
            .collect();
        let prompt_len = prompt.map_or(0, |p| p.ids.len());
        let (at, reason) = cache::choose(&scored, prompt_len, self.thresholds);
        Some(Decision {
            instance: scored[at].instance.clone(),
            reason: Some(reason),
            hit_tokens: scored[at].hit_tokens,
        })
    }

    /// The load score of `instance` (see [`load::score`]).
    pub fn load(&self, instance: &Instance) -> f64 {
        load::score(instance, self.report_max_age)
    }

    /// The least loaded of `pool` by [`Selector::load`], ties broken round
    /// robin so that equal loads still spread.
    fn least_load<'a>(&self, pool: &[&'a Arc<Instance>]) -> Option<&'a Arc<Instance>> {
        self.rotated(pool)
            .map(|c| (c, self.load(c)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(c, _)| c)
    }

    /// `pool` from the cursor's next turn on, wrapping around: each call
    /// starts one further, so that ties spread.
    fn rotated<'a, 'p>(
        &self,
        pool: &'p [&'a Arc<Instance>],
    ) -> impl Iterator<Item = &'a Arc<Instance>> + 'p {
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let n = pool.len();
        (0..n).map(move |i| pool[(start + i) % n])
    }

    /// Picks one of `candidates` whose id is not in `exclude`.
    pub fn select(
        &self,
        candidates: &[Arc<Instance>],
        exclude: &[String],
    ) -> Option<Arc<Instance>> {
        let pool = eligible(candidates, exclude)?;
        let chosen = match self.kind {
            PolicyKind::RoundRobin => self.rotated(&pool).next()?,
            // Ties broken round-robin so equal loads still spread.
            PolicyKind::LeastLoaded => self.rotated(&pool).min_by_key(|c| c.inflight())?,
            PolicyKind::LoadAware | PolicyKind::CacheAware => self.least_load(&pool)?,
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

/// The candidates whose id is not in `exclude`; None when none is left.
fn eligible<'a>(
    candidates: &'a [Arc<Instance>],
    exclude: &[String],
) -> Option<Vec<&'a Arc<Instance>>> {
    let pool: Vec<&Arc<Instance>> = candidates
        .iter()
        .filter(|c| !exclude.contains(&c.id))
        .collect();
    (!pool.is_empty()).then_some(pool)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::MembershipArgs;
    use crate::membership::load::EngineLoad;
    use crate::membership::registration::Role;
    use crate::membership::{Claim, Pick, Registration, Registry};

    /// `cache_aware`'s thresholds at their flags' defaults
    /// (`--cache-threshold` 0.3, `--balance-abs-threshold` 64,
    /// `--balance-rel-threshold` 1.5), which these tests' numbers assume.
    pub(super) const THRESHOLDS: cache::Thresholds = cache::Thresholds {
        cache: 0.3,
        balance_abs: 64.0,
        balance_rel: 1.5,
    };

    /// `n` instances of `role` named `{prefix}0..`, with their credentials.
    pub(super) async fn registered(role: Role, prefix: &str, n: usize) -> (Registry, Vec<String>) {
        let registry = Registry::new(&MembershipArgs::with_ttl(Duration::from_secs(10)));
        let mut credentials = Vec::new();
        for i in 0..n {
            let reg = Registration {
                persistent: false,
                role,
                url: format!("http://10.0.0.{i}:8000"),
                model: "m".into(),
                ctrl: None,
                id: Some(format!("{prefix}{i}")),
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

    async fn decoders(n: usize) -> (Registry, Vec<String>) {
        registered(Role::Decode, "d", n).await
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
        let selector = Selector::new(PolicyKind::LoadAware, Duration::from_secs(10), THRESHOLDS);
        let candidates = registry.eligible("m", Pick::Decode);
        for _ in 0..4 {
            assert_eq!(selector.select(&candidates, &[]).unwrap().id, "d1");
        }
        // This replica's own requests count too: eleven in flight on d1 weigh
        // more than d0's reported ten.
        let _held: Vec<_> = (0..11)
            .map(|_| crate::membership::LoadGuard::new(candidates[1].clone()))
            .collect();
        assert_eq!(selector.select(&candidates, &[]).unwrap().id, "d0");
        // A stale report is ignored.
        let stale = Selector::new(PolicyKind::LoadAware, Duration::ZERO, THRESHOLDS);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(stale.select(&candidates, &[]).unwrap().id, "d0");
    }
}

#[cfg(test)]
mod cache_tests {
    #![allow(clippy::unwrap_used)]
    use super::tests::THRESHOLDS;
    use super::*;
    use crate::membership::registration::Role;
    use crate::membership::{Claim, Pick, Registration, Registry};
    use crate::prefix::KvEventBatch;

    /// Two prefills, `p0` holding the first 4 blocks (of 4 tokens) of 0..32.
    async fn prefills() -> (Registry, Vec<String>) {
        let (registry, credentials) = super::tests::registered(Role::Prefill, "p", 2).await;
        let batch: KvEventBatch = serde_json::from_value(serde_json::json!({"events": [
            {"type": "BlockStored", "block_hashes": ["a", "b", "c", "d"], "parent_block_hash": null,
             "token_ids": (0..16).collect::<Vec<u32>>(), "block_size": 4}
        ]}))
        .unwrap();
        registry
            .kv_events("p0", Some(&credentials[0]), &batch, 100)
            .unwrap();
        (registry, credentials)
    }

    fn choose(selector: &Selector, registry: &Registry, prompt: &[u32]) -> (String, cache::Reason) {
        let candidates = registry.eligible("m", Pick::Prefill);
        let prompt = Prompt::new(prompt, crate::prefix::hash::ROOT);
        let d = selector.select_for(&candidates, &[], Some(prompt)).unwrap();
        (d.instance.id.clone(), d.reason.unwrap())
    }

    #[tokio::test]
    async fn the_longest_prefix_wins_until_load_or_a_small_hit_says_otherwise() {
        let (registry, _) = prefills().await;
        let selector = Selector::new(PolicyKind::CacheAware, Duration::from_secs(10), THRESHOLDS);
        let prompt: Vec<u32> = (0..32).collect();
        for _ in 0..3 {
            assert_eq!(
                choose(&selector, &registry, &prompt),
                ("p0".into(), cache::Reason::Cache)
            );
        }
        // 16 of 80 tokens cached is under the 0.3 threshold: least loaded.
        let long: Vec<u32> = (0..80).collect();
        let p0 = registry.get("p0").unwrap();
        let _busy = crate::membership::LoadGuard::new(p0.clone());
        assert_eq!(
            choose(&selector, &registry, &long),
            ("p1".into(), cache::Reason::Fallback)
        );
        // Imbalance past both thresholds overrides the prefix.
        let strict = Selector::new(
            PolicyKind::CacheAware,
            Duration::from_secs(10),
            cache::Thresholds {
                balance_abs: 0.5,
                ..THRESHOLDS
            },
        );
        assert_eq!(
            choose(&strict, &registry, &prompt),
            ("p1".into(), cache::Reason::Load)
        );
        // Without prompt ids: by load.
        let candidates = registry.eligible("m", Pick::Prefill);
        let d = selector.select_for(&candidates, &[], None).unwrap();
        assert_eq!(d.instance.id, "p1");
    }

    #[tokio::test]
    async fn a_re_registration_clears_the_index() {
        let (registry, credentials) = prefills().await;
        assert_eq!(registry.get("p0").unwrap().with_blocks(|b| b.len()), 4);
        let reg = Registration {
            persistent: false,
            role: Role::Prefill,
            url: "http://10.0.0.0:8000".into(),
            model: "m".into(),
            ctrl: None,
            id: Some("p0".into()),
            credential: None,
        };
        registry
            .register(reg, Claim::Registrant(Some(&credentials[0])))
            .await
            .unwrap();
        assert_eq!(registry.get("p0").unwrap().with_blocks(|b| b.len()), 0);
    }
}
