//! A background response's events, copied into the shared store as the
//! generation makes them, so that any replica can serve them; and a `cancel`
//! asked on another replica, noticed here.
//!
//! The generating replica keeps every event in its own memory (`Live`) and
//! serves its own readers from there; the mirror follows it like one more
//! reader. A failed write is retried (appends skip what the store already
//! has, so a write that landed but whose answer was lost is not doubled);
//! while Redis is down the events wait in `Live`, whose bound they are within.

use super::live::Live;
use super::redis_store::{AppendError, LogState, RedisStore};
use crate::protocols::event::Event;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the generating replica looks for a cancel asked elsewhere.
pub const CANCEL_POLL: Duration = Duration::from_millis(250);

/// Backoff between failed writes.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Writes what `live` has now (the response as it starts) with `origin`
/// (what a replica taking it over needs); whether it was written (if not,
/// the mirror writes both again).
pub async fn publish(
    store: &RedisStore,
    id: &str,
    token: &str,
    live: &Live,
    origin: &Value,
) -> bool {
    match write(store, id, token, live, None, Some(origin)).await {
        Ok(_) => true,
        Err(err) => {
            tracing::warn!(id, %err, "a background response is not in the response store yet");
            false
        }
    }
}

/// What one write left written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Written {
    /// The last event's sequence number.
    last: Option<u64>,
    /// Events covered by the checkpoint written.
    through: usize,
    done: bool,
    /// Whether a cancel was asked (on any replica).
    cancel_asked: bool,
}

/// One write of `live`'s events after `written` up to its last checkpoint,
/// its state and the checkpoint.
async fn write(
    store: &RedisStore,
    id: &str,
    token: &str,
    live: &Live,
    written: Option<u64>,
    origin: Option<&Value>,
) -> Result<Written, AppendError> {
    let snapshot = live.snapshot(written);
    // A generation handed over is not done: another replica goes on.
    let done = snapshot.done && !live.fenced();
    let state = LogState {
        tenant: live.tenant.clone(),
        response: snapshot.response,
        done,
    };
    let cancel_asked = store
        .append(
            id,
            token,
            &state,
            &snapshot.events,
            snapshot.checkpoint.as_ref(),
            origin,
        )
        .await?;
    let last = snapshot.events.last().and_then(Event::sequence);
    Ok(Written {
        last: last.or(written),
        through: snapshot.through,
        done,
        cancel_asked,
    })
}

/// Copies `live` (background response `id`, leased with `token`) into
/// `store` until it is done and written, or until `stop` (the router
/// stopping) and one last write; renews the lease meanwhile. Another replica
/// having taken the lease (this one was thought dead) stops the generation
/// here, without another word written.
pub async fn mirror(
    store: Arc<RedisStore>,
    id: String,
    token: String,
    live: Arc<Live>,
    mut origin: Option<Value>,
    stop: CancellationToken,
) {
    let mut changes = live.follow();
    let mut written = Written::default();
    let mut backoff = RETRY_MIN;
    let mut polled = tokio::time::Instant::now();
    let renew_every = store.lease() / 3;
    let mut renewed = tokio::time::Instant::now();
    let mut first = true;
    loop {
        if stop.is_cancelled() && !live.done() {
            // The router stops: the generation goes on elsewhere.
            live.fence();
        }
        if live.fenced() {
            return hand_over(&store, &id, &token, &live, written.last).await;
        }
        changes.borrow_and_update();
        // Nothing new since the last checkpoint written: no write, unless
        // the lease wants renewing.
        let due = first
            || live.checkpoint_mark() != (written.through, written.done)
            || renewed.elapsed() >= renew_every;
        let outcome = if due {
            write(&store, &id, &token, &live, written.last, origin.as_ref()).await
        } else {
            Ok(written)
        };
        match outcome {
            Ok(now) => {
                backoff = RETRY_MIN;
                if due {
                    origin = None;
                }
                if due {
                    // Every write renews the lease.
                    renewed = tokio::time::Instant::now();
                }
                first = false;
                written = now;
                live.mark_durable(now.through);
                if now.done {
                    return;
                }
            }
            Err(AppendError::Fenced) => {
                tracing::warn!(
                    id,
                    "another replica took this background response over; stopping it here"
                );
                live.fence();
                return;
            }
            Err(AppendError::Store(err)) => {
                tracing::debug!(id, %err, "background response not mirrored yet; retrying");
                // Readers are not held up while the store is down.
                live.ungate();
                if stop.is_cancelled() {
                    // The router stops with the store down: what it could
                    // not write is lost with it (the lease expires, and
                    // another replica goes on from the last checkpoint).
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.cancelled() => {}
                }
                backoff = (backoff * 2).min(RETRY_MAX);
                continue;
            }
        }
        // A cancel asked on any replica: every write says so; without
        // writes, a look once per CANCEL_POLL.
        let asked = if due {
            polled = tokio::time::Instant::now();
            written.cancel_asked
        } else if polled.elapsed() >= CANCEL_POLL {
            polled = tokio::time::Instant::now();
            store.cancel_requested(&id).await.unwrap_or(false)
        } else {
            false
        };
        if asked && !live.cancel.is_cancelled() {
            tracing::info!(id, "background response cancelled through another replica");
            live.cancel.cancel();
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep(CANCEL_POLL.min(renew_every)) => {}
            _ = stop.cancelled() => {}
        }
    }
}

/// This replica stops (the generation was fenced as it stopped): writes the
/// last events (not as done) and lets the lease go, so that another replica
/// takes the generation over at its next look instead of after the lease.
async fn hand_over(store: &RedisStore, id: &str, token: &str, live: &Live, written: Option<u64>) {
    match write(store, id, token, live, written, None).await {
        Ok(_) => {}
        Err(AppendError::Fenced) => return,
        Err(AppendError::Store(err)) => {
            tracing::warn!(id, %err, "handing a background response over: its last events not written");
        }
    }
    match store.release_lease(id, token).await {
        Ok(()) => tracing::info!(id, "background response handed over to another replica"),
        Err(err) => {
            tracing::warn!(id, %err, "handing a background response over: its lease is left to expire")
        }
    }
}
