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

use super::openai::{engine_request_id, valid_request_id};
use super::responses::ResponseTranslation;
use super::translated::{run_apart, Apart, Shared, Sink};
use crate::error::ApiError;
use crate::pd::checkpoint::DecodeCheckpoint;
use crate::pd::record::RequestRecord;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::{validate, Route};
use crate::protocols::responses::redis_store::{CheckpointWrite, LogState, RedisStore, Taken};
use crate::state::AppState;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Looks for expired leases per lease.
const LOOKS_PER_LEASE: u32 = 8;

/// Most responses one look claims (the rest wait for the next look).
const CLAIM_BATCH: usize = 16;

/// Looks for expired leases until `stop`, with a shared store.
pub fn spawn(state: &Arc<AppState>, tasks: &mut tokio::task::JoinSet<()>, stop: CancellationToken) {
    let Some(store) = state.responses.shared.clone() else {
        return;
    };
    let state = state.clone();
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
            let token = crate::protocols::responses::redis_store::lease_token();
            // Never its own generations: their writer goes on (or finds
            // itself fenced) once the store answers again.
            let own = state.responses.live.mirrored();
            match store.claim_expired(&token, CLAIM_BATCH, &own).await {
                Ok(ids) => {
                    for id in ids {
                        tracing::warn!(
                            id,
                            "taking over a background response whose replica stopped renewing it"
                        );
                        let (state, store, token) = (state.clone(), store.clone(), token.clone());
                        state.responses.live.taking(&id, true);
                        state
                            .flow
                            .drains
                            .clone()
                            .spawn(take_over(state, store, id, token));
                    }
                }
                Err(err) => tracing::debug!(%err, "no look for expired background responses"),
            }
        }
    });
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
    #[error(transparent)]
    Api(#[from] ApiError),
}

async fn take_over(state: Arc<AppState>, store: Arc<RedisStore>, id: String, token: String) {
    // Its own from the claim until its writer starts (or it cannot go on).
    struct Taking<'a>(&'a AppState, &'a str);
    impl Drop for Taking<'_> {
        fn drop(&mut self) {
            self.0.responses.live.taking(self.1, false);
        }
    }
    let _taking = Taking(&state, &id);
    let taken = match store.taken(&id).await {
        Ok(Some(taken)) if !taken.state.done => taken,
        // Its replica ended it after all: nothing to take over.
        Ok(Some(_)) => return forget(&store, &id).await,
        Ok(None) => return fail(&store, &id, &token, None, &TakeoverError::Gone).await,
        Err(err) => {
            tracing::warn!(id, %err, "a claimed background response could not be read; left for another look");
            return release(&store, &id, &token).await;
        }
    };
    let state_then = taken.state.clone();
    match continue_taken(&state, &id, &token, taken).await {
        Ok(()) => {}
        // Another replica may have room: left for its next look.
        Err(TakeoverError::Full) => release(&store, &id, &token).await,
        Err(error) => {
            tracing::warn!(id, %error, "a claimed background response cannot go on");
            fail(&store, &id, &token, Some(state_then), &error).await;
        }
    }
}

/// Continues `taken` here: its events so far in a local log (for this
/// replica's readers), its translation and its chat from the checkpoint.
async fn continue_taken(
    state: &Arc<AppState>,
    id: &str,
    token: &str,
    taken: Taken,
) -> Result<(), TakeoverError> {
    let Taken {
        state: log,
        origin,
        checkpoint,
        events,
    } = taken;
    let checkpoint = checkpoint.ok_or(TakeoverError::Gone)?;
    let decode: Option<DecodeCheckpoint> = serde_json::from_value(checkpoint["decode"].clone())
        .map_err(|err| TakeoverError::Checkpoint(err.to_string()))?;
    let translation = ResponseTranslation::resumed(
        state.responses.clone(),
        &origin["translation"],
        checkpoint["translation"].clone(),
        &log.tenant,
    )
    .map_err(|err| TakeoverError::Checkpoint(err.to_string()))?;
    let chat = ClientBody::of(origin["chat"].clone());
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
        state.config.max_tokens_limit,
    )?;
    let live = state
        .responses
        .live
        .adopt(id, &log.tenant, log.response, events)
        .ok_or(TakeoverError::Full)?;
    let record = RequestRecord::new("/v1/responses", request_id);
    // Its first events are in the log already.
    let driver = Shared::new(translation, Sink::Live(live.clone()), true);
    let translator = Some(driver.translator());
    let flow = state.flow.clone();
    let started = match decode {
        // Past its prefill: on from the hold, after the tokens it has.
        Some(decode) => {
            crate::pd::continue_from(flow, info, chat, decode, record, translator).await
        }
        // Its replica died before the prefill answered: from the start.
        None => crate::pd::run_observed(flow, info, chat, record, translator).await,
    };
    let (chat_response, entry) = match started {
        Ok(started) => started,
        Err(error) => {
            state.responses.live.forget(id);
            return Err(error.into());
        }
    };
    let run = Apart {
        driver,
        live,
        chat_response,
        entry,
        admission: None,
        lease: Some(token.to_string()),
    };
    run_apart(state, run, None).await;
    Ok(())
}

/// Ends a claimed response as failed, in the store (no replica generates it).
async fn fail(
    store: &RedisStore,
    id: &str,
    token: &str,
    then: Option<LogState>,
    error: &TakeoverError,
) {
    let Some(mut log) = then else {
        // Nothing left of it (its keys expired): no more looks at it.
        return forget(store, id).await;
    };
    let message = format!(
        "the router replica generating this response stopped, and it could not be taken over: {error}"
    );
    crate::protocols::responses::output::fail(&mut log.response, &message);
    log.done = true;
    if let Err(err) = store
        .append(
            id,
            token,
            &log,
            &[],
            Some(CheckpointWrite::Whole("null")),
            None,
        )
        .await
    {
        tracing::warn!(id, %err, "a background response that cannot go on could not be ended as failed");
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
