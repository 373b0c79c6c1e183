//! The routes whose protocol is translated to and from a chat completion
//! (Responses, Messages): one driver reads the request, runs the chat through
//! prefill/decode (`pd::run`, so it is resumed like any chat) with the
//! translation as the relay's client protocol (`protocols::translator`), fed
//! each chat chunk as it is journaled, and answers with the protocol's
//! events or its whole answer.

use super::body::{read_budgeted, BodyLimits};
use super::openai::{engine_request_id, request_id};
use crate::edge::gate::AdmissionSlot;
use crate::error::ApiError;
use crate::journal::EntryReader;
use crate::pd::record::RequestRecord;
use crate::protocols::event::{frames, Event, Out};
use crate::protocols::openai::chunk::Chunk;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::{validate, Route};
use crate::protocols::responses::live::Live;
use crate::protocols::responses::redis_store::RedisStore;
use crate::protocols::responses::store::{StoreError, Stored};
use crate::protocols::translator::Translator;
use crate::state::AppState;
use crate::tenants::Caller;
use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::{Stream, StreamExt};
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use std::sync::{Arc, Mutex, MutexGuard};
use tracing::Instrument;

/// A protocol's side of one request: its events from the chat's chunks,
/// written to `out` (where they go: `Out`'s kinds).
pub trait Translation: Send + 'static {
    /// The events before the first chunk.
    fn start(&mut self, out: &mut Out);
    /// The events of one chat chunk.
    fn chunk(&mut self, chunk: &Chunk<'_>, out: &mut Out);
    /// The last events of a chat that ended (`usage`: the router's count);
    /// returns the whole answer (as its JSON: written once, for the client,
    /// the store and a background response's readers alike).
    fn finish(&mut self, usage: Value, out: &mut Out) -> Box<RawValue>;
    /// The last events of a chat that failed (`error`: an OpenAI error
    /// object); returns the whole answer as it stands.
    fn fail(&mut self, error: &Value, out: &mut Out) -> Box<RawValue>;
    /// The non-stream answer from the whole answer `finish` or `fail` made.
    fn answer(&self, whole: Box<RawValue>, failed: bool) -> Response;
    /// The last events of a generation cancelled by its client; returns the
    /// whole answer as it stands (background responses only).
    fn cancel(&mut self, out: &mut Out) -> Box<RawValue> {
        self.fail(&json!({"message": "cancelled"}), out)
    }
    /// What must be kept before the last events go out (a stored response,
    /// so that a client that read them can at once continue from it).
    fn keep(&mut self) -> Option<BoxFuture<'static, ()>> {
        None
    }
    /// What `keep` would store, taken instead: a background response's
    /// writer stores it under its lease in the shared store (`mirror.rs`).
    fn take_kept(&mut self) -> Option<Stored> {
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

/// Where a translation's events go.
pub enum Sink {
    /// A streaming client's stream.
    Client,
    /// Nowhere: a non-stream client gets the whole answer.
    Whole,
    /// A background response's log (its last events and checkpoints are
    /// written by [`run_apart`]).
    Live(Arc<Live>),
}

/// A translation as the relay drives it.
pub struct Driver<T> {
    translation: T,
    sink: Sink,
    /// Whether its first events were made (a generation taken over from
    /// another replica had them there).
    started: bool,
    /// The last events and the whole answer of the chat's end, until they go
    /// out (after what the translation keeps), and whether it failed.
    ending: Option<(Out, Box<RawValue>, bool)>,
    /// Whether its last events were made (by the chat's end or a cut).
    ended: bool,
}

impl<T: Translation> Driver<T> {
    /// Where the next events are written, for the sink.
    fn out(&self) -> Out {
        match &self.sink {
            Sink::Client => Out::Frames(Vec::new()),
            Sink::Whole => Out::Nowhere,
            Sink::Live(_) => Out::Events(Vec::new()),
        }
    }

    /// What the translation keeps as it ends: with a shared store, a
    /// background response's writer stores it under its lease (nothing to
    /// wait for here: readers get the last events once it is stored).
    fn keeping(&mut self) -> Option<BoxFuture<'static, ()>> {
        if let Sink::Live(live) = &self.sink {
            if live.is_shared() {
                if let Some(stored) = self.translation.take_kept() {
                    live.keep(stored);
                }
                return None;
            }
        }
        self.translation.keep()
    }

    /// The events written to `out` to the sink; a streaming client's bytes.
    fn send(&self, out: Out) -> Option<Bytes> {
        match (&self.sink, out) {
            (Sink::Client, Out::Frames(frames)) if !frames.is_empty() => Some(frames.into()),
            (Sink::Live(live), Out::Events(events)) if !events.is_empty() => {
                live.push(events, None);
                None
            }
            _ => None,
        }
    }
}

/// A driver shared by the relay, which feeds it, and the route, which
/// answers from it (a whole answer, a background response's checkpoints).
pub struct Shared<T>(Arc<Mutex<Driver<T>>>);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T: Translation> Shared<T> {
    pub fn new(translation: T, sink: Sink, started: bool) -> Self {
        Self(Arc::new(Mutex::new(Driver {
            translation,
            sink,
            started,
            ending: None,
            ended: false,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Driver<T>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The chat's end, once it came: its last events, the whole answer and
    /// whether it failed (taken: they go out once).
    fn take_ending(&self) -> Option<(Out, Box<RawValue>, bool)> {
        self.lock().ending.take()
    }

    /// The relay's handle on it.
    pub fn translator(&self) -> Box<dyn Translator> {
        Box::new(self.clone())
    }

    /// The last bytes of a streaming client's stream cut at the end of the
    /// shutdown grace (`gate::StreamEnding`): the chat's own end when it came
    /// and has not gone out yet (it waited on what the translation keeps),
    /// else the translation's failure events, numbered on from its last
    /// (Responses: `error` and `response.failed`; Messages: its open block
    /// closed and Anthropic's `error` event). Nothing when the end went out.
    fn cut(&self) -> Bytes {
        let mut driver = self.lock();
        if let Some((out, _, _)) = driver.ending.take() {
            return driver.send(out).unwrap_or_default();
        }
        if std::mem::replace(&mut driver.ended, true) {
            return Bytes::new();
        }
        let error = crate::edge::gate::shutdown_error().body();
        let mut out = driver.out();
        driver.translation.fail(&error["error"], &mut out);
        driver.send(out).unwrap_or_default()
    }
}

impl<T: Translation> Translator for Shared<T> {
    fn start(&mut self) -> Option<Bytes> {
        let mut driver = self.lock();
        if std::mem::replace(&mut driver.started, true) {
            return None;
        }
        let mut out = driver.out();
        driver.translation.start(&mut out);
        driver.send(out)
    }

    fn chunk(&mut self, chunk: &Chunk<'_>) -> Option<Bytes> {
        let mut driver = self.lock();
        let mut out = driver.out();
        driver.translation.chunk(chunk, &mut out);
        driver.send(out)
    }

    fn finish(&mut self, usage: Value) -> Option<BoxFuture<'static, ()>> {
        let mut driver = self.lock();
        let mut out = driver.out();
        let whole = driver.translation.finish(usage, &mut out);
        driver.ending = Some((out, whole, false));
        driver.ended = true;
        driver.keeping()
    }

    fn fail(&mut self, error: &ApiError) {
        let mut driver = self.lock();
        let mut out = driver.out();
        let whole = driver.translation.fail(&error.body()["error"], &mut out);
        driver.ending = Some((out, whole, true));
        driver.ended = true;
    }

    fn last(&mut self) -> Option<Bytes> {
        let mut driver = self.lock();
        // Only a streaming client's go out here: the route takes the others'.
        if !matches!(driver.sink, Sink::Client) {
            return None;
        }
        let (out, _, _) = driver.ending.take()?;
        driver.send(out)
    }
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
    let engine_fields = caller.clone();
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
            let limits = BodyLimits::client(&state.flow.requests);
            let read = read_budgeted(&headers, body, limits, &state.body_budget).await?;
            record.hold_body_share(read.permit);
            if let Some(caller) = &engine_fields {
                caller.charge_body(read.bytes.len())?;
            }
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
        // The tenant's priority and KV salt (the protocols have no field of
        // their own for either).
        let mut chat = ClientBody::of(prepared.chat);
        if let Some(caller) = &engine_fields {
            if let Err(error) = super::openai::set_engine_fields(caller, &mut chat) {
                record.finish(error.status().as_u16());
                return Err(failed(error));
            }
        }
        let chat_value = chat.fields();
        // What a replica taking the generation over needs of the request.
        let origin = (background.is_some() && state.responses.shared.is_some()).then(|| {
            json!({"chat": chat_value, "tenant": tenant,
                   "request_id": record.request_id(), "translation": translation.origin()})
        });
        let info = match validate(
            Route::Chat,
            &chat,
            engine_request_id(record.request_id()),
            state.flow.requests.max_tokens_limit,
        ) {
            Ok(info) => info,
            Err(error) => {
                record.finish(error.status().as_u16());
                return Err(failed(error));
            }
        };
        let sink = match (&background, stream) {
            (Some(live), _) => Sink::Live(live.clone()),
            (None, true) => Sink::Client,
            (None, false) => Sink::Whole,
        };
        let driver = Shared::new(translation, sink, false);
        let (chat_response, entry) = crate::pd::run_observed(
            state.flow.clone(),
            info,
            chat,
            record,
            Some(driver.translator()),
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
                    .insert(crate::edge::gate::StreamEnding::new(move || ending.cut()));
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

/// The end of a chat whose session ended without one (it always makes one:
/// its last events or its error's).
fn no_ending<T: Translation>(driver: &Shared<T>) -> (Out, Box<RawValue>, bool) {
    let error = json!({"message": "the generation ended before its end"});
    let mut driver = driver.lock();
    let mut out = driver.out();
    let whole = driver.translation.fail(&error, &mut out);
    (out, whole, true)
}

/// The whole answer of a non-stream request, once its chat ran to the end
/// (the chat's own headers, instances and resumes, stay).
async fn whole_answer<T: Translation>(driver: Shared<T>, chat_response: Response) -> Response {
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

/// A whole answer as a value (a background response's state).
fn value_of(whole: &RawValue) -> Value {
    serde_json::from_str(whole.get()).unwrap_or_default()
}

/// Most time between two checkpoints of a background generation (with a
/// shared store).
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// A background generation to run apart from its request.
pub struct Apart<T> {
    /// Its translation, fed by the chat's relay (its sink the `live` log).
    pub driver: Shared<T>,
    pub live: Arc<Live>,
    pub chat_response: Response,
    /// The chat's journal entry (its checkpoints, with a shared store).
    pub entry: EntryReader,
    pub admission: Option<crate::tenants::Admission>,
    /// The lease this replica holds on it in the shared store (a
    /// generation taken over; a new one gets its own).
    pub lease: Option<Lease>,
}

/// A lease a replica holds on a background response it took over.
pub struct Lease {
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
pub async fn run_apart<T: Translation>(state: &AppState, run: Apart<T>, origin: Option<Value>) {
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
    let json_len = crate::protocols::responses::live::json_len;
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
                crate::protocols::responses::redis_store::lease_token(),
                tokio::time::Instant::now(),
            ),
        };
        // Until its first write, as long as its lease would allow.
        let hold = crate::protocols::responses::mirror::hold_for(shared.lease());
        live.gate(since + hold);
        live.push_checkpointed(Vec::new(), None, checkpoint());
        // In the store before the client has the id, which it may take to
        // any replica at once (a generation taken over has its origin there).
        let mut origin = origin;
        let mut sent = crate::protocols::responses::mirror::Sent::default();
        if let Some(first) = &origin {
            if crate::protocols::responses::mirror::publish(
                shared, &id, &token, &live, first, &mut sent,
            )
            .await
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
                sent,
                state.responses.live.stop.clone(),
            ));
    }
    state.flow.drains.spawn(async move {
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
                if let Some(last) = events.last().and_then(Event::sequence) {
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
        Events(Vec<Event>),
        Nothing,
        /// Its last events (done).
        Ended(Vec<Event>),
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
                frames(&[Event::from_value(&error)])
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
            if let Some(last) = events.last().and_then(Event::sequence) {
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
