//! A background response's events, copied into the shared store as the
//! generation makes them, so that any replica can serve them; and a `cancel`
//! asked on another replica, noticed here.
//!
//! The generating replica keeps every event in its own memory (`Live`) and
//! serves its own readers from there; the mirror follows it like one more
//! reader. A failed write is retried (appends skip what the store already
//! has, so a write that landed but whose answer was lost is not doubled);
//! while Redis is down the events wait in `Live`, whose bound they are within,
//! and readers get nothing new: only what the store has.
//!
//! One generation per response: the writer's lease runs out in the store
//! no sooner than a lease after the write that renewed it was sent, so the
//! generation goes on here only until half a lease after that (`Live::
//! hold_until`), by this replica's clock, then pauses (its decoder stream
//! is not read) until a write succeeds: the lease was still this writer's
//! (or free, and taken again), and it goes on, with no second decode
//! request; or another replica had taken it over, and this one stops
//! without another word written. Paused for `GIVE_UP_LEASES` leases, it is
//! given up here (a replica takes it over from its last checkpoint once the
//! store is back).

use crate::protocols::client_event::ClientEvent;
use crate::store::live::Live;
use crate::store::redis::{Append, AppendError, AppendResponse, CheckpointWrite, RedisStore};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the generating replica looks for a cancel asked elsewhere.
pub const CANCEL_POLL: Duration = Duration::from_millis(250);

/// Backoff between failed writes (at most a quarter of the lease: a writer
/// paused by a store that came back goes on soon after).
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Leases a writer goes without one write before it gives its generation up.
const GIVE_UP_LEASES: u32 = 20;

/// How long after a write that renewed the lease was sent the generation may
/// go on: half the lease, which runs out in the store a whole lease after
/// that at the soonest (the half is the margin for the two clocks and for
/// the pause to take hold).
pub fn hold_for(lease: Duration) -> Duration {
    lease / 2
}

/// Most patches written after a whole checkpoint before the next whole one,
/// and most bytes of them per byte of the whole one (counted as at least
/// MIN_WHOLE_BYTES): a checkpoint that grows is written whole again at sizes
/// several times apart (the whole ones come to little more than the last),
/// and the store holds at most 17 times it, or 64 KiB more for a small one
/// (and 1024 patches).
const MAX_PATCHES: usize = 1024;
const PATCH_BYTES_PER_WHOLE: usize = 16;
const MIN_WHOLE_BYTES: usize = 4096;

/// What the store has of a background response, as its writer wrote it: the
/// writer sends only what changed since.
#[derive(Debug, Default)]
pub struct Sent {
    written: Written,
    /// The checkpoint as the store has it (its whole one with every patch
    /// applied); None: unknown (the next write sends it whole).
    checkpoint: Option<Value>,
    /// Bytes of the whole one, and of the patches after it (see
    /// `PATCH_BYTES_PER_WHOLE`).
    whole_bytes: usize,
    patch_bytes: usize,
    patches: usize,
    /// The response as the store has it (None: unknown).
    response: Option<Value>,
}

impl Sent {
    /// What this write sends of `checkpoint`, given what the store has.
    fn checkpoint_text(&self, checkpoint: &Value) -> Option<(bool, String)> {
        if let Some(had) = &self.checkpoint {
            let patch = crate::store::patch::diff(had, checkpoint)?;
            let text = patch.to_string();
            let allowed = self.whole_bytes.max(MIN_WHOLE_BYTES) * PATCH_BYTES_PER_WHOLE;
            if self.patch_bytes + text.len() <= allowed && self.patches < MAX_PATCHES {
                return Some((false, text));
            }
        }
        Some((true, checkpoint.to_string()))
    }

    /// The store's answer unknown: what it has is too.
    fn forget(&mut self) {
        self.checkpoint = None;
        self.response = None;
    }
}

/// Writes what `live` has now (the response as it starts) with `origin`
/// (what a replica taking it over needs); whether it was written (if not,
/// the mirror writes both again).
pub async fn publish(
    store: &RedisStore,
    id: &str,
    token: &str,
    live: &Live,
    origin: &Value,
    sent: &mut Sent,
) -> bool {
    let at = tokio::time::Instant::now();
    let writer = Writer {
        store,
        id,
        token,
        live,
    };
    match writer.write(sent, Some(origin)).await {
        Ok(()) => {
            live.hold_until(at + hold_for(store.lease()));
            true
        }
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

/// The writer of one background response: its store, its id and the token
/// of its lease there, its live log.
struct Writer<'a> {
    store: &'a RedisStore,
    id: &'a str,
    token: &'a str,
    live: &'a Live,
}

impl Writer<'_> {
    /// One write of `live`'s events after `written` up to its last checkpoint,
    /// its state and the checkpoint; at the end, the stored response with them:
    /// one script, under the lease (a client that read the last events can at
    /// once continue from the stored response).
    async fn write(&self, sent: &mut Sent, origin: Option<&Value>) -> Result<(), AppendError> {
        let result = self.write_once(sent, origin).await;
        let result = match result {
            // The store lost the checkpoint the patch was of: whole, at once.
            Err(AppendError::NoCheckpoint) => {
                sent.forget();
                self.write_once(sent, origin).await
            }
            other => other,
        };
        if result.is_err() {
            // Whether it landed is unknown: the next write sends all again.
            sent.forget();
        }
        result
    }

    async fn write_once(&self, sent: &mut Sent, origin: Option<&Value>) -> Result<(), AppendError> {
        let Writer {
            store,
            id,
            token,
            live,
        } = *self;
        let written = sent.written.last;
        let snapshot = live.snapshot(written);
        // A generation handed over is not done: another replica goes on.
        let done = snapshot.done && !live.fenced();
        // Its stored response goes with its last events, under the lease.
        let stored = if done { live.kept() } else { None };
        // The response as it stands changes with few events (created, in
        // progress, the end): written when it did (with its tenant, which the
        // store then has too); at the end, read by the store from the stored
        // response where that one holds the same.
        let response_changed = sent.response.as_ref() != Some(&snapshot.response);
        let response = match &stored {
            _ if !response_changed => AppendResponse::Kept,
            Some(kept)
                if serde_json::from_str::<Value>(kept.response.get())
                    .ok()
                    .as_ref()
                    == Some(&snapshot.response) =>
            {
                AppendResponse::Stored(&snapshot.response)
            }
            _ => AppendResponse::Whole(&snapshot.response),
        };
        let checkpoint = snapshot
            .checkpoint
            .as_ref()
            .and_then(|checkpoint| sent.checkpoint_text(checkpoint));
        let write = checkpoint.as_ref().map(|(whole, text)| match whole {
            true => CheckpointWrite::Whole(text),
            false => CheckpointWrite::Patch(text),
        });
        let append = Append {
            tenant: response_changed.then_some(live.tenant.as_str()),
            response,
            done,
            checkpoint: write,
            origin,
            stored: stored.as_deref(),
        };
        let cancel_asked = store
            .append_write(id, token, append, &snapshot.events)
            .await?;
        if let (Some((whole, text)), Some(now)) = (checkpoint, snapshot.checkpoint) {
            if whole {
                (sent.whole_bytes, sent.patch_bytes, sent.patches) = (text.len(), 0, 0);
            } else {
                sent.patch_bytes += text.len();
                sent.patches += 1;
            }
            sent.checkpoint = Some(now);
        }
        if response_changed {
            sent.response = Some(snapshot.response);
        }
        let last = snapshot.events.last().and_then(ClientEvent::sequence);
        sent.written = Written {
            last: last.or(written),
            through: snapshot.through,
            done,
            cancel_asked,
        };
        Ok(())
    }

    /// This replica stops (the generation was fenced as it stopped): writes the
    /// last events (not as done) and lets the lease go, so that another replica
    /// takes the generation over at its next look instead of after the lease.
    async fn hand_over(&self, sent: &mut Sent) {
        let Writer {
            store, id, token, ..
        } = *self;
        match self.write(sent, None).await {
            Ok(_) => {}
            Err(AppendError::Fenced) => return,
            Err(err) => {
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
    mut sent: Sent,
    stop: CancellationToken,
) {
    let mut changes = live.follow();
    let mut backoff = RETRY_MIN;
    let mut polled = tokio::time::Instant::now();
    let lease = store.lease();
    let renew_every = lease / 3;
    let retry_max = RETRY_MAX.min(lease / 4).max(RETRY_MIN);
    // When the last write that renewed the lease was sent.
    let mut renewed = tokio::time::Instant::now();
    // A first write, unless `publish` wrote (its checkpoint is the store's).
    let mut first = sent.checkpoint.is_none();
    // This replica's takeover leaves the response alone until the writer ends.
    struct Writing<'a>(&'a Live);
    impl Drop for Writing<'_> {
        fn drop(&mut self) {
            self.0.set_mirrored(false);
        }
    }
    let _writing = Writing(&live);
    let writer = Writer {
        store: &store,
        id: &id,
        token: &token,
        live: &live,
    };
    loop {
        if stop.is_cancelled() && !live.done() {
            // The router stops: the generation goes on elsewhere.
            live.fence();
        }
        if live.fenced() {
            return writer.hand_over(&mut sent).await;
        }
        changes.borrow_and_update();
        // Nothing new since the last checkpoint written: no write, unless
        // the lease wants renewing.
        let due = first
            || live.checkpoint_mark() != (sent.written.through, sent.written.done)
            || renewed.elapsed() >= renew_every;
        let at = tokio::time::Instant::now();
        let outcome = if due {
            writer.write(&mut sent, origin.as_ref()).await
        } else {
            Ok(())
        };
        match outcome {
            Ok(()) => {
                backoff = RETRY_MIN;
                if due {
                    origin = None;
                    // Every write renews the lease: the generation may go
                    // on (or on again, paused) for a while.
                    renewed = at;
                    live.hold_until(at + hold_for(lease));
                }
                first = false;
                live.mark_durable(sent.written.through);
                if sent.written.done {
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
            Err(err) => {
                tracing::debug!(id, %err, "background response not mirrored yet; retrying");
                // Readers get nothing new meanwhile, and the generation
                // pauses at its hold (`Live::until`).
                if renewed.elapsed() >= lease * GIVE_UP_LEASES {
                    tracing::warn!(
                        id,
                        %err,
                        "the response store was not written for {GIVE_UP_LEASES} leases; this \
                         replica gives the background response up (another takes it over \
                         from its last checkpoint once the store is back)"
                    );
                    live.fence();
                    return;
                }
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
                backoff = (backoff * 2).min(retry_max);
                continue;
            }
        }
        // A cancel asked on any replica: every write says so; without
        // writes, a look once per CANCEL_POLL.
        let asked = if due {
            polled = tokio::time::Instant::now();
            sent.written.cancel_asked
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
