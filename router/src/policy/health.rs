//! Active health checks: the router probes the `/health` of every ready
//! instance and declares dead one that fails `--health-check-failures` probes
//! in a row. Heartbeats say that an instance's agent lives; a probe says that
//! its server answers. The difference matters for resume: a decoder that hangs,
//! or whose process is being torn down after a crash (its sockets stay open
//! while the kernel frees its memory), sends no bytes and closes nothing, so
//! without probes its streams wait for the stall timeout or the heartbeat TTL.
//! Declared dead, its streams resume at once (cause `dead`), and it gets no new
//! requests until a probe succeeds again: not a heartbeat, since the agent
//! that sends them can outlive the server (vLLM's API server answers `/health`
//! with 503 once its engine core died, while its process heartbeats on).
//!
//! Probes are evidence only when nothing contradicts them: on a saturated
//! machine a probe times out while the decoder's streams flow. An instance
//! whose streams delivered tokens within the probing window is not declared
//! dead, and ejection is bounded: when declaring one more instance dead would
//! leave fewer than half of its kind (role and model) in rotation, the router
//! keeps routing to all (Envoy's `max_ejection_percent` and panic threshold).

use super::outlier::{ejection_allowed, Outliers};
use crate::config::HealthArgs;
use crate::engines::probe::ProbeClient;
use crate::membership::{Instance, Lifecycle, Registry};
use crate::observe::metrics;
use futures_util::future::join_all;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Starts the probing task on `tasks`, stopped by `shutdown`; a zero
/// interval turns probing off.
pub fn spawn(
    checks: HealthArgs,
    registry: Arc<Registry>,
    client: ProbeClient,
    outliers: Arc<Outliers>,
    tasks: &mut JoinSet<()>,
    shutdown: CancellationToken,
) {
    Prober(checks).spawn(registry, client, outliers, tasks, shutdown);
}

/// The probes, run as their group of flags (`--health-check-*`) says.
#[derive(Debug, Clone, Copy)]
struct Prober(HealthArgs);

impl Prober {
    fn spawn(
        self,
        registry: Arc<Registry>,
        client: ProbeClient,
        outliers: Arc<Outliers>,
        tasks: &mut JoinSet<()>,
        shutdown: CancellationToken,
    ) {
        if self.0.health_check_interval.is_zero() {
            return;
        }
        tasks.spawn(async move {
            let mut failed: HashMap<String, u32> = HashMap::new();
            let mut tick = tokio::time::interval(self.0.health_check_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => {}
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = self.round(&registry, &client, &outliers, &mut failed) => {}
                }
            }
        });
    }

    /// Probes every ready instance, and every one the probes declared dead, at
    /// once; counts failures in a row.
    async fn round(
        &self,
        registry: &Registry,
        client: &ProbeClient,
        outliers: &Outliers,
        failed: &mut HashMap<String, u32>,
    ) {
        let probed: Vec<Arc<Instance>> = registry
            .list()
            .into_iter()
            .filter(|i| i.lifecycle() == Lifecycle::Ready || i.awaits_probe())
            .collect();
        let outcomes = join_all(probed.iter().map(|i| self.probe(client, i))).await;
        // Forget instances that are no longer probed (dead, drained, removed),
        // and the outlier state of those the registry no longer knows.
        failed.retain(|id, _| probed.iter().any(|i| &i.id == id));
        outliers.retain(|id| registry.get(id).is_some());
        for (instance, outcome) in probed.iter().zip(outcomes) {
            if instance.awaits_probe() {
                // Out of rotation until it answers again.
                if outcome.is_ok() {
                    registry.mark_healthy(&instance.id);
                }
                continue;
            }
            let Err(why) = outcome else {
                failed.remove(&instance.id);
                continue;
            };
            metrics::health_check_failed(&instance.id);
            let count = failed.entry(instance.id.clone()).or_default();
            *count += 1;
            tracing::warn!(id = %instance.id, %why, failures = *count, "health check failed");
            if *count < self.0.health_check_failures {
                continue;
            }
            if outliers.delivered_within(&instance.id, self.window()) {
                metrics::ejection_refused(&instance.id, "delivering");
                continue;
            }
            let kind: Vec<&Arc<Instance>> =
                probed.iter().filter(|i| same_kind(i, instance)).collect();
            let ejected = kind.iter().filter(|i| i.is_unhealthy()).count();
            // A static instance has no heartbeats to vouch for it: its probes
            // are the only evidence, so the ejection bound does not hold it in.
            if !instance.persistent && !ejection_allowed(kind.len(), ejected + 1) {
                metrics::ejection_refused(&instance.id, "bound");
                tracing::warn!(id = %instance.id, "not declared dead: too few instances of its kind would remain");
                continue;
            }
            failed.remove(&instance.id);
            registry.mark_unhealthy(&instance.id);
        }
    }

    /// The span of the failed probes that would declare an instance dead:
    /// tokens delivered within it contradict them.
    fn window(&self) -> std::time::Duration {
        self.0.health_check_interval * self.0.health_check_failures + self.0.health_check_timeout
    }

    async fn probe(&self, client: &ProbeClient, instance: &Instance) -> Result<(), String> {
        let url = format!("{}/health", instance.url.trim_end_matches('/'));
        let started = tokio::time::Instant::now();
        let mut reply = client
            .get(&url, self.0.health_check_timeout)
            .await
            .map_err(|e| e.to_string())?;
        if !(200..300).contains(&reply.status) {
            return Err(format!("HTTP {}", reply.status));
        }
        // Its body read to the end (a few bytes, bounded) puts the connection
        // back in the pool for the next probe; one that does not end in time
        // or is long is left (and closed): the answer was a success anyway.
        let rest = self
            .0
            .health_check_timeout
            .saturating_sub(started.elapsed());
        let _ = tokio::time::timeout(rest, async {
            let mut read = 0;
            while let Ok(Some(chunk)) = reply.body.chunk().await {
                read += chunk.len();
                if read > MAX_HEALTH_BODY {
                    break;
                }
            }
        })
        .await;
        Ok(())
    }
}

/// Most bytes of a `/health` answer read (vLLM's is empty).
const MAX_HEALTH_BODY: usize = 64 * 1024;

fn same_kind(a: &Instance, b: &Instance) -> bool {
    a.role == b.role && a.model == b.model
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::registration::Role;
    use crate::membership::Registration;
    use std::time::Duration;

    fn probe_client() -> ProbeClient {
        let policy = crate::engines::addresses::UpstreamPolicy::parse(None).expect("policy");
        ProbeClient::new(crate::engines::http::EngineClient::guarded(
            Duration::from_secs(1),
            8,
            Duration::from_secs(4),
            Arc::new(policy),
        ))
    }

    /// Two decoders whose probes fail (nothing listens at their address).
    async fn registry() -> Registry {
        let registry = Registry::new(&crate::config::MembershipArgs::with_ttl(
            Duration::from_secs(60),
        ));
        for id in ["d0", "d1"] {
            registry
                .register(
                    Registration {
                        role: Role::Decode,
                        url: "http://127.0.0.1:1".into(),
                        model: "m".into(),
                        ctrl: None,
                        id: Some(id.into()),
                        persistent: false,
                        credential: None,
                    },
                    crate::membership::Claim::Admin,
                )
                .await
                .expect("register");
        }
        registry
    }

    const CHECKS: Prober = Prober(HealthArgs {
        health_check_interval: Duration::from_millis(100),
        health_check_timeout: Duration::from_millis(200),
        health_check_failures: 1,
    });

    fn unhealthy(registry: &Registry) -> Vec<String> {
        registry
            .list()
            .iter()
            .filter(|i| i.is_unhealthy())
            .map(|i| i.id.clone())
            .collect()
    }

    #[tokio::test]
    async fn failed_probes_declare_dead_only_within_the_ejection_bound() {
        let registry = registry().await;
        let outliers = Outliers::default();
        let mut failed = HashMap::new();
        CHECKS
            .round(&registry, &probe_client(), &outliers, &mut failed)
            .await;
        // Both fail their probes; declaring the second dead too would leave
        // none of the two in rotation.
        assert_eq!(unhealthy(&registry), vec!["d0"]);
    }

    #[tokio::test]
    async fn a_decoder_whose_streams_deliver_is_not_declared_dead() {
        let registry = registry().await;
        let outliers = Outliers::default();
        outliers.clock("d0").tick();
        let mut failed = HashMap::new();
        CHECKS
            .round(&registry, &probe_client(), &outliers, &mut failed)
            .await;
        assert_eq!(unhealthy(&registry), vec!["d1"]);
    }
}
