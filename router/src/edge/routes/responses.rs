//! `/v1/responses`: create (streamed or not), retrieve and delete. A
//! response is a chat run through prefill/decode (`translated.rs`;
//! `crate::protocols::responses` translates both ways); stored ones live in
//! the router's store, each its tenant's alone.

use super::translated::{follow, follow_shared, serve, Prepared};
use crate::background::mirror::CANCEL_POLL;
use crate::background::response_translation::ResponseTranslation;
use crate::error::ApiError;

use crate::protocols::responses::new_id;

use crate::edge::app::AppState;
use crate::protocols::responses::request::{chat_body, check, Checked};
use crate::protocols::responses::stream::ResponseEvents;
use crate::store::live::{Live, LiveQuota, LiveRefusal};
use crate::store::redis::{LogState, RedisStore};
use crate::store::stored::{StoreError, Stored, TenantQuota};
use crate::store::ResponseStores;
use crate::tenants::Caller;
use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use std::time::{SystemTime, UNIX_EPOCH};

pub async fn create(
    State(state): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    request: Request,
) -> Result<Response, ApiError> {
    let kept = caller.map(|c| c.0.kept).unwrap_or_default();
    serve(
        state,
        "/v1/responses",
        request,
        async |state, request, tenant| {
            let Checked {
                echo,
                input,
                engine,
            } = check(&request)?;
            let mut items = match &echo.previous_response_id {
                None => Vec::new(),
                Some(id) => stored(&state.responses, id, tenant)
                    .await?
                    .conversation()
                    .map_err(store_unavailable)?,
            };
            items.extend(input);
            let chat = chat_body(&echo, &items, &engine)?;
            let created_at = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let (stream, store, background) = (echo.stream, echo.store, echo.background);
            let id = new_id("resp");
            let events = ResponseEvents::new(id.clone(), created_at, echo);
            let background = if background {
                let first = events.response("queued", Value::Null);
                let quota = LiveQuota {
                    max: kept.background_responses,
                    max_bytes: kept.background_bytes,
                };
                let live = state
                    .responses
                    .live
                    .open(&id, tenant, quota, first)
                    .map_err(refused_background)?;
                Some(live)
            } else {
                None
            };
            Ok(Prepared {
                chat,
                translation: ResponseTranslation::new(
                    state.responses.clone(),
                    events,
                    store,
                    items,
                    tenant,
                    TenantQuota {
                        max_count: kept.stored_responses,
                        max_bytes: kept.stored_bytes,
                    },
                ),
                stream,
                background,
            })
        },
    )
    .await
}

/// No response has an id that cannot be one (`valid_response_id`): not
/// found, before it names a key in any store.
fn known_id(id: &str) -> Result<(), ApiError> {
    if crate::protocols::responses::valid_response_id(id) {
        Ok(())
    } else {
        Err(ApiError::NotFound("response".into()))
    }
}

/// The stored response `id` of `tenant`; another tenant's is not found.
async fn stored(stores: &ResponseStores, id: &str, tenant: &str) -> Result<Stored, ApiError> {
    stores
        .stored
        .get(id)
        .await
        .map_err(store_unavailable)?
        .filter(|stored| stored.tenant == tenant)
        .ok_or_else(|| ApiError::NotFound(format!("response `{id}`")))
}

/// A background response refused: 429, its tenant's limit or the router's.
fn refused_background(refusal: LiveRefusal) -> ApiError {
    match refusal {
        LiveRefusal::Tenant { ref tenant, .. } => {
            crate::observe::metrics::tenant_rejected(tenant, "max_background_responses");
            ApiError::RateLimited {
                message: refusal.to_string(),
                retry_after_s: 1,
            }
        }
        LiveRefusal::Full { max } => ApiError::Overloaded {
            limit: max,
            retry_after_s: 1,
        },
    }
}

fn store_unavailable(err: StoreError) -> ApiError {
    ApiError::Unavailable(err.to_string())
}

/// Background response `id` of `tenant` as the shared store has it, when it
/// is another replica's (this one's are in `stores.live`).
async fn shared_log(
    stores: &ResponseStores,
    id: &str,
    tenant: &str,
) -> Option<(Arc<RedisStore>, LogState)> {
    let shared = stores.shared.as_ref()?;
    // The store down: no other replica's log can be read; what this replica
    // stored meanwhile is still found (`stored`), or the caller is told the
    // store is unavailable.
    let log = shared.log_state(id).await.unwrap_or_default();
    log.filter(|log| log.tenant == tenant)
        .map(|log| (shared.clone(), log))
}

/// Background response `id` of `tenant` in this replica's memory, unless it
/// goes on elsewhere (taken over, or handed over: the shared store has it).
/// With a shared store, a finished one whose keys are gone from it was
/// deleted (through another replica) or expired: forgotten here too, so that
/// no replica replays it.
async fn live_log(stores: &ResponseStores, id: &str, tenant: &str) -> Option<Arc<Live>> {
    let live = stores.live.get(id, tenant).filter(|live| !live.fenced())?;
    if let (true, Some(shared)) = (live.done(), &stores.shared) {
        // The store unreachable: this replica's word stands meanwhile.
        if let Ok(None) = shared.log_done(id).await {
            stores.live.forget(id);
            return None;
        }
    }
    Some(live)
}

/// The response a route names (`{id}`) and the tenant asking for it ("" without
/// the gate's caller). An id that cannot be a response's is not found
/// before any store is read.
pub struct NamedResponse {
    id: String,
    tenant: String,
}

impl<S: Send + Sync> FromRequestParts<S> for NamedResponse {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        known_id(&id).map_err(IntoResponse::into_response)?;
        let tenant = parts
            .extensions
            .get::<Caller>()
            .map(|caller| caller.tenant.to_string())
            .unwrap_or_default();
        Ok(Self { id, tenant })
    }
}

/// `GET /v1/responses/{id}`: `stream=true` reads a background response's
/// events again after `starting_after` and follows the rest.
#[derive(Debug, serde::Deserialize)]
pub struct Retrieve {
    #[serde(default)]
    stream: bool,
    starting_after: Option<u64>,
}

pub async fn retrieve(
    State(stores): State<Arc<ResponseStores>>,
    NamedResponse { id, tenant }: NamedResponse,
    query: Result<Query<Retrieve>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|err| ApiError::bad_request(err.body_text(), None))?;
    let live = live_log(&stores, &id, &tenant).await;
    let shared = match live {
        Some(_) => None,
        None => shared_log(&stores, &id, &tenant).await,
    };
    if query.stream {
        if let Some(live) = live {
            return Ok(follow(live, query.starting_after));
        }
        if let Some((store, _)) = shared {
            return Ok(follow_shared(store, id, query.starting_after));
        }
        // A stored (not background) response, or none: nothing to stream.
        stored(&stores, &id, &tenant).await?;
        return Err(ApiError::bad_request(
            "only a background response can be streamed again",
            Some("stream"),
        ));
    }
    // A background response as it stands; once done, as stored, or (not
    // stored: failed, or too large for the store) as its log ended it.
    let ended = match (live, shared) {
        (Some(live), _) if !live.done() => return Ok(Json(live.response()).into_response()),
        (None, Some((_, log))) if !log.done => return Ok(Json(log.response).into_response()),
        (Some(live), _) => Some(live.response()),
        (None, Some((_, log))) => Some(log.response),
        (None, None) => None,
    };
    match (stored(&stores, &id, &tenant).await, ended) {
        (Ok(stored), _) => Ok(json_bytes(stored.response_bytes())),
        (Err(ApiError::NotFound(_)), Some(ended)) => Ok(Json(ended).into_response()),
        (Err(err), _) => Err(err),
    }
}

/// A JSON answer of bytes as they are (shared with the store).
fn json_bytes(bytes: bytes::Bytes) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )],
        bytes,
    )
        .into_response()
}

/// `POST /v1/responses/{id}/cancel`: stops a background response's generation.
pub async fn cancel(
    State(stores): State<Arc<ResponseStores>>,
    NamedResponse { id, tenant }: NamedResponse,
) -> Result<Json<Value>, ApiError> {
    let Some(live) = live_log(&stores, &id, &tenant).await else {
        if let Some((store, log)) = shared_log(&stores, &id, &tenant).await {
            return cancel_elsewhere(&store, &id, log)
                .await
                .map(|(response, _)| Json(response));
        }
        stored(&stores, &id, &tenant).await?;
        return Err(ApiError::bad_request(
            "only a background response can be cancelled",
            None,
        ));
    };
    stop_here(&live, &id).await;
    Ok(Json(live.response()))
}

/// Cancels background response `live` (this replica's) and waits (bounded)
/// for its generation to stop; whether it stopped.
async fn stop_here(live: &Live, id: &str) -> bool {
    if live.done() {
        return true;
    }
    live.cancel.cancel();
    let mut changes = live.follow();
    let waited = tokio::time::timeout(CANCEL_WAIT, async {
        while !live.done() {
            if changes.changed().await.is_err() {
                break;
            }
        }
    })
    .await;
    if waited.is_err() {
        tracing::warn!(
            id,
            "a cancelled background response did not stop within 5 s"
        );
    }
    live.done()
}

/// How long a cancel waits for the generation to stop.
const CANCEL_WAIT: Duration = Duration::from_secs(5);

/// Whether the shared store has the end of `live` (this replica's, done),
/// waiting for it (bounded): its mirror writes the end after the generation
/// stops, and a delete before that write would be undone by it. Without a
/// shared store there is nothing to wait for; with it unreachable, the
/// delete cannot be done (503) and nothing is forgotten here: its writer
/// still writes it once the store is back.
async fn mirrored_to_end(stores: &ResponseStores, id: &str, live: &Live) -> Result<bool, ApiError> {
    let Some(shared) = &stores.shared else {
        return Ok(true);
    };
    if live.fenced() {
        // Another replica generates it: its end is that one's.
        return Ok(true);
    }
    let deadline = tokio::time::Instant::now() + CANCEL_WAIT;
    loop {
        match shared.log_done(id).await.map_err(store_unavailable)? {
            Some(true) => return Ok(true),
            _ if tokio::time::Instant::now() >= deadline => return Ok(false),
            _ => tokio::time::sleep(CANCEL_POLL / 2).await,
        }
    }
}

/// Cancels a background response that another replica generates: asks it
/// through the store, and waits (bounded) for the store to say it is done;
/// the response as it stands, and whether it is done.
async fn cancel_elsewhere(
    store: &RedisStore,
    id: &str,
    log: LogState,
) -> Result<(Value, bool), ApiError> {
    if log.done {
        return Ok((log.response, true));
    }
    store.request_cancel(id).await.map_err(store_unavailable)?;
    let deadline = tokio::time::Instant::now() + CANCEL_WAIT + 2 * CANCEL_POLL;
    let mut last = log.response;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(CANCEL_POLL / 2).await;
        match store.log_state(id).await.map_err(store_unavailable)? {
            Some(log) if log.done => return Ok((log.response, true)),
            Some(log) => last = log.response,
            None => break,
        }
    }
    tracing::warn!(
        id,
        "a background response cancelled through the store did not stop in time"
    );
    Ok((last, false))
}

/// `DELETE /v1/responses/{id}`: the response and everything kept of it go
/// (its stored object and conversation; a background one's event log, here
/// and in the shared store, with its state, checkpoint and origin), so that
/// no replica reads or replays it again. A background response still
/// generating is cancelled first (its readers get its end); one that does
/// not stop in time is left whole (409: delete it again).
pub async fn delete(
    State(stores): State<Arc<ResponseStores>>,
    NamedResponse { id, tenant }: NamedResponse,
) -> Result<Json<Value>, ApiError> {
    // One taken over by another replica is stopped through the store.
    let live = live_log(&stores, &id, &tenant).await;
    let shared = match &live {
        Some(_) => None,
        None => shared_log(&stores, &id, &tenant).await,
    };
    let stopped = match (&live, shared) {
        (Some(live), _) => {
            stop_here(live, &id).await && mirrored_to_end(&stores, &id, live).await?
        }
        (None, Some((store, log))) => cancel_elsewhere(&store, &id, log).await?.1,
        (None, None) => {
            stored(&stores, &id, &tenant).await?;
            true
        }
    };
    if !stopped {
        return Err(ApiError::Conflict(format!(
            "response `{id}` is still stopping; delete it again"
        )));
    }
    stores.live.forget(&id);
    stores.stored.delete(&id).await.map_err(store_unavailable)?;
    Ok(Json(
        json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}
