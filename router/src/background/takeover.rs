//! Background responses whose router replica died, taken over by another
//! replica sharing the response store.
//!
//! The generating replica renews a lease on each of its background responses
//! as it writes their events and checkpoints (`mirror.rs`). Every replica
//! looks for responses whose lease expired eight times per lease, claims
//! them (one replica wins each, `RedisStore::claim_expired`) and goes on from
//! the last checkpoint exactly as a decoder-failure resume does: the next
//! decoder pulls the prompt's KV from the prefill's hold and generates after
//! the tokens the checkpoint has; the events go on from the next sequence
//! number. Events the dead replica made after its last write are made again
//! (they were never in the store, so no reader has them twice).
//!
//! What is read back is held to what this replica knows: the tenant as its
//! tenants file says now (engine fields, quotas), the checkpoint checked as
//! a prefill's answer. A response that cannot go on ends as failed, with a
//! `response.failed` event after its last, so that every reader's stream
//! ends; only one this replica has no room for is let go for another look.

use super::response_translation::ResponseTranslation;
use super::run::{run_apart, Apart, BackgroundState, ResponseLease};
use super::translation::TranslationDriver;
use crate::error::ApiError;
use crate::pd::checkpoint::DecodeCheckpoint;
use crate::pd::record::RequestRecord;
use crate::pd::record::{engine_request_id, valid_request_id};
use crate::protocols::client_event::ClientEvent;
use crate::protocols::client_event::Destination;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::{validate, Route};
use crate::store::live::LiveQuota;
use crate::store::redis::{CheckpointWrite, LogState, RedisStore, Taken};
use crate::store::stored::{StoreError, TenantQuota};
use crate::tenants::engine_fields::set_engine_fields;
use crate::tenants::Tenants;
use serde_json::{json, Value};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Looks for expired leases per lease.
const LOOKS_PER_LEASE: u32 = 8;

/// Most responses one look claims (the rest wait for the next look).
const CLAIM_BATCH: usize = 16;

/// Looks for expired leases until `stop`, with a shared store; each taken
/// over is held to its tenant as `tenants` configure it now.
pub fn spawn(
    state: &BackgroundState,
    tenants: &Arc<Tenants>,
    tasks: &mut tokio::task::JoinSet<()>,
    stop: CancellationToken,
) {
    let Some(store) = state.responses.shared.clone() else {
        return;
    };
    let (state, tenants) = (state.clone(), tenants.clone());
    tasks.spawn(async move {
        // Often, so that the takeover follows the lease's expiry closely: a
        // look is one small script on a set of the running responses.
        let every = store.lease() / LOOKS_PER_LEASE;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.cancelled() => return,
            }
            // This replica stops: it takes nothing more over.
            if state.responses.live.stop.is_cancelled() {
                return;
            }
            let token = crate::store::redis::lease_token();
            // Never its own generations: their writer goes on (or finds
            // itself fenced) once the store answers again.
            let own = state.responses.live.mirrored();
            // The lease runs out in the store a lease after the claim was
            // sent at the soonest: what the generation's hold counts from.
            let sent = tokio::time::Instant::now();
            match store.claim_expired(&token, CLAIM_BATCH, &own).await {
                Ok(ids) => {
                    for id in ids {
                        tracing::warn!(
                            id,
                            "taking over a background response whose replica stopped renewing it"
                        );
                        let lease = ResponseLease {
                            token: token.clone(),
                            since: sent,
                        };
                        let claim = ClaimedResponse {
                            state: state.clone(),
                            tenants: tenants.clone(),
                            store: store.clone(),
                            id: id.clone(),
                        };
                        state.responses.live.taking(&id, true);
                        state.deps.drains.clone().spawn(take_over(claim, lease));
                    }
                }
                Err(err) => tracing::debug!(%err, "no look for expired background responses"),
            }
        }
    });
}

/// One response this replica claimed.
struct ClaimedResponse {
    state: BackgroundState,
    tenants: Arc<Tenants>,
    store: Arc<RedisStore>,
    id: String,
}

/// Why a claimed response could not be continued.
#[derive(Debug, thiserror::Error)]
enum TakeoverError {
    #[error("its state is gone from the store")]
    Gone,
    #[error("its checkpoint cannot be read: {0}")]
    Checkpoint(String),
    #[error("this replica has no room for another background response")]
    Full,
    #[error("its tenant `{0}` is not configured here")]
    Tenant(String),
    /// Another replica claimed it meanwhile (or the store was unreachable to
    /// renew the claim): left to that one, or to the next look.
    #[error("its lease could not be renewed before the generation started")]
    Lost,
    #[error(transparent)]
    Api(#[from] ApiError),
}

async fn take_over(claim: ClaimedResponse, lease: ResponseLease) {
    let ClaimedResponse {
        state,
        tenants,
        store,
        id,
    } = claim;
    // Its own from the claim until its writer starts (or it cannot go on).
    struct Taking<'a>(&'a BackgroundState, &'a str);
    impl Drop for Taking<'_> {
        fn drop(&mut self) {
            self.0.responses.live.taking(self.1, false);
        }
    }
    let _taking = Taking(&state, &id);
    let token = lease.token.clone();
    let taken = match store.taken(&id).await {
        Ok(Some(taken)) if !taken.state.done => taken,
        // Its replica ended it after all: nothing to take over.
        Ok(Some(_)) => return forget(&store, &id).await,
        Ok(None) => {
            fail(&store, &id, &token, None, &TakeoverError::Gone).await;
            return;
        }
        // What the store holds of it cannot be read (tampered, or past its
        // bound): no replica could ever go on with it, so it ends as failed
        // rather than being claimed, read and released again forever.
        Err(StoreError::Malformed(why)) => {
            tracing::warn!(
                id,
                why,
                "a claimed background response cannot be read back; ended as failed"
            );
            let then = store.log_state(&id).await.ok().flatten();
            let error = TakeoverError::Checkpoint(why);
            fail(&store, &id, &token, then, &error).await;
            return;
        }
        Err(err) => {
            tracing::warn!(id, %err, "a claimed background response could not be read; left for another look");
            return release(&store, &id, &token).await;
        }
    };
    let state_then = taken.state.clone();
    let tenant = state_then.tenant.clone();
    match continue_taken(&state, &tenants, &store, &id, lease, taken).await {
        Ok(()) => {}
        // Another replica may have room: left for its next look.
        Err(TakeoverError::Full) => release(&store, &id, &token).await,
        Err(TakeoverError::Lost) => {
            tracing::info!(
                id,
                "a claimed background response was lost before it started"
            );
        }
        Err(error) => {
            tracing::warn!(id, %error, "a claimed background response cannot go on");
            let ended = fail(&store, &id, &token, Some(state_then), &error).await;
            // Readers of this replica's copy of its log (its generation could
            // not start): the same end, once the store has it; else they are
            // let go, to read the store.
            if let Some(live) = state.responses.live.get(&id, &tenant) {
                match ended {
                    Some((events, response)) => live.push(events, Some(response)),
                    None => live.fence(),
                }
            }
        }
    }
}

/// Continues `taken` here: its events so far in a local log (for this
/// replica's readers), its translation and its chat from the checkpoint,
/// held to its tenant as configured here (what the store says of its
/// priority or KV salt is not trusted).
async fn continue_taken(
    state: &BackgroundState,
    tenants: &Tenants,
    store: &RedisStore,
    id: &str,
    lease: ResponseLease,
    taken: Taken,
) -> Result<(), TakeoverError> {
    let Taken {
        state: log,
        origin,
        checkpoint,
        events,
    } = taken;
    let caller = tenants
        .caller_of(&log.tenant)
        .ok_or_else(|| TakeoverError::Tenant(log.tenant.clone()))?;
    let checkpoint = checkpoint.ok_or(TakeoverError::Gone)?;
    let decode: Option<DecodeCheckpoint> = serde_json::from_value(checkpoint["decode"].clone())
        .map_err(|err| TakeoverError::Checkpoint(err.to_string()))?;
    let translation = ResponseTranslation::resumed(
        state.responses.clone(),
        &origin["translation"],
        checkpoint["translation"].clone(),
        &log.tenant,
        TenantQuota {
            max_count: caller.kept.stored_responses,
            max_bytes: caller.kept.stored_bytes,
        },
    )
    .map_err(|err| TakeoverError::Checkpoint(err.to_string()))?;
    // The engine fields are the tenant's, as for its client's request (the
    // Responses API has no field of its own for either).
    let mut chat = origin["chat"].clone();
    if let Some(fields) = chat.as_object_mut() {
        fields.remove("priority");
        fields.remove("cache_salt");
    }
    let mut chat = ClientBody::of(chat);
    set_engine_fields(&caller, &mut chat)?;
    // Read back from the store: held to what a client's id is held to.
    let request_id = origin["request_id"]
        .as_str()
        .filter(|r| valid_request_id(r))
        .unwrap_or(id)
        .to_string();
    let info = validate(
        Route::Chat,
        &chat,
        engine_request_id(&request_id),
        state.deps.requests.max_tokens_limit,
    )?;
    let quota = LiveQuota {
        max: caller.kept.background_responses,
        max_bytes: caller.kept.background_bytes,
    };
    // Reading it back took a while: the lease, renewed now, must be this
    // replica's still before its decoder starts (else another replica may
    // have claimed it and started one); the hold counts from this renewal.
    let renewing = tokio::time::Instant::now();
    match store.renew_lease(id, &lease.token).await {
        Ok(true) => {}
        Ok(false) | Err(_) => return Err(TakeoverError::Lost),
    }
    let lease = ResponseLease {
        since: renewing,
        ..lease
    };
    let live = state
        .responses
        .live
        .adopt(id, &log.tenant, quota, log.response, events)
        .ok_or(TakeoverError::Full)?;
    let record = RequestRecord::new("/v1/responses", request_id);
    // Its first events are in the log already.
    let driver = TranslationDriver::new(translation, Destination::Log(live.clone()), true);
    let translated = Some(driver.as_output());
    let deps = state.deps.clone();
    let started = match decode {
        // Past its prefill: on from the hold, after the tokens it has.
        Some(decode) => {
            crate::pd::continue_from(deps, info, chat, decode, record, translated).await
        }
        // Its replica died before the prefill answered: from the start.
        None => crate::pd::run_observed(deps, info, chat, record, translated).await,
    };
    // Could not start: its end is written by the caller (`fail`), and this
    // replica's readers of the log get it then.
    let (chat_response, entry) = started?;
    let run = Apart {
        driver,
        live,
        chat_response,
        entry,
        admission: None,
        lease: Some(lease),
    };
    run_apart(state, run, None).await;
    Ok(())
}

/// Ends a claimed response as failed, in the store (no replica generates
/// it): a `response.failed` event numbered after the last one stored, so
/// that every reader's stream ends with it. Returns what was written (for
/// this replica's readers), None when nothing could be.
async fn fail(
    store: &RedisStore,
    id: &str,
    token: &str,
    then: Option<LogState>,
    error: &TakeoverError,
) -> Option<(Vec<ClientEvent>, Value)> {
    let Some(mut log) = then else {
        // Nothing left of it (its keys expired, or its state unreadable): no
        // more looks at it (its keys expire with their TTL).
        forget(store, id).await;
        return None;
    };
    let message = format!(
        "the router replica generating this response stopped, and it could not be taken over: {error}"
    );
    crate::protocols::responses::output::fail(&mut log.response, &message);
    log.done = true;
    let next = match store.last_sequence(id).await {
        Ok(last) => last.map_or(Some(0), |last| last.checked_add(1)),
        Err(err) => {
            tracing::warn!(id, %err, "a background response that cannot go on could not be ended as failed");
            return None;
        }
    };
    let events: Vec<ClientEvent> = next
        .map(|n| {
            ClientEvent::from_value(&json!({"type": "response.failed", "sequence_number": n,
                                      "response": log.response}))
        })
        .into_iter()
        .collect();
    let written = store
        .append(
            id,
            token,
            &log,
            &events,
            Some(CheckpointWrite::Whole("null")),
            None,
        )
        .await;
    match written {
        Ok(_) => Some((events, log.response)),
        // Fenced: another replica claimed it meanwhile, and ends it. The
        // store down: the claim runs out, and a later look tries again.
        Err(err) => {
            tracing::warn!(id, %err, "a background response that cannot go on could not be ended as failed");
            None
        }
    }
}

/// No more looks at `id` (ended, or gone from the store).
async fn forget(store: &RedisStore, id: &str) {
    if let Err(err) = store.forget_running(id).await {
        tracing::debug!(id, %err, "a background response left among the running");
    }
}

async fn release(store: &RedisStore, id: &str, token: &str) {
    if let Err(err) = store.release_lease(id, token).await {
        tracing::debug!(id, %err, "a claimed lease left to expire");
    }
}
