//! A background generation (`background: true`), driven to its end apart
//! from the request that started it: its events into its log, and with a
//! shared store its checkpoints and a mirror of its log there.

use super::mirror;
use super::translation::{no_ending, Translation, TranslationDriver};
use crate::journal::EntryReader;
use crate::pd::deps::FlowDeps;
use crate::store::live::Live;
use crate::store::ResponseStores;
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::sync::Arc;

/// A whole answer as a value (a background response's state).
fn value_of(whole: &RawValue) -> Value {
    serde_json::from_str(whole.get()).unwrap_or_default()
}

/// Most time between two checkpoints of a background generation (with a
/// shared store).
pub const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// What background generations use of the router: the request flow's
/// dependencies (their chats run through it) and the response stores their events and answers go to
/// (the rest of the app's state is the edge's).
#[derive(Clone)]
pub struct BackgroundState {
    pub deps: Arc<FlowDeps>,
    pub responses: Arc<ResponseStores>,
}

/// A background generation to run apart from its request.
pub struct Apart<T> {
    /// Its translation, fed by the chat's relay (its sink the `live` log).
    pub driver: TranslationDriver<T>,
    pub live: Arc<Live>,
    pub chat_response: Response,
    /// The chat's journal entry (its checkpoints, with a shared store).
    pub entry: EntryReader,
    pub admission: Option<crate::tenants::Admission>,
    /// The lease this replica holds on it in the shared store (a
    /// generation taken over; a new one gets its own).
    pub lease: Option<ResponseLease>,
}

/// A lease a replica holds on a background response it took over, in the
/// shared store (`store/redis/lease.rs`; not a hold's `HoldLease`).
pub struct ResponseLease {
    pub token: String,
    /// When the call that last set it was sent: it runs out in the store a
    /// lease after that at the soonest, so the generation's hold counts from
    /// here (not from when the generation starts, which may be much later).
    pub since: tokio::time::Instant,
}

/// Drives a background generation to its end (or its cancel) in a task of
/// the router's, its events into `live` (the relay writes them as it
/// journals the chat, so the two agree whenever this task looks); the
/// admission is held as long. With a shared store, its events and
/// checkpoints are copied there as they come (`mirror.rs`), under a lease of
/// this replica's; `origin` is written with the first events (a generation
/// taken over has it there already).
pub async fn run_apart<T: Translation>(
    state: &BackgroundState,
    run: Apart<T>,
    origin: Option<Value>,
) {
    let Apart {
        driver,
        live,
        chat_response,
        entry,
        admission,
        lease,
    } = run;
    let mut chat = chat_response.into_body().into_data_stream();
    let shared = state.responses.shared.clone();
    let keeps_checkpoints = shared.is_some();
    // What it may hold in the shared store: its events, its request (when
    // it starts here) and its checkpoint, counted at each checkpoint; a
    // request past it alone is not written (the first count fails it).
    let max_bytes = shared
        .as_ref()
        .map_or(usize::MAX, |store| store.max_response_bytes());
    let json_len = crate::store::live::json_len;
    let origin_bytes = origin.as_ref().map_or(0, json_len);
    let origin = origin.filter(|_| origin_bytes <= max_bytes);
    let checkpoint = {
        let driver = driver.clone();
        move || {
            keeps_checkpoints.then(|| {
                let decode = entry.read(crate::pd::checkpoint::DecodeCheckpoint::of);
                json!({"decode": decode, "translation": driver.lock().translation.checkpoint()})
            })
        }
    };
    if let Some(shared) = &shared {
        let id = live.response()["id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let (token, since) = match lease {
            Some(lease) => (lease.token, lease.since),
            None => (
                crate::store::redis::lease_token(),
                tokio::time::Instant::now(),
            ),
        };
        // Until its first write, as long as its lease would allow.
        let hold = mirror::hold_for(shared.lease());
        live.gate(since + hold);
        live.push_checkpointed(Vec::new(), None, checkpoint());
        // In the store before the client has the id, which it may take to
        // any replica at once (a generation taken over has its origin there).
        let mut origin = origin;
        let mut sent = mirror::Sent::default();
        if let Some(first) = &origin {
            if mirror::publish(shared, &id, &token, &live, first, &mut sent).await {
                origin = None;
            }
        }
        state.deps.drains.spawn(mirror::mirror(
            shared.clone(),
            id,
            token,
            live.clone(),
            origin,
            sent,
            state.responses.live.stop.clone(),
        ));
    }
    state.deps.drains.spawn(async move {
        let _admission = admission;
        let mut every = tokio::time::interval(CHECKPOINT_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut changes = live.follow();
        loop {
            // Past its hold (its writer could not renew the lease lately),
            // the generation pauses: its decoder stream is not read until a
            // write renews the lease (`mirror.rs`), so that it never goes on
            // here once another replica may have taken it over.
            changes.borrow_and_update();
            let until = live.until();
            let paused = until.is_some_and(|until| tokio::time::Instant::now() >= until);
            let hold = until.unwrap_or_else(tokio::time::Instant::now);
            tokio::select! {
                _ = changes.changed(), if paused => {}
                _ = tokio::time::sleep_until(hold), if !paused && until.is_some() => {}
                // What came since the last checkpoint is checkpointed at most
                // every CHECKPOINT_EVERY: the store gets events up to the last
                // checkpoint and readers only what the store has, so this
                // bounds the writes and what a reader waits for an event.
                _ = every.tick(), if keeps_checkpoints => {
                    if !live.unchecked() {
                        continue;
                    }
                    let checkpointed = checkpoint();
                    let bytes = live.event_bytes()
                        + origin_bytes
                        + checkpointed.as_ref().map_or(0, json_len);
                    if bytes <= max_bytes {
                        live.push_checkpointed(Vec::new(), None, checkpointed);
                        continue;
                    }
                    // Past the store's bound: the response fails, as any
                    // reader sees, and its generation stops.
                    drop(chat);
                    let id = live.response()["id"].as_str().unwrap_or_default().to_string();
                    tracing::warn!(id, bytes, limit = max_bytes, "a background response passed --response-store-max-response-bytes; failed");
                    metrics::counter!(crate::observe::metrics::RESPONSE_STORE_TOO_LARGE, "kind" => "background")
                        .increment(1);
                    let error = json!({"code": "response_too_large", "message": format!(
                        "the response passed the response store's limit of {max_bytes} bytes per response"
                    )});
                    let (out, whole) = {
                        let mut driver = driver.lock();
                        let mut out = driver.out();
                        let whole = driver.translation.fail(&error, &mut out);
                        (out, whole)
                    };
                    live.push_checkpointed(out.into_events(), Some(value_of(&whole)), checkpoint());
                    return;
                }
                _ = live.cancel.cancelled() => {
                    // Dropping the chat stream ends the generation on its decoder.
                    drop(chat);
                    if live.fenced() {
                        // It goes on elsewhere: nothing more is said here.
                        return;
                    }
                    let (out, whole, keeping) = {
                        let mut driver = driver.lock();
                        let mut out = driver.out();
                        let whole = driver.translation.cancel(&mut out);
                        (out, whole, driver.keeping())
                    };
                    if let Some(keeping) = keeping {
                        keeping.await;
                    }
                    live.push_checkpointed(out.into_events(), Some(value_of(&whole)), checkpoint());
                    return;
                }
                next = chat.next(), if !paused => {
                    if next.is_some() {
                        continue;
                    }
                    // The chat ended (what the translation keeps was kept
                    // as its relay finished).
                    let (out, whole, _) = driver
                        .take_ending()
                        .unwrap_or_else(|| no_ending(&driver));
                    live.push_checkpointed(out.into_events(), Some(value_of(&whole)), checkpoint());
                    return;
                }
            }
        }
    });
}
