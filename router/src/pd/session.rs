//! The decode side of one request, across every decoder that serves it.
//!
//! A session opens a decoder's stream ([`decode`]), hands its events to the
//! [`Relay`] and, when the decoder fails, asks [`resume::decide`] what comes
//! next: another decoder for a connect that never reached one (not a resume), a
//! fail-over with the client's own body before the first token, the
//! completions continuation after it ([`reprefill`] first when the hold is
//! gone), or the end of the request with a clear error. The client sees one
//! stream or one response, or a clear error: never a silent truncation.

use super::attempt::Attempt;
use super::decode::{self, LanePlan, OpenError};
use super::deps::FlowDeps;
use super::derender::{self, Derender, DerenderTarget, RenderError};
use super::failure::{Cause, Failure};
use super::merged::{self, Detokenizer, Split};
use super::prefill::Prefilled;
use super::record::RequestRecord;
use super::relay::{Batch, Halt, Ready, Relay};
use super::reprefill;
use super::resume::{self, ChatContinuation, Next, Progress, ResumePolicy};
use super::upstream::Payload;
use crate::error::ApiError;
use crate::journal::{ChoiceProgress, JournalHandle, Phase};
use crate::membership::Instance;
use crate::pd::holds::{Hold, HoldLease};
use crate::prefix::hash::Prompt;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::output::Source;
use crate::protocols::openai::request::{RequestInfo, Route};
use crate::protocols::openai::translated_output::TranslatedOutput;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// What the next attempt sends, and how its chunks are read.
struct Planned {
    source: Source,
    path: &'static str,
    lanes: Vec<LanePlan>,
}

impl Planned {
    fn one(source: Source, path: &'static str, payload: Payload) -> Self {
        Self {
            source,
            path,
            lanes: vec![LanePlan::only(payload)],
        }
    }
}

/// Failed connects one request may go through (they are not resumes: the
/// decoders never had the request) before it fails.
pub const MAX_CONNECT_FAILURES: u32 = 8;

/// One request's decode, from the first decoder to the last token.
pub struct Session {
    deps: Arc<FlowDeps>,
    info: RequestInfo,
    body: ClientBody,
    /// The prefill's `kv_transfer_params` the next attempt pulls with
    /// (replaced by a re-prefill).
    kv_transfer_params: Value,
    /// The request's claim on its hold: renewed while the session lives,
    /// released when it ends.
    lease: Option<HoldLease>,
    relay: Relay,
    attempt: Option<Attempt>,
    policy: ResumePolicy,
    progress: Progress,
    /// Decoders that failed this request, avoided while others exist.
    failed: Vec<String>,
    epoch: u64,
    first_decoder: Option<String>,
    /// Why the relay stopped, handled by the next call (after a batch went out).
    deferred: Option<Halt>,
    error: Option<ApiError>,
    record: Option<RequestRecord>,
}

impl Session {
    /// Opens the first decoder stream; an error here is the client's HTTP error.
    pub async fn start(
        deps: Arc<FlowDeps>,
        info: RequestInfo,
        body: ClientBody,
        prefilled: Prefilled,
        journal: JournalHandle,
        translated: Option<Box<dyn TranslatedOutput>>,
    ) -> Result<Self, ApiError> {
        let blocker = resume::mid_stream_blocker(info.route, &body);
        let max_tokens = resume::requested_max_tokens(&body)
            .unwrap_or(deps.requests.max_tokens_limit)
            .max(1);
        let epoch = prefilled
            .kv_transfer_params
            .get("resume_epoch")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        let lease = Hold::from_params(&prefilled.kv_transfer_params)
            .map(|hold| deps.holds.lease(hold, epoch));
        journal.update(|e| {
            e.phase = Phase::Decode;
            e.prefill = Some(prefilled.instance.clone());
            e.kv_transfer_params = Some(prefilled.kv_transfer_params.clone());
            e.prompt_token_ids = prefilled.prompt_token_ids;
        });
        let mut relay = Relay::new(&info, journal, blocker.is_none(), max_tokens);
        relay.set_prompt_logprobs(prefilled.prompt_logprobs);
        if let Some(translated) = translated {
            relay.translate_with(translated);
        }
        let mut session = Self {
            relay,
            policy: ResumePolicy {
                max_resumes: deps.resume.max_resumes,
                max_connect_failures: MAX_CONNECT_FAILURES,
                blocker,
                structured: resume::structured_output(info.route, &body),
            },
            kv_transfer_params: prefilled.kv_transfer_params,
            lease,
            epoch,
            deps,
            info,
            body,
            attempt: None,
            progress: Progress::default(),
            failed: Vec::new(),
            first_decoder: None,
            deferred: None,
            error: None,
            record: None,
        };
        session.connect().await?;
        Ok(session)
    }

    pub fn info(&self) -> &RequestInfo {
        &self.info
    }

    /// The first decoder that served the request.
    pub fn first_decoder(&self) -> &str {
        self.first_decoder.as_deref().unwrap_or_default()
    }

    /// The prefill instance whose hold the request uses.
    pub fn prefill_instance(&self) -> String {
        self.relay
            .journal()
            .read(|e| e.prefill.clone())
            .unwrap_or_default()
    }

    /// A reader of the request's journal entry.
    pub fn journal_reader(&self) -> crate::journal::EntryReader {
        self.relay.journal().reader()
    }

    /// The request's record: the session says how the request ended.
    pub fn set_record(&mut self, record: RequestRecord) {
        self.record = Some(record);
    }

    /// Opens a stream on a decoder; after a failed connect, on the next one.
    async fn connect(&mut self) -> Result<(), ApiError> {
        loop {
            let wait = if self.progress.resumes == 0 && self.progress.connect_failures == 0 {
                Duration::ZERO
            } else {
                self.deps.resume.resume_wait
            };
            let prompt = self
                .deps
                .decode
                .wants_prompt()
                .then(|| self.relay.journal().read(|e| e.prompt_token_ids.clone()));
            let Some(decoder) = wait_for_decoder(
                &self.deps,
                &self.info.model,
                &self.failed,
                prompt
                    .as_deref()
                    .map(|ids| Prompt::new(ids, self.info.cache_root)),
                wait,
            )
            .await
            else {
                return Err(ApiError::Unavailable(format!(
                    "no decode instance is ready for model `{}`",
                    self.info.model
                )));
            };
            let planned = match self.plan(&decoder).await {
                Ok(planned) => planned,
                Err(OpenError::Failed(failure)) => {
                    self.after_failure(failure).await?;
                    continue;
                }
                Err(OpenError::Rejected(error)) => return Err(error),
            };
            let epoch = self.epoch;
            self.relay.journal().update(|e| e.epoch = epoch);
            match decode::open(
                &self.deps,
                decoder.clone(),
                planned.path,
                &self.info.request_id,
                planned.lanes,
                planned.source,
            )
            .await
            {
                Ok(attempt) => {
                    self.first_decoder.get_or_insert_with(|| decoder.id.clone());
                    self.relay.on_attempt(&decoder.id);
                    self.relay.journal().update(|e| {
                        e.phase = Phase::Decode;
                        e.decoder = Some(decoder.id.clone());
                        e.decoders.push(decoder.id.clone());
                        e.attempt += 1;
                    });
                    self.attempt = Some(attempt);
                    return Ok(());
                }
                Err(OpenError::Failed(failure)) => self.after_failure(failure).await?,
                Err(OpenError::Rejected(error)) => return Err(error),
            }
        }
    }

    /// Decides what follows `failure` and prepares it (counts the resume,
    /// re-prefills a lost hold); an error when the request cannot go on.
    async fn after_failure(&mut self, failure: Failure) -> Result<(), ApiError> {
        tracing::warn!(decoder = %failure.decoder,
            cause = failure.cause.as_str(), error = %failure.message, resumes = self.progress.resumes, "decoder failed");
        self.relay.on_failure();
        self.progress.generated = self.relay.journal().read(|e| e.generated());
        if !self.failed.contains(&failure.decoder) {
            self.failed.push(failure.decoder.clone());
        }
        match resume::decide(&failure, self.progress, self.policy) {
            Next::Fail(message) => Err(ApiError::Unavailable(message)),
            Next::Reconnect => {
                self.progress.connect_failures += 1;
                Ok(())
            }
            Next::FailOver | Next::Resume => {
                self.progress.resumes += 1;
                self.epoch += 1;
                if let Some(lease) = &self.lease {
                    lease.set_epoch(self.epoch);
                }
                let cause = failure.cause.as_str();
                crate::observe::metrics::resume(cause, &self.info.model);
                let resumes = self.progress.resumes;
                self.relay.journal().update(|e| {
                    e.resumes = resumes;
                    e.causes.push(cause);
                });
                self.ensure_hold().await
            }
        }
    }

    /// Re-prefills when the hold is gone (the re-prefill phase decides).
    async fn ensure_hold(&mut self) -> Result<(), ApiError> {
        let hold = self.lease.as_ref().map(HoldLease::hold);
        let Some(prefilled) = reprefill::ensure_hold(
            &self.deps,
            &self.info,
            &self.body,
            hold,
            self.relay.journal(),
        )
        .await?
        else {
            return Ok(());
        };
        // Dropping the old lease releases the old hold.
        self.lease = Hold::from_params(&prefilled.kv_transfer_params)
            .map(|hold| self.deps.holds.lease(hold, self.epoch));
        self.kv_transfer_params = prefilled.kv_transfer_params;
        Ok(())
    }

    /// What the next attempt sends `decoder`: the client's own body before
    /// the first token; after it, the continuation: a completions request on
    /// prompt + generated ids, or for a chat, the engine's tokens API
    /// (`derender.rs`), which keeps reasoning and tool calls what they are.
    /// A request of several choices continues each unfinished one as its own
    /// sequence (one lane each, see [`super::attempt::Lane`]).
    async fn plan(&mut self, decoder: &Arc<Instance>) -> Result<Planned, OpenError> {
        let kv = resume::with_epoch(&self.kv_transfer_params, self.epoch);
        let journal = self.relay.journal();
        if journal.read(|e| e.generated()) == 0 {
            let body = decode::decode_body(&self.body, &kv);
            return Ok(Planned::one(Source::Native, self.info.route.path(), body));
        }
        let (prompt, choices) = journal.read(|e| (e.prompt_token_ids.clone(), e.choices.clone()));
        let several = choices.len() > 1;
        // Several choices continue from one hold: the first to finish must
        // not release it under the others (the router releases it at the end).
        let kv = if several {
            resume::keeping_hold(&kv)
        } else {
            kv
        };
        let open: Vec<(usize, ChoiceProgress)> = choices
            .into_iter()
            .enumerate()
            .filter(|(_, c)| c.finish_reason.is_none())
            .collect();
        let completions = || Planned {
            source: Source::Resumed,
            path: Route::Completions.path(),
            lanes: open
                .iter()
                .map(|(index, choice)| LanePlan {
                    choice: several.then_some(*index),
                    payload: resume::resume_body(
                        self.info.route,
                        &self.body,
                        &prompt,
                        &choice.token_ids,
                        &kv,
                    ),
                    derender: None,
                })
                .collect(),
        };
        if self.info.route != Route::Chat {
            return Ok(completions());
        }
        let blocked = |message: String| OpenError::Rejected(ApiError::Unavailable(message));
        let parsed_output = open.iter().any(|(_, c)| c.parsed_output);
        if resume::chat_continuation(&self.body) == ChatContinuation::Completions {
            if parsed_output {
                return Err(blocked(
                    "a chat asking logprobs whose answer has reasoning or tool calls cannot be resumed after its first token".into(),
                ));
            }
            return Ok(completions());
        }
        let upstream = self.deps.upstream.as_ref();
        let request_id = &self.info.request_id;
        let rendered = match derender::render(
            upstream,
            &decoder.id,
            &decoder.url,
            request_id,
            derender::render_body(&self.body),
        )
        .await
        {
            Ok(rendered) => rendered,
            Err(RenderError::Failed(failure)) => return Err(OpenError::Failed(failure)),
            Err(RenderError::Call(error)) => {
                return Err(OpenError::Failed(decode::call_failure(
                    &self.deps, decoder, error,
                )))
            }
            Err(RenderError::Unsupported(message)) => {
                if parsed_output || crate::protocols::openai::request::offers_tools(&self.body) {
                    return Err(blocked(format!(
                        "{message}; a chat with tools, or whose answer has reasoning, cannot be resumed after its first token without it"
                    )));
                }
                tracing::warn!(decoder = %decoder.id, "{message}: the chat continues through /v1/completions");
                return Ok(completions());
            }
        };
        let target = DerenderTarget {
            upstream: self.deps.upstream.clone(),
            decoder: decoder.id.clone(),
            url: decoder.url.clone(),
            request_id: request_id.clone(),
            model: self.info.model.clone(),
            timeout: self.deps.engines.stall_timeout,
        };
        let mut lanes = Vec::with_capacity(open.len());
        for (index, choice) in &open {
            let payload =
                derender::generate_body(&rendered, &self.body, &prompt, &choice.token_ids, &kv)
                    .map_err(|message| {
                        OpenError::Failed(Failure::new(&decoder.id, Cause::Protocol, message))
                    })?;
            let derender = Derender::start(target.clone(), &self.body, &prompt, choice)
                .await
                .map_err(OpenError::Failed)?;
            lanes.push(LanePlan {
                choice: several.then_some(*index),
                payload: payload.into(),
                derender: Some(derender),
            });
        }
        Ok(Planned {
            source: Source::Derendered,
            path: derender::GENERATE_PATH,
            lanes,
        })
    }

    /// The next bytes for a streaming client; `None` at the end. A non-stream
    /// client's session runs through here too, collecting.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if let Some(bytes) = self.relay.pop() {
                return Some(bytes);
            }
            let stop = match self.deferred.take() {
                Some(stop) => stop,
                None => {
                    let attempt = self.attempt.as_mut()?;
                    match self.relay.next(attempt).await {
                        Some(stop) => stop,
                        None => continue,
                    }
                }
            };
            self.on_halt(stop).await;
        }
    }

    /// The next bytes for a streaming client together with all that the decoder
    /// has already sent: one write to the client per burst instead of one per
    /// token (each write to a socket costs far more than relaying a chunk).
    async fn next_batch(&mut self) -> Option<Bytes> {
        let mut batch = Batch::new(self.next_bytes().await?);
        while !batch.is_full() {
            while let Some(bytes) = self.relay.pop() {
                batch.push(bytes);
            }
            if self.deferred.is_some() || batch.is_full() {
                break;
            }
            let Some(attempt) = self.attempt.as_mut() else {
                break;
            };
            match self.relay.take_ready(attempt).await {
                Ready::Nothing => break,
                Ready::Taken => {}
                // The end, or a failure: handled (with its async work) by the
                // next call, after this batch went out.
                Ready::Halted(halt) => self.deferred = Some(halt),
            }
        }
        Some(batch.finish())
    }

    async fn on_halt(&mut self, halt: Halt) {
        match halt {
            Halt::Ended(failure) => self.on_end(failure).await,
            Halt::Failed(failure) => self.recover(failure).await,
            Halt::Refused(error) => self.end_with_error(error),
            Halt::Split(split) => self.cut_merged(split).await,
        }
    }

    /// A stop string ended inside a chunk of several tokens: relays it with
    /// the tokens an engine checking each token would have kept (all of them
    /// when the decoder's tokenizer cannot say in time).
    async fn cut_merged(&mut self, split: Split) {
        // A split comes from the attempt in use: only a later stop could have
        // ended it, and stops are handled one at a time, in order.
        let Some(attempt) = self.attempt.as_mut() else {
            return;
        };
        let (prompt, output) = self.relay.journal().read(|e| {
            let output = e.choices.get(split.index).map(|c| c.token_ids.clone());
            (e.prompt_token_ids.clone(), output.unwrap_or_default())
        });
        let detokenizer = Detokenizer {
            upstream: self.deps.upstream.as_ref(),
            url: &attempt.decoder().url,
            model: &self.info.model,
            timeout: self.deps.routing.tokenize_timeout,
        };
        let keep = detokenizer.tokens_through(&prompt, &output, &split).await;
        let cut = match keep {
            Some(keep) if keep < split.ids.len() => {
                merged::keep_tokens(&split.data, keep, split.through)
            }
            Some(_) => None,
            None => {
                tracing::warn!(
                    decoder = %attempt.decoder().id,
                    "no /detokenize answer: the chunk that ends on a stop string keeps all its tokens"
                );
                None
            }
        };
        let data = cut.unwrap_or(split.data);
        if let Some(stop) = self.relay.take_cut(attempt, &data) {
            self.deferred = Some(stop);
        }
    }

    /// The decoder's stream ended, cleanly (`failure` None) or not.
    async fn on_end(&mut self, failure: Option<Failure>) {
        if self.relay.journal().read(|e| e.all_finished()) {
            // Every choice has its finish_reason: a connection lost after the last
            // token costs the client nothing.
            return self.finish().await;
        }
        let failure = failure.unwrap_or_else(|| {
            let decoder = self
                .attempt
                .as_ref()
                .map(|a| a.decoder().id.clone())
                .unwrap_or_default();
            Failure::new(
                &decoder,
                Cause::Truncated,
                format!("decoder {decoder} ended the stream before finishing"),
            )
        });
        self.recover(failure).await;
    }

    /// Moves the request to another decoder after `failure`, or ends it with an
    /// error when it cannot be moved.
    async fn recover(&mut self, failure: Failure) {
        let span = tracing::info_span!(
            "resume",
            cause = failure.cause.as_str(),
            from = %failure.decoder
        );
        self.recover_in(failure).instrument(span).await;
    }

    /// [`Session::recover`], inside its `resume` span.
    async fn recover_in(&mut self, failure: Failure) {
        // Dropping the attempt closes its connection: the engine aborts its copy.
        let decoder = self.attempt.take().map(|a| a.decoder().clone());
        if let (Cause::Reset, Some(decoder)) = (failure.cause, decoder) {
            // Evidence that the decoder's process is gone: its streams broke
            // together and none is left. New requests skip it at once.
            if self.deps.outliers.stream_broke(&decoder.id) && decoder.inflight() == 0 {
                tracing::warn!(decoder = %decoder.id, "every stream of the decoder broke: declared dead");
                self.deps.registry.mark_dead(&decoder.id);
            }
        }
        let result = match self.after_failure(failure).await {
            Ok(()) => self.connect().await,
            Err(error) => Err(error),
        };
        if let Err(error) = result {
            if self.progress.resumes > 0 {
                crate::observe::metrics::failed_after_resume(&self.info.model);
            }
            self.end_with_error(error);
        }
    }

    async fn finish(&mut self) {
        // The end of a response the decoder finished is read apart from the
        // client's (which is not kept waiting for it), for its connection. An
        // attempt cut by the router (a stop string) is dropped: closing its
        // connection aborts the engine's request.
        if let Some(attempt) = self.attempt.take().filter(Attempt::saw_done) {
            self.deps.drains.spawn(attempt.into_drain());
        }
        if let Some(keeping) = self.relay.finish() {
            keeping.await;
        }
        self.relay.finish_last();
        self.relay.journal().set_phase(Phase::Finished);
        if let Some(record) = &mut self.record {
            record.finish(200);
        }
    }

    fn end_with_error(&mut self, error: ApiError) {
        self.attempt = None;
        tracing::warn!(%error, "request failed");
        self.relay.fail(&error);
        self.relay.journal().set_phase(Phase::Failed);
        if let Some(record) = &mut self.record {
            record.finish(error.status().as_u16());
        }
        self.error = Some(error);
    }

    /// A streaming response that relays batch by batch.
    pub fn into_sse_response(self) -> Response {
        // The body is polled by the connection's task, outside the handler:
        // each poll enters the request's span (entered, not cloned per batch:
        // a clone and its drop are two more lookups in the span registry).
        let body = futures_util::stream::unfold(self, |mut session| async move {
            session
                .next_batch()
                .await
                .map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), session))
        });
        let body = InSpan {
            stream: Box::pin(body),
            span: tracing::Span::current(),
        };
        (
            [
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
            ],
            Body::from_stream(body),
        )
            .into_response()
    }

    /// Runs the session to its end: the one response of a non-stream client.
    /// With the resumes it needed.
    pub async fn collect(mut self) -> Result<(Value, u32), ApiError> {
        while self.next_bytes().await.is_some() {}
        match self.error.take() {
            Some(error) => Err(error),
            None => Ok((self.relay.response(), self.progress.resumes)),
        }
    }
}

/// A stream polled inside `span`, entered on every poll.
struct InSpan<S> {
    stream: std::pin::Pin<Box<S>>,
    span: tracing::Span,
}

impl<S: futures_util::Stream> futures_util::Stream for InSpan<S> {
    type Item = S::Item;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        // Both fields are Unpin (a boxed stream, a span handle).
        let this = self.get_mut();
        let _entered = this.span.enter();
        this.stream.as_mut().poll_next(cx)
    }
}

/// A decoder for the next attempt, waiting up to `wait` when none is eligible
/// right now (a restarted decoder re-registers within a heartbeat).
async fn wait_for_decoder(
    deps: &FlowDeps,
    model: &str,
    failed: &[String],
    prompt: Option<Prompt<'_>>,
    wait: Duration,
) -> Option<Arc<Instance>> {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(decoder) = decode::choose(deps, model, failed, prompt) {
            return Some(decoder);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
