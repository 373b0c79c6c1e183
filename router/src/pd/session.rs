//! The decode side of one request, across every decoder that serves it.
//!
//! A session opens a decoder's stream, relays (or collects) its tokens through the
//! client's [`Output`] and journals them; when the decoder fails it resumes the
//! request on another decoder (fail-over with the client's own body before the
//! first token, the completions continuation after it), at most `max_resumes`
//! times. The client sees one stream or one response, or a clear error: never a
//! silent truncation.

use super::attempt::{Attempt, Cause, Event, Failure};
use super::chunk::{self, ErrorEvent};
use super::decode::{self, OpenError};
use super::output::{Output, Source};
use super::prefill::Prefilled;
use super::request::{RequestInfo, Route};
use super::resume;
use crate::config::OnHoldLost;
use crate::error::ApiError;
use crate::holds::{Hold, HoldState};
use crate::journal::JournalHandle;
use crate::registry::Instance;
use crate::state::AppState;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use serde_json::Value;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One request's decode, from the first decoder to the last token.
pub struct Session {
    state: Arc<AppState>,
    info: RequestInfo,
    body: Value,
    /// The client's prompt as token ids (from the first prefill).
    prompt_token_ids: Vec<u32>,
    /// The hold the next attempt pulls from (replaced by a re-prefill).
    hold: Prefilled,
    journal: JournalHandle,
    output: Output,
    attempt: Option<Attempt>,
    /// Why the request cannot be continued mid-stream, if it cannot.
    blocker: Option<&'static str>,
    /// Decoders that failed this request, avoided while others exist.
    failed: Vec<String>,
    resumes: u32,
    epoch: u64,
    first_decoder: Option<String>,
    /// Bytes for a streaming client, in order.
    out: VecDeque<Bytes>,
    /// An event taken while gathering a batch, handled by the next call.
    deferred: Option<(Event, Source, Arc<Instance>)>,
    /// Chunks of the current decoder whose token ids came without their text:
    /// the engine's detokenizer holds back a character split across tokens
    /// until its last byte. They are journaled and relayed with the chunk that
    /// brings the text; a resume drops them and continues after the last token
    /// whose text the client has, since the next decoder sees those tokens only
    /// in its prompt and would never emit the held bytes.
    withheld: Vec<Bytes>,
    error: Option<ApiError>,
    timing: Timing,
}

/// Latency bookkeeping of a session.
struct Timing {
    started: Instant,
    last_token: Option<Instant>,
    /// When the last decoder failure was detected, until the next token.
    failure_detected: Option<Instant>,
    inter_token: Option<metrics::Histogram>,
}

impl Session {
    /// Opens the first decoder stream; an error here is the client's HTTP error.
    pub async fn start(
        state: Arc<AppState>,
        info: RequestInfo,
        body: Value,
        hold: Prefilled,
        journal: JournalHandle,
    ) -> Result<Self, ApiError> {
        journal.set_hold(&hold.kv_transfer_params);
        let mut session = Self {
            output: Output::new(&info, hold.prompt_token_ids.clone()),
            prompt_token_ids: hold.prompt_token_ids.clone(),
            blocker: resume::mid_stream_blocker(info.route, &body),
            epoch: hold
                .kv_transfer_params
                .get("resume_epoch")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            state,
            info,
            body,
            hold,
            journal,
            attempt: None,
            failed: Vec::new(),
            resumes: 0,
            first_decoder: None,
            out: VecDeque::new(),
            deferred: None,
            withheld: Vec::new(),
            error: None,
            timing: Timing {
                started: Instant::now(),
                last_token: None,
                failure_detected: None,
                inter_token: None,
            },
        };
        session.connect(None).await?;
        Ok(session)
    }

    pub fn info(&self) -> &RequestInfo {
        &self.info
    }

    /// The first decoder that served the request.
    pub fn first_decoder(&self) -> &str {
        self.first_decoder.as_deref().unwrap_or_default()
    }

    /// Opens a stream on a decoder, after `failure` of the previous one when
    /// given. Every failure counts as one resume, bounded by `max_resumes`.
    async fn connect(&mut self, mut failure: Option<Failure>) -> Result<(), ApiError> {
        loop {
            if let Some(failure) = failure.take() {
                self.count_resume(failure)?;
                self.ensure_hold().await?;
            }
            let wait = if self.resumes == 0 {
                Duration::ZERO
            } else {
                Duration::from_millis(self.state.config.resume_wait_ms)
            };
            let Some(decoder) =
                wait_for_decoder(&self.state, &self.info.model, &self.failed, wait).await
            else {
                return Err(ApiError::Unavailable(format!(
                    "no decode instance is ready for model `{}`",
                    self.info.model
                )));
            };
            let (source, path, payload) = self.next_body();
            let epoch = self.epoch;
            self.journal.update(|e| e.epoch = epoch);
            match decode::open(
                &self.state,
                decoder.clone(),
                path,
                &self.info.request_id,
                payload,
                source,
            )
            .await
            {
                Ok(attempt) => {
                    self.first_decoder.get_or_insert_with(|| decoder.id.clone());
                    self.timing.inter_token = Some(crate::metrics::inter_token(&decoder.id));
                    self.journal.update(|e| {
                        e.phase = "decode";
                        e.decoder = Some(decoder.id.clone());
                        e.attempt += 1;
                    });
                    self.attempt = Some(attempt);
                    return Ok(());
                }
                Err(OpenError::Failed(next)) => failure = Some(next),
                Err(OpenError::Rejected(error)) => return Err(error),
            }
        }
    }

    /// Checks that `failure` may be resumed and counts it.
    fn count_resume(&mut self, failure: Failure) -> Result<(), ApiError> {
        let max = self.state.config.max_resumes;
        tracing::warn!(request_id = %self.info.request_id, decoder = %failure.decoder,
            cause = failure.cause.as_str(), message = %failure.message, resumes = self.resumes, "decoder failed");
        let generated = self.output.generated();
        if let (Some(blocker), true) = (self.blocker, generated > 0) {
            return Err(ApiError::Unavailable(format!(
                "{}; a request with {blocker} cannot be resumed after its first token",
                failure.message
            )));
        }
        if self.resumes >= max {
            return Err(ApiError::Unavailable(format!(
                "{}; gave up after {max} resumes",
                failure.message
            )));
        }
        self.resumes += 1;
        self.epoch += 1;
        self.timing
            .failure_detected
            .get_or_insert_with(Instant::now);
        crate::metrics::resume(failure.cause.as_str());
        if !self.failed.contains(&failure.decoder) {
            self.failed.push(failure.decoder.clone());
        }
        let cause = failure.cause.as_str();
        self.journal.update(|e| {
            e.resumes = self.resumes;
            e.causes.push(cause);
        });
        Ok(())
    }

    /// Before a resume relies on the hold: checks that it is still there, and
    /// when it is not, re-prefills prompt + generated (`--on-hold-lost
    /// reprefill`) or fails the request (`fail`).
    async fn ensure_hold(&mut self) -> Result<(), ApiError> {
        let Some(hold) = Hold::from_params(&self.hold.kv_transfer_params) else {
            return Ok(());
        };
        let HoldState::Lost(reason) = self.state.holds.check(&hold).await else {
            return Ok(());
        };
        tracing::warn!(request_id = %self.info.request_id, %reason, "hold lost");
        if self.state.config.on_hold_lost == OnHoldLost::Fail {
            return Err(ApiError::Unavailable(format!(
                "{reason}; not prefilling again (--on-hold-lost fail)"
            )));
        }
        crate::metrics::reprefill();
        let generated = &self.output.first().token_ids;
        let prefilled = if generated.is_empty() {
            super::prefill::run(&self.state, &self.info, &self.body).await?
        } else {
            // The whole context so far becomes the new hold's prompt.
            let mut info = self.info.clone();
            info.route = Route::Completions;
            let body = resume::resume_body(
                self.info.route,
                &self.body,
                &self.prompt_token_ids,
                generated,
                &Value::Null,
            );
            super::prefill::run(&self.state, &info, &body).await?
        };
        self.state.holds.release(hold);
        self.journal.set_hold(&prefilled.kv_transfer_params);
        self.journal
            .update(|e| e.prefill = Some(prefilled.instance.clone()));
        self.hold = prefilled;
        Ok(())
    }

    /// The route and body of the next attempt: the client's own before the first
    /// token, the completions continuation after it.
    fn next_body(&self) -> (Source, &'static str, Bytes) {
        let kv = resume::with_epoch(&self.hold.kv_transfer_params, self.epoch);
        let first = self.output.first();
        if self.output.generated() == 0 {
            let body = decode::decode_body(&self.body, &kv);
            (Source::Native, self.info.route.path(), to_bytes(&body))
        } else {
            let body = resume::resume_body(
                self.info.route,
                &self.body,
                &self.prompt_token_ids,
                &first.token_ids,
                &kv,
            );
            (Source::Resumed, Route::Completions.path(), to_bytes(&body))
        }
    }

    /// The next bytes for a streaming client; `None` at the end. A non-stream
    /// client's session runs through here too, collecting.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if let Some(bytes) = self.out.pop_front() {
                return Some(bytes);
            }
            let (event, source, decoder) = match self.deferred.take() {
                Some(deferred) => deferred,
                None => {
                    let attempt = self.attempt.as_mut()?;
                    let (source, decoder) = (attempt.source, attempt.decoder().clone());
                    (attempt.next().await, source, decoder)
                }
            };
            match event {
                Event::Data(data) => {
                    if let Err(failure) = self.on_data(&data, source, &decoder.id) {
                        self.recover(failure).await;
                    }
                }
                Event::Done => self.on_end(None).await,
                Event::Failed(failure) => self.on_end(Some(failure)).await,
            }
        }
    }

    /// The next bytes for a streaming client together with all that the decoder
    /// has already sent: one write to the client per burst instead of one per
    /// token (each write to a socket costs far more than relaying a chunk).
    async fn next_batch(&mut self) -> Option<Bytes> {
        let first = self.next_bytes().await?;
        let mut batch: Option<BytesMut> = None;
        for _ in 0..BATCH_EVENTS {
            while let Some(bytes) = self.out.pop_front() {
                batch
                    .get_or_insert_with(|| BytesMut::from(&first[..]))
                    .extend_from_slice(&bytes);
            }
            if self.deferred.is_some() || batch.as_ref().is_some_and(|b| b.len() >= BATCH_BYTES) {
                break;
            }
            // The upstream connection task decodes one chunk each time the body
            // asks for more, and the hand-off takes a few scheduler turns: give
            // it those, then take what it has without waiting.
            let Some(attempt) = self.attempt.as_mut() else {
                break;
            };
            let (source, decoder) = (attempt.source, attempt.decoder().clone());
            let mut got = None;
            for _ in 0..HANDOFF_TURNS {
                tokio::task::yield_now().await;
                got = attempt.next().now_or_never();
                if got.is_some() {
                    break;
                }
            }
            match got {
                Some(Event::Data(data)) => {
                    if let Err(failure) = self.on_data(&data, source, &decoder.id) {
                        self.deferred = Some((Event::Failed(failure), source, decoder));
                    }
                }
                // The end, or a failure: handled (with its async work) by the
                // next call, after this batch went out.
                Some(event) => self.deferred = Some((event, source, decoder)),
                None => break,
            }
        }
        Some(batch.map_or(first, BytesMut::freeze))
    }

    /// Journals and relays one chunk. A chunk that says the decoder failed is
    /// returned as a failure.
    fn on_data(&mut self, data: &Bytes, source: Source, decoder: &str) -> Result<(), Failure> {
        let Some(parsed) = chunk::parse(data) else {
            return Err(Failure {
                message: format!("decoder {decoder} sent an invalid chunk"),
                decoder: decoder.to_string(),
                cause: Cause::ServerError,
            });
        };
        if let Some(raw) = parsed.error {
            let error = ErrorEvent::parse(raw);
            if error.is_server_error() {
                return Err(Failure {
                    message: format!("decoder {decoder} failed: {}", error.message),
                    decoder: decoder.to_string(),
                    cause: Cause::ServerError,
                });
            }
            // The engine refused the request itself: retrying will not help.
            self.end_with_error(ApiError::BadGateway {
                instance: decoder.to_string(),
                message: error.message,
            });
            return Ok(());
        }
        // vLLM finishes a request it could not run (e.g. its KV could not be
        // loaded, with kv_load_failure_policy "fail") with finish_reason "error":
        // that is the decoder failing, not the request ending.
        if parsed
            .choices
            .iter()
            .any(|c| c.finish_reason.as_deref() == Some("error"))
        {
            return Err(Failure {
                message: format!("decoder {decoder} finished the request with an error"),
                decoder: decoder.to_string(),
                cause: Cause::ServerError,
            });
        }
        let tokens: usize = parsed
            .choices
            .iter()
            .map(|c| c.token_ids.as_ref().map_or(0, Vec::len))
            .sum();
        if tokens > 0 {
            self.on_tokens(decoder);
        }
        if self.blocker.is_none() && text_withheld(&parsed) {
            self.withheld.push(data.clone());
            return Ok(());
        }
        for held in std::mem::take(&mut self.withheld) {
            if let Some(parsed) = chunk::parse(&held) {
                self.relay(&parsed, &held, source);
            }
        }
        self.relay(&parsed, data, source);
        Ok(())
    }

    /// Journals one chunk and queues what a streaming client gets of it.
    fn relay(&mut self, parsed: &chunk::Chunk<'_>, data: &[u8], source: Source) {
        if let Some(first) = parsed.choices.iter().find(|c| c.index == 0) {
            let ids = first.token_ids.as_deref().unwrap_or_default();
            let text = first.text();
            let finish = first.finish_reason.as_deref();
            self.journal.update(|e| {
                e.generated_token_ids.extend_from_slice(ids);
                e.text.push_str(text);
                if let Some(finish) = finish {
                    e.finish_reason = Some(finish.to_string());
                }
            });
        }
        if let Some(bytes) = self.output.absorb(parsed, data, source) {
            self.out.push_back(bytes);
        }
    }

    /// Token timing: TTFT, inter-token gaps, and the resume latency (failure
    /// detected -> first token after it).
    fn on_tokens(&mut self, decoder: &str) {
        let now = Instant::now();
        match self.timing.last_token {
            None => crate::metrics::first_token(
                self.info.route.path(),
                decoder,
                now - self.timing.started,
            ),
            Some(last) => {
                if let Some(histogram) = &self.timing.inter_token {
                    histogram.record((now - last).as_secs_f64());
                }
            }
        }
        if let Some(detected) = self.timing.failure_detected.take() {
            crate::metrics::resume_latency(now - detected);
        }
        self.timing.last_token = Some(now);
    }

    /// The decoder's stream ended, cleanly (`failure` None) or not.
    async fn on_end(&mut self, failure: Option<Failure>) {
        if self.output.all_finished() {
            // Every choice has its finish_reason: a connection lost after the last
            // token costs the client nothing.
            return self.finish();
        }
        let failure = failure.unwrap_or_else(|| {
            let decoder = self
                .attempt
                .as_ref()
                .map(|a| a.decoder().id.clone())
                .unwrap_or_default();
            Failure {
                message: format!("decoder {decoder} ended the stream before finishing"),
                decoder,
                cause: Cause::Truncated,
            }
        });
        self.recover(failure).await;
    }

    /// Moves the request to another decoder after `failure`, or ends it with an
    /// error when it cannot be moved.
    async fn recover(&mut self, failure: Failure) {
        // Dropping the attempt closes its connection: the engine aborts its copy.
        self.attempt = None;
        self.withheld.clear();
        if let Err(error) = self.connect(Some(failure)).await {
            if self.resumes > 0 {
                crate::metrics::failed_after_resume();
            }
            self.end_with_error(error);
        }
    }

    fn finish(&mut self) {
        self.attempt = None;
        if self.info.stream {
            self.out.extend(self.output.end_events());
        }
        self.journal.update(|e| e.phase = "finished");
        self.record(200);
    }

    fn end_with_error(&mut self, error: ApiError) {
        self.attempt = None;
        tracing::warn!(request_id = %self.info.request_id, %error, "request failed");
        if self.info.stream {
            self.out.extend(Output::error_events(&error));
        }
        self.journal.update(|e| e.phase = "failed");
        self.record(error.status().as_u16());
        self.error = Some(error);
    }

    fn record(&self, status: u16) {
        crate::metrics::request_finished(
            self.info.route.path(),
            status,
            self.timing.started.elapsed(),
        );
    }

    /// A streaming response that relays chunk by chunk.
    pub fn into_sse_response(self) -> Response {
        let body = futures_util::stream::unfold(self, |mut session| async move {
            session
                .next_batch()
                .await
                .map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), session))
        });
        (
            [
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
            ],
            Body::from_stream(body),
        )
            .into_response()
    }

    /// Runs the session to its end and answers one response (non-stream client).
    pub async fn collect(mut self) -> Result<Response, ApiError> {
        while self.next_bytes().await.is_some() {}
        if let Some(error) = self.error.take() {
            return Err(error);
        }
        let mut response = axum::Json(self.output.response()).into_response();
        response
            .headers_mut()
            .insert(RESUMES_HEADER, self.resumes.into());
        Ok(response)
    }
}

impl Drop for Session {
    /// However the request ended (finished, failed, or its client went away),
    /// its hold is released: the decoder does so on a normal finish, the router
    /// always, as a backstop.
    fn drop(&mut self) {
        if let Some(hold) = Hold::from_params(&self.hold.kv_transfer_params) {
            self.state.holds.release(hold);
        }
    }
}

/// A decoder for the next attempt, waiting up to `wait` when none is eligible
/// right now (a restarted decoder re-registers within a heartbeat).
async fn wait_for_decoder(
    state: &AppState,
    model: &str,
    failed: &[String],
    wait: Duration,
) -> Option<Arc<Instance>> {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(decoder) = decode::choose(state, model, failed) {
            return Some(decoder);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Most events gathered into one write to a streaming client, and the size
/// past which a batch goes out anyway.
const BATCH_EVENTS: usize = 64;
const BATCH_BYTES: usize = 64 * 1024;
/// Scheduler turns a batch waits for the next chunk the decoder already sent
/// (measured: one turn almost never suffices, four almost always do; a chunk
/// not yet sent costs these few turns, microseconds).
const HANDOFF_TURNS: usize = 4;

/// Response header (non-stream) counting the resumes a request needed.
pub const RESUMES_HEADER: &str = "x-connex-resumes";

/// Whether a chunk brings token ids but not yet their text (and no finish):
/// one choice, as only single-choice requests are resumed mid-stream.
fn text_withheld(parsed: &chunk::Chunk<'_>) -> bool {
    match parsed.choices.as_slice() {
        [choice] => {
            choice.token_ids.as_ref().is_some_and(|ids| !ids.is_empty())
                && choice.text().is_empty()
                && choice.finish_reason.is_none()
        }
        _ => false,
    }
}

fn to_bytes(body: &Value) -> Bytes {
    Bytes::from(serde_json::to_vec(body).unwrap_or_default())
}
