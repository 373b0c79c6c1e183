//! Keeps every key of a running background response alive in the shared
//! store (`--response-store-ttl`) as long as the response runs. Appends
//! renew the keys they write, but not those written once (`:origin`, the
//! request a replica taking the generation over starts from): without this,
//! a generation longer than the TTL could no longer be taken over. Each
//! replica renews all running ones (a few cheap scripts per period), so a
//! replica's death does not stop the renewals of what it ran.

use super::redis::RedisStore;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Renews the running responses' TTLs until `stop`.
pub fn spawn(
    store: Arc<RedisStore>,
    tasks: &mut tokio::task::JoinSet<()>,
    stop: CancellationToken,
) {
    tasks.spawn(async move {
        let every = store.renew_every();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.cancelled() => return,
            }
            if let Err(err) = store.renew_running().await {
                tracing::debug!(%err, "running responses' TTLs not renewed this time");
            }
        }
    });
}
