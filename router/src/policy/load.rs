//! How loaded an instance is, as one number for the policies to compare.
//!
//! Two sources, each blind to something: this replica's in-flight count is
//! current but knows nothing of other replicas' requests; the engine's own
//! report (heartbeats) counts everything but is up to a third of a TTL old.
//! The queue is the larger of the two, so that neither a burst this replica
//! just sent nor another replica's traffic goes unseen; a full KV cache adds
//! to it, since an engine out of blocks queues (or preempts) what comes next.

use crate::membership::Instance;
use std::time::Duration;

/// What a completely full KV cache weighs, in queued requests.
pub const KV_FULL_WEIGHT: f64 = 8.0;

/// The load of `instance`: requests queued or running on it, from this
/// replica's count and the engine's report if fresher than `max_age`.
pub fn score(instance: &Instance, max_age: Duration) -> f64 {
    let local = instance.inflight() as f64;
    match instance.reported_load(max_age) {
        Some(reported) => {
            let queue = f64::from(reported.running) + f64::from(reported.waiting);
            local.max(queue) + KV_FULL_WEIGHT * reported.kv_usage
        }
        None => local,
    }
}
