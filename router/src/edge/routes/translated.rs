//! The routes whose protocol is translated to and from a chat completion
//! (Responses, Messages): after the prologue every generating route shares
//! (`prologue.rs`), the protocol's request is translated, the chat runs
//! through prefill/decode (`pd::run`, so it is resumed like any chat) with the
//! translation's driver as the relay's `TranslatedOutput`, fed each chat
//! chunk as it is journaled, and the answer is the protocol's events or its whole answer.

use super::prologue;
use crate::background::run::{run_apart, Apart, CHECKPOINT_EVERY};
use crate::background::translation::{no_ending, Translation, TranslationDriver};
use crate::edge::app::AppState;
use crate::edge::gate::AdmissionSlot;
use crate::error::ApiError;
use crate::protocols::client_event::{frames, ClientEvent, Destination};
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::Route;
use crate::store::live::Live;
use crate::store::redis::RedisStore;
use crate::store::stored::StoreError;
use crate::tenants::Caller;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// What a protocol's request became: the chat to run and the translation of
/// its answer.
pub struct Prepared<T> {
    pub chat: Value,
    pub translation: T,
    pub stream: bool,
    /// Run apart from the request, its events kept here (a background
    /// response); the request answers at once.
    pub background: Option<Arc<Live>>,
}

/// Reads the request, lets `prepare` check and translate it (with the
/// caller's tenant name), runs the chat and translates its answer. The
/// request is taken as the gate left it: its caller and admission slot are
/// its extensions.
pub async fn serve<T: Translation>(
    state: Arc<AppState>,
    path: &'static str,
    request: Request,
    prepare: impl AsyncFnOnce(&Arc<AppState>, Map<String, Value>, &str) -> Result<Prepared<T>, ApiError>,
) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let caller = parts.extensions.get::<Caller>().cloned();
    let admission = parts.extensions.get::<AdmissionSlot>().cloned();
    let headers = parts.headers;
    prologue::generate(
        &state,
        path,
        caller,
        &headers,
        body,
        async |mut prologue, bytes| {
            let tenant = prologue.tenant();
            let prepared = async {
                let request: Result<Map<String, Value>, _> = serde_json::from_slice(&bytes);
                // The request is kept as parsed: the bytes it was read from
                // go now, not when the generation ends.
                drop(bytes);
                let request = request
                    .map_err(|err| ApiError::bad_request(format!("request body: {err}"), None))?;
                prepare(&state, request, &tenant).await
            }
            .await;
            let prepared = prepared.map_err(|error| prologue.fail(error))?;
            let (translation, stream, background) =
                (prepared.translation, prepared.stream, prepared.background);
            // A background response that cannot start is done, as failed (its
            // entry must not wait for a generation that never comes).
            let failed = |error: ApiError| {
                if let Some(live) = &background {
                    let mut response = live.response();
                    crate::protocols::responses::output::fail(&mut response, &error.to_string());
                    live.push(Vec::new(), Some(response));
                }
                error
            };
            // The tenant's priority and KV salt go in with the checks (the
            // protocols have no field of their own for either).
            let mut chat = ClientBody::of(prepared.chat);
            let info = prologue.check(Route::Chat, &mut chat).map_err(failed)?;
            // What a replica taking the generation over needs of the request.
            let origin = (background.is_some() && state.responses.shared.is_some()).then(|| {
                json!({"chat": chat.fields(), "tenant": tenant,
                   "request_id": prologue.record.request_id(), "translation": translation.origin()})
            });
            let to = match (&background, stream) {
                (Some(live), _) => Destination::Log(live.clone()),
                (None, true) => Destination::Client,
                (None, false) => Destination::Nowhere,
            };
            let driver = TranslationDriver::new(translation, to, false);
            let (chat_response, entry) = crate::pd::run_observed(
                state.deps.clone(),
                info,
                chat,
                prologue.record,
                Some(driver.as_output()),
            )
            .await
            .map_err(failed)?;
            Ok(match background {
                // The session's stream is the translation's; cut by shutdown, it
                // ends as the translation fails.
                None if stream => {
                    let mut response = chat_response;
                    let ending = driver.clone();
                    response
                        .extensions_mut()
                        .insert(crate::edge::gate::StreamEnding::new(move || {
                            ending.cut(&crate::edge::gate::shutdown_error().body()["error"])
                        }));
                    response
                }
                None => whole_answer(driver, chat_response).await,
                Some(live) => {
                    // The slot goes with the generation, not with this answer.
                    let admission = admission.and_then(|slot| slot.take());
                    let run = Apart {
                        driver,
                        live: live.clone(),
                        chat_response,
                        entry,
                        admission,
                        lease: None,
                    };
                    run_apart(&state.background(), run, origin).await;
                    if stream {
                        follow(live, None)
                    } else {
                        axum::Json(live.response()).into_response()
                    }
                }
            })
        },
    )
    .await
}

/// The whole answer of a non-stream request, once its chat ran to the end
/// (the chat's own headers, instances and resumes, stay).
async fn whole_answer<T: Translation>(
    driver: TranslationDriver<T>,
    chat_response: Response,
) -> Response {
    let (parts, body) = chat_response.into_parts();
    let mut chat = body.into_data_stream();
    while chat.next().await.is_some() {}
    let (_, whole, failed) = driver.take_ending().unwrap_or_else(|| no_ending(&driver));
    let mut response = driver.lock().translation.answer(whole, failed);
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE
            && name != header::CONTENT_LENGTH
            && name != header::CACHE_CONTROL
        {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    response
}

/// The events of background response `live` after sequence number `after`,
/// then the rest as they come, until it is done.
pub fn follow(live: Arc<Live>, after: Option<u64>) -> Response {
    let changes = live.follow();
    let stream = futures_util::stream::unfold(
        (live, changes, after, false),
        |(live, mut changes, mut after, finished)| async move {
            if finished {
                return None;
            }
            loop {
                changes.borrow_and_update();
                let (events, done) = live.after(after);
                if let Some(last) = events.last().and_then(ClientEvent::sequence) {
                    after = Some(last);
                }
                if !events.is_empty() || done {
                    // Each event's own frame: shared with the log, not copied
                    // for each reader.
                    let frames = events
                        .iter()
                        .map(|e| Ok::<_, std::convert::Infallible>(e.frame()));
                    let frames: Vec<_> = frames.collect();
                    return Some((
                        futures_util::stream::iter(frames),
                        (live, changes, after, done),
                    ));
                }
                if changes.changed().await.is_err() {
                    return None;
                }
            }
        },
    );
    event_stream_response(stream.flatten())
}

fn event_stream_response(
    stream: impl Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static,
) -> Response {
    let mut response = Body::from_stream(stream).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
}

/// How often a reader of another replica's background response looks for
/// new events: as often as the generating replica writes them
/// (`CHECKPOINT_EVERY`), so that a reader here is no later than one there.
const SHARED_POLL: std::time::Duration = CHECKPOINT_EVERY;

/// Empty looks after which a reader asks whether the response is done.
const POLLS_PER_STATE: u32 = 10;

/// The events of background response `id`, generated by another replica,
/// after sequence number `after`, then the rest as the shared store gets
/// them, until it is done. Every such reader of this replica polls on the
/// store's one bulk connection (none holds a connection, or a blocked read,
/// of its own). The store failing ends the stream with an `error` event
/// (the client reads again from its last sequence number); the response
/// deleted (or expired) ends it with one too.
pub fn follow_shared(store: Arc<RedisStore>, id: String, after: Option<u64>) -> Response {
    struct Reader {
        store: Arc<RedisStore>,
        id: String,
        after: Option<u64>,
        finished: bool,
        /// Empty looks since the last state asked.
        idle: u32,
        /// Whether the store said it is done: the rest of its events are read
        /// (one read returns a bounded batch, and its last write may have
        /// carried many more) until a read finds none.
        draining: bool,
    }
    /// What one look found.
    enum Look {
        Events(Vec<ClientEvent>),
        Nothing,
        /// Its last events (done).
        Ended(Vec<ClientEvent>),
        Gone,
    }
    impl Reader {
        async fn next(&mut self) -> Result<Look, StoreError> {
            let events = self.store.read_events(&self.id, self.after).await?;
            if self.draining {
                return Ok(match events.is_empty() {
                    true => Look::Ended(events),
                    false => Look::Events(events),
                });
            }
            if !events.is_empty() {
                // The next empty look asks whether these were the last.
                self.idle = POLLS_PER_STATE - 1;
                return Ok(Look::Events(events));
            }
            self.idle += 1;
            if self.idle < POLLS_PER_STATE {
                return Ok(Look::Nothing);
            }
            self.idle = 0;
            // Nothing new for a while: ended once done (its last events were
            // appended with `done`: the reads from now on have them all) or
            // gone.
            match self.store.log_done(&self.id).await? {
                Some(false) => Ok(Look::Nothing),
                Some(true) => {
                    self.draining = true;
                    let events = self.store.read_events(&self.id, self.after).await?;
                    Ok(match events.is_empty() {
                        true => Look::Ended(events),
                        false => Look::Events(events),
                    })
                }
                None => Ok(Look::Gone),
            }
        }
    }
    let reader = Reader {
        store,
        id,
        after,
        finished: false,
        idle: POLLS_PER_STATE,
        draining: false,
    };
    let stream = futures_util::stream::unfold(reader, |mut reader| async move {
        loop {
            if reader.finished {
                return None;
            }
            let ending = |code: &str, message: String| {
                let error = json!({"type": "error", "code": code, "message": message,
                    "param": null});
                frames(&[ClientEvent::from_value(&error)])
            };
            let (events, ended) = match reader.next().await {
                Ok(Look::Events(events)) => (events, false),
                Ok(Look::Ended(events)) => (events, true),
                Ok(Look::Nothing) => {
                    tokio::time::sleep(SHARED_POLL).await;
                    continue;
                }
                Ok(Look::Gone) => {
                    reader.finished = true;
                    let message = format!("response `{}` was deleted, or expired", reader.id);
                    return Some((Ok(ending("response_not_found", message)), reader));
                }
                Err(err) => {
                    reader.finished = true;
                    let bytes = ending("response_store_unavailable", err.to_string());
                    return Some((Ok(bytes), reader));
                }
            };
            if let Some(last) = events.last().and_then(ClientEvent::sequence) {
                reader.after = Some(last);
            }
            reader.finished = ended;
            if !events.is_empty() || ended {
                return Some((Ok(frames(&events)), reader));
            }
        }
    });
    event_stream_response(stream)
}
