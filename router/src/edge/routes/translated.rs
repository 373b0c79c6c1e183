//! The routes whose protocol is translated to and from a chat completion
//! (Responses, Messages): one driver reads the request, runs the chat through
//! prefill/decode (`pd::run`, so it is resumed like any chat), and turns the
//! chat's stream into the protocol's events or its whole answer.

use super::body::{read_budgeted, BodyLimits};
use super::openai::{engine_request_id, request_id};
use crate::edge::gate::AdmissionSlot;
use crate::error::ApiError;
use crate::journal::EntryReader;
use crate::pd::record::RequestRecord;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::{validate, Route};
use crate::protocols::responses::live::Live;
use crate::protocols::responses::redis_store::RedisStore;
use crate::protocols::responses::store::StoreError;
use crate::protocols::segments::ChatChunk;
use crate::protocols::sse::SseParser;
use crate::state::AppState;
use crate::tenants::Caller;
use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::{Stream, StreamExt};
use serde_json::{json, Map, Value};
use std::sync::Arc;
use tracing::Instrument;

/// A protocol's side of one request: its events from the chat's chunks.
pub trait Translation: Send + 'static {
    /// The events before the first chunk.
    fn start(&mut self) -> Vec<Value>;
    /// The events of one chat chunk.
    fn chunk(&mut self, chunk: &ChatChunk<'_>) -> Vec<Value>;
    /// The last events of a chat that ended, and the whole answer.
    fn finish(&mut self) -> (Vec<Value>, Value);
    /// The last events of a chat that failed (`error` as the chat said it),
    /// and the whole answer as it stands.
    fn fail(&mut self, error: &Value) -> (Vec<Value>, Value);
    /// The non-stream answer from the whole answer `finish` or `fail` made.
    fn answer(&self, whole: Value, failed: bool) -> Response;
    /// The last events of a generation cancelled by its client, and the whole
    /// answer as it stands (background responses only).
    fn cancel(&mut self) -> (Vec<Value>, Value) {
        self.fail(&json!({"message": "cancelled"}))
    }
    /// What must be kept before the last events go out (a stored response,
    /// so that a client that read them can at once continue from it).
    fn keep(&mut self) -> Option<BoxFuture<'static, ()>> {
        None
    }
    /// What of the translation never changes, for a replica that takes a
    /// background generation over (`takeover.rs`).
    fn origin(&self) -> Value {
        Value::Null
    }
    /// The translation's state as of its last events, for the same.
    fn checkpoint(&self) -> Value {
        Value::Null
    }
}

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
/// caller's tenant name), runs the chat and translates its answer.
pub async fn serve<T: Translation>(
    state: Arc<AppState>,
    path: &'static str,
    caller: Option<Caller>,
    admission: Option<AdmissionSlot>,
    headers: HeaderMap,
    body: Body,
    prepare: impl AsyncFnOnce(&Arc<AppState>, Map<String, Value>, &str) -> Result<Prepared<T>, ApiError>,
) -> Result<Response, ApiError> {
    let mut record = RequestRecord::new(path, request_id(&headers));
    crate::observe::traces::continue_trace(record.span(), &headers);
    let span = record.span().clone();
    let priority = caller.as_ref().and_then(|c| c.priority);
    let tenant = caller
        .as_ref()
        .map(|c| c.tenant.to_string())
        .unwrap_or_default();
    if let Some(caller) = caller {
        record.set_caller(caller);
    }
    let client_id = HeaderValue::from_str(record.request_id()).ok();
    let answered = async move {
        let prepared = async {
            let limits = BodyLimits::client(&state.config);
            let read = read_budgeted(&headers, body, limits, &state.body_budget).await?;
            record.hold_body_share(read.permit);
            let request: Map<String, Value> = serde_json::from_slice(&read.bytes)
                .map_err(|err| ApiError::bad_request(format!("request body: {err}"), None))?;
            prepare(&state, request, &tenant).await
        }
        .await;
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                record.finish(error.status().as_u16());
                return Err(error);
            }
        };
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
        let mut chat_value = prepared.chat;
        if let Some(priority) = priority {
            chat_value["priority"] = priority.into();
        }
        // What a replica taking the generation over needs of the request.
        let origin = (background.is_some() && state.responses.shared.is_some()).then(|| {
            json!({"chat": chat_value, "tenant": tenant,
                   "request_id": record.request_id(), "translation": translation.origin()})
        });
        let chat = ClientBody::of(chat_value);
        let info = match validate(
            Route::Chat,
            &chat,
            engine_request_id(record.request_id()),
            state.config.max_tokens_limit,
        ) {
            Ok(info) => info,
            Err(error) => {
                record.finish(error.status().as_u16());
                return Err(failed(error));
            }
        };
        let (chat_response, entry) =
            crate::pd::run_observed(state.flow.clone(), info, chat, record)
                .await
                .map_err(failed)?;
        Ok(match background {
            None => respond(translation, stream, chat_response).await,
            Some(live) => {
                // The slot goes with the generation, not with this answer.
                let admission = admission.and_then(|slot| slot.take());
                let run = Apart {
                    translation,
                    live: live.clone(),
                    chat_response,
                    entry,
                    admission,
                    started: false,
                    lease: None,
                };
                run_apart(&state, run, origin).await;
                if stream {
                    follow(live, None)
                } else {
                    axum::Json(live.response()).into_response()
                }
            }
        })
    }
    .instrument(span)
    .await;
    answered.map(|mut response| {
        if let Some(id) = client_id {
            response.headers_mut().insert("x-request-id", id);
        }
        response
    })
}

/// A translation fed with the chat's bytes.
struct Driver<T> {
    translation: T,
    parser: SseParser,
    ended: bool,
}

impl<T: Translation> Driver<T> {
    /// The events of the chat bytes `chunk` (or of the chat's end, `None`);
    /// the whole answer once the chat has ended, and whether it failed.
    fn feed(&mut self, chunk: Option<Bytes>) -> (Vec<Value>, Option<(Value, bool)>) {
        let mut out = Vec::new();
        let at_end = chunk.is_none();
        let payloads = chunk
            .map(|bytes| self.parser.push(bytes))
            .unwrap_or_default();
        for data in payloads {
            if self.ended {
                break;
            }
            if data.as_ref() == crate::protocols::sse::DONE {
                return self.end(out, None);
            }
            let chunk = match serde_json::from_slice::<ChatChunk<'_>>(&data) {
                Ok(chunk) => chunk,
                Err(err) => {
                    tracing::warn!(%err, "a chat chunk that is not one: left out of the translation");
                    continue;
                }
            };
            if let Some(error) = chunk.error {
                return self.end(out, Some(error));
            }
            out.extend(self.translation.chunk(&chunk));
        }
        if at_end && !self.ended {
            // The chat stream stopped without `[DONE]`: a failure.
            let error = json!({"message": "the generation ended before its end"});
            return self.end(out, Some(error));
        }
        (out, None)
    }

    /// Keeps what the translation keeps (once it has ended).
    async fn keep(&mut self) {
        if let Some(keeping) = self.translation.keep() {
            keeping.await;
        }
    }

    fn broke(&mut self, err: axum::Error) -> (Vec<Value>, Option<(Value, bool)>) {
        let error = json!({"message": format!("the stream broke: {err}")});
        self.end(Vec::new(), Some(error))
    }

    fn end(
        &mut self,
        mut out: Vec<Value>,
        error: Option<Value>,
    ) -> (Vec<Value>, Option<(Value, bool)>) {
        self.ended = true;
        let failed = error.is_some();
        let (last, whole) = match error {
            None => self.translation.finish(),
            Some(error) => self.translation.fail(&error),
        };
        out.extend(last);
        (out, Some((whole, failed)))
    }
}

/// One event as SSE: `event:` its type, `data:` the event (both protocols
/// frame their events so).
fn sse_event(event: &Value) -> Bytes {
    sse_events(std::slice::from_ref(event))
}

/// Events as SSE, written into one buffer (this is per token: no string
/// per event).
fn sse_events(events: &[Value]) -> Bytes {
    let mut out = Vec::with_capacity(256 * events.len());
    for event in events {
        let kind = event["type"].as_str().unwrap_or("message");
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\ndata: ");
        // Writing a Value into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, event);
        out.extend_from_slice(b"\n\n");
    }
    Bytes::from(out)
}

/// The client's response from the chat's: the events as a stream, or the
/// whole answer.
async fn respond<T: Translation>(
    translation: T,
    stream: bool,
    chat_response: Response,
) -> Response {
    let (parts, body) = chat_response.into_parts();
    let driver = Driver {
        translation,
        parser: SseParser::default(),
        ended: false,
    };
    let chat = body.into_data_stream();
    let mut response = if stream {
        Body::from_stream(event_stream(driver, chat)).into_response()
    } else {
        whole_answer(driver, chat).await
    };
    // The chat's own headers (instances, resumes) stay; the body's do not.
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            response.headers_mut().insert(name.clone(), value.clone());
        }
    }
    if stream {
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
    }
    response
}

fn event_stream<T: Translation>(
    mut driver: Driver<T>,
    chat: impl Stream<Item = Result<Bytes, axum::Error>> + Send + Unpin + 'static,
) -> impl Stream<Item = Result<Bytes, std::convert::Infallible>> + Send {
    let first = sse_events(&driver.translation.start());
    let rest = futures_util::stream::unfold((driver, chat), |(mut driver, mut chat)| async move {
        // Chat chunks that make no event (a role chunk) send nothing.
        loop {
            if driver.ended {
                return None;
            }
            let (events, whole) = match chat.next().await {
                Some(Ok(bytes)) => driver.feed(Some(bytes)),
                Some(Err(err)) => driver.broke(err),
                None => driver.feed(None),
            };
            if whole.is_some() {
                driver.keep().await;
            }
            if !events.is_empty() {
                return Some((Ok(sse_events(&events)), (driver, chat)));
            }
        }
    });
    futures_util::stream::once(async move { Ok(first) }).chain(rest)
}

/// The whole answer of a non-stream request (its chat read to the end).
async fn whole_answer<T: Translation>(
    mut driver: Driver<T>,
    mut chat: impl Stream<Item = Result<Bytes, axum::Error>> + Unpin,
) -> Response {
    driver.translation.start();
    loop {
        let (_, whole) = match chat.next().await {
            Some(Ok(bytes)) => driver.feed(Some(bytes)),
            Some(Err(err)) => driver.broke(err),
            None => driver.feed(None),
        };
        if let Some((whole, failed)) = whole {
            driver.keep().await;
            return driver.translation.answer(whole, failed);
        }
    }
}

/// Most time between two checkpoints of a background generation (with a
/// shared store).
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// A background generation to run apart from its request.
pub struct Apart<T> {
    pub translation: T,
    pub live: Arc<Live>,
    pub chat_response: Response,
    /// The chat's journal entry (its checkpoints, with a shared store).
    pub entry: EntryReader,
    pub admission: Option<crate::tenants::Admission>,
    /// Whether the translation has made its first events (a generation
    /// taken over from another replica).
    pub started: bool,
    /// The lease this replica holds on it in the shared store (a
    /// generation taken over; a new one gets its own).
    pub lease: Option<String>,
}

/// Drives a background generation to its end (or its cancel) in a task of
/// the router's, its events into `live`; the admission is held as long.
/// With a shared store, its events and checkpoints are copied there as they
/// come (`mirror.rs`), under a lease of this replica's; `origin` is written
/// with the first events (a generation taken over has it there already).
pub async fn run_apart<T: Translation>(state: &AppState, run: Apart<T>, origin: Option<Value>) {
    let Apart {
        translation,
        live,
        chat_response,
        entry,
        admission,
        started,
        lease,
    } = run;
    let mut driver = Driver {
        translation,
        parser: SseParser::default(),
        ended: false,
    };
    let mut chat = chat_response.into_body().into_data_stream();
    if !started {
        live.push(driver.translation.start(), None);
    }
    let shared = state.responses.shared.clone();
    let keeps_checkpoints = shared.is_some();
    // The journal as of the last batch the driver was fed: a checkpoint must
    // pair the translation with the decode it has seen, never with chunks
    // journaled for a batch still being gathered (a takeover from such a
    // checkpoint would never translate them).
    let mark_of = |entry: &EntryReader| entry.read(crate::pd::checkpoint::DecodeMark::of);
    let mut fed = mark_of(&entry);
    let checkpoint = {
        let entry = entry.clone();
        move |driver: &Driver<T>| {
            keeps_checkpoints.then(|| {
                let decode = entry.read(crate::pd::checkpoint::DecodeCheckpoint::of);
                json!({"decode": decode, "translation": driver.translation.checkpoint()})
            })
        }
    };
    if let Some(shared) = &shared {
        let id = live.response()["id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let token = lease.unwrap_or_else(|| crate::protocols::responses::new_id("lease"));
        live.gate();
        live.push_checkpointed(Vec::new(), None, checkpoint(&driver));
        // In the store before the client has the id, which it may take to
        // any replica at once (a generation taken over has its origin there).
        let mut origin = origin;
        if let Some(first) = &origin {
            if crate::protocols::responses::mirror::publish(shared, &id, &token, &live, first).await
            {
                origin = None;
            }
        }
        state
            .flow
            .drains
            .spawn(crate::protocols::responses::mirror::mirror(
                shared.clone(),
                id,
                token,
                live.clone(),
                origin,
                state.responses.live.stop.clone(),
            ));
    }
    state.flow.drains.spawn(async move {
        let _admission = admission;
        let mut checkpointed = tokio::time::Instant::now();
        // Events pushed since the last checkpoint (readers wait for one).
        let mut pending = false;
        loop {
            let next = tokio::select! {
                // A decoder that goes quiet: what came is checkpointed
                // anyway, so that its readers get it.
                _ = tokio::time::sleep_until(checkpointed + CHECKPOINT_EVERY), if pending => {
                    checkpointed = tokio::time::Instant::now();
                    // A batch half gathered: its read ends within a few
                    // scheduler turns and checkpoints then (or the next
                    // tick does).
                    if mark_of(&entry) == fed {
                        pending = false;
                        live.push_checkpointed(Vec::new(), None, checkpoint(&driver));
                    }
                    continue;
                }
                _ = live.cancel.cancelled() => {
                    // Dropping the chat stream ends the generation on its decoder.
                    if live.fenced() {
                        // It goes on elsewhere: nothing more is said here.
                        return;
                    }
                    let (events, whole) = driver.translation.cancel();
                    driver.keep().await;
                    let checkpoint = checkpoint(&driver);
                    live.push_checkpointed(events, Some(whole), checkpoint);
                    return;
                }
                next = chat.next() => next,
            };
            let (events, whole) = match next {
                Some(Ok(bytes)) => driver.feed(Some(bytes)),
                Some(Err(err)) => driver.broke(err),
                None => driver.feed(None),
            };
            if keeps_checkpoints {
                fed = mark_of(&entry);
            }
            let done = whole.is_some();
            if done {
                driver.keep().await;
            }
            // A checkpoint at most every CHECKPOINT_EVERY (and at the end):
            // the store gets events up to the last one and readers only what
            // the store has, so this bounds the writes and what a reader
            // waits for an event.
            let checkpoint = if done || checkpointed.elapsed() >= CHECKPOINT_EVERY {
                checkpointed = tokio::time::Instant::now();
                pending = false;
                checkpoint(&driver)
            } else {
                pending |= keeps_checkpoints && !events.is_empty();
                None
            };
            live.push_checkpointed(events, whole.map(|(whole, _)| whole), checkpoint);
            if done {
                return;
            }
        }
    });
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
                if let Some(last) = events.last().and_then(|e| e["sequence_number"].as_u64()) {
                    after = Some(last);
                }
                if !events.is_empty() || done {
                    let bytes = sse_events(&events);
                    return Some((
                        Ok::<_, std::convert::Infallible>(bytes),
                        (live, changes, after, done),
                    ));
                }
                if changes.changed().await.is_err() {
                    return None;
                }
            }
        },
    );
    event_stream_response(stream)
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

/// How long one blocking read of a shared event log waits (then the reader
/// looks whether the response is done, or gone).
const SHARED_READ_BLOCK: std::time::Duration = std::time::Duration::from_secs(1);

/// The events of background response `id`, generated by another replica,
/// after sequence number `after`, then the rest as the shared store gets
/// them, until it is done. The store failing ends the stream with an `error`
/// event (the client reads again from its last sequence number).
pub fn follow_shared(store: Arc<RedisStore>, id: String, after: Option<u64>) -> Response {
    struct Reader {
        store: Arc<RedisStore>,
        id: String,
        conn: Option<redis::aio::MultiplexedConnection>,
        after: Option<u64>,
        finished: bool,
    }
    impl Reader {
        /// The next events, and whether the log has ended.
        async fn next(&mut self) -> Result<(Vec<Value>, bool), StoreError> {
            let conn = match self.conn.as_mut() {
                Some(conn) => conn,
                None => self.conn.insert(self.store.reader().await?),
            };
            let events = self
                .store
                .read_events(conn, &self.id, self.after, Some(SHARED_READ_BLOCK))
                .await?;
            if !events.is_empty() {
                return Ok((events, false));
            }
            // Nothing new: ended once done (its last events were appended
            // with `done`, so one more read has them all) or gone.
            match self.store.log_state(&self.id).await? {
                Some(state) if !state.done => Ok((Vec::new(), false)),
                Some(_) => {
                    let rest = self
                        .store
                        .read_events(conn, &self.id, self.after, None)
                        .await?;
                    Ok((rest, true))
                }
                None => Ok((Vec::new(), true)),
            }
        }
    }
    let reader = Reader {
        store,
        id,
        conn: None,
        after,
        finished: false,
    };
    let stream = futures_util::stream::unfold(reader, |mut reader| async move {
        loop {
            if reader.finished {
                return None;
            }
            match reader.next().await {
                Ok((events, ended)) => {
                    if let Some(last) = events.last().and_then(|e| e["sequence_number"].as_u64()) {
                        reader.after = Some(last);
                    }
                    reader.finished = ended;
                    if !events.is_empty() || ended {
                        return Some((Ok(sse_events(&events)), reader));
                    }
                }
                Err(err) => {
                    reader.finished = true;
                    let error = json!({"type": "error", "code": "response_store_unavailable",
                        "message": err.to_string(), "param": null});
                    return Some((Ok(sse_event(&error)), reader));
                }
            }
        }
    });
    event_stream_response(stream)
}
