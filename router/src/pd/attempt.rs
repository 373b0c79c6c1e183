//! One decoder's stream for a request (an attempt), and every way it can fail.
//!
//! An attempt yields the data of each SSE event the decoder sends, and turns the
//! failures that request resume acts on into a [`Failure`] with its [`Cause`]: the
//! stream erroring or closing early, no first token within the first-token
//! timeout, no event within the stall timeout after it, an event larger than the
//! router reads, or the decoder being declared dead or migrated away from while
//! the stream waits. Dropping an attempt closes the connection, which aborts the
//! engine's request.

use super::output::Source;
use super::upstream::ByteStream;
use crate::policy::outlier::DeliveryClock;
use crate::registry::{Instance, Lifecycle, LoadGuard};
use crate::sse::{self, SseParser};
use bytes::Bytes;
use futures_util::StreamExt;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Why a decoder failed a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// No connection to the decoder: it never saw the request (not a resume).
    Connect,
    /// Connected, but no response headers within the decode-open timeout.
    NoHeaders,
    /// The response body failed mid-stream (reset, broken chunking).
    Reset,
    /// The stream ended without a finish_reason for every choice.
    Truncated,
    /// No first token within the first-token timeout.
    FirstToken,
    /// No event within the stall timeout after the first token.
    Stall,
    /// A 5xx status, or an error event with a 5xx code.
    ServerError,
    /// The decoder sent what the protocol does not allow: invalid JSON, a choice
    /// the request does not have, token ids that are not integers, an event
    /// larger than the router reads, more tokens than asked for.
    Protocol,
    /// The registry declared the decoder dead (heartbeat TTL, probes).
    Dead,
    /// `drain?migrate=true` on the decoder.
    Migrate,
}

impl Cause {
    /// Every cause, for the tests that go through them all.
    pub const ALL: [Cause; 10] = [
        Cause::Connect,
        Cause::NoHeaders,
        Cause::Reset,
        Cause::Truncated,
        Cause::FirstToken,
        Cause::Stall,
        Cause::ServerError,
        Cause::Protocol,
        Cause::Dead,
        Cause::Migrate,
    ];

    /// The `cause` label of `connex_resumes_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Connect => "connect",
            Cause::NoHeaders => "no_headers",
            Cause::Reset => "reset",
            Cause::Truncated => "truncated",
            Cause::FirstToken => "first_token",
            Cause::Stall => "stall",
            Cause::ServerError => "5xx",
            Cause::Protocol => "protocol",
            Cause::Dead => "dead",
            Cause::Migrate => "migrate",
        }
    }

    /// Whether the decoder had the request (it may have generated tokens):
    /// every cause but a failed connect.
    pub fn reached_decoder(self) -> bool {
        self != Cause::Connect
    }
}

/// A decoder failure: which decoder, why, and what it said.
#[derive(Debug, Clone)]
pub struct Failure {
    pub decoder: String,
    pub cause: Cause,
    pub message: String,
}

impl Failure {
    pub fn new(decoder: &str, cause: Cause, message: impl Into<String>) -> Self {
        Self {
            decoder: decoder.to_string(),
            cause,
            message: message.into(),
        }
    }
}

/// What an attempt yields next.
#[derive(Debug)]
pub enum Event {
    /// The data of one event (a JSON chunk).
    Data(Bytes),
    /// `[DONE]`.
    Done,
    Failed(Failure),
}

/// The time and size limits of a decoder's stream.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// From opening to the first token (a KV pull or an engine queue comes first).
    pub first_token: Duration,
    /// Between events after the first token.
    pub stall: Duration,
    /// Largest SSE event.
    pub max_event: usize,
}

/// Longest wait, after `[DONE]`, for the rest of the decoder's response (the
/// chunked body's terminator), which gives its connection back to the pool.
/// The terminator comes with `[DONE]` or right after it; an engine that
/// delays it costs a new connection, not a stuck request.
pub const DRAIN_WAIT: Duration = Duration::from_millis(20);
/// Most bytes read after `[DONE]` while draining (the terminator is 5 bytes).
pub const DRAIN_BYTES: usize = 4 * 1024;

/// A decoder's open stream.
pub struct Attempt {
    pub source: Source,
    guard: LoadGuard,
    upstream: ByteStream,
    parser: SseParser,
    pending: VecDeque<Bytes>,
    lifecycle: watch::Receiver<Lifecycle>,
    limits: StreamLimits,
    /// When the stream fails for want of an event: measured from the last
    /// complete event, not the last byte, so that an engine trickling bytes
    /// cannot hold a request.
    deadline: Instant,
    delivering: bool,
    /// The decoder sent `[DONE]`: it ended the request, and the rest of the
    /// response can be read so that the connection is kept.
    done: bool,
    clock: DeliveryClock,
    /// The attempt's `decode` trace span: it ends when the attempt does.
    span: tracing::Span,
}

impl Attempt {
    pub fn new(
        upstream: ByteStream,
        guard: LoadGuard,
        source: Source,
        limits: StreamLimits,
        clock: DeliveryClock,
    ) -> Self {
        let lifecycle = guard.instance().subscribe();
        Self {
            source,
            upstream,
            guard,
            parser: SseParser::default(),
            pending: VecDeque::new(),
            lifecycle,
            deadline: Instant::now() + limits.first_token,
            limits,
            delivering: false,
            done: false,
            clock,
            span: tracing::Span::none(),
        }
    }

    /// The attempt's trace span, kept as long as the attempt lives.
    pub fn in_span(mut self, span: tracing::Span) -> Self {
        self.span = span;
        self
    }

    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    pub fn decoder(&self) -> &Arc<Instance> {
        self.guard.instance()
    }

    fn failure(&self, cause: Cause, message: String) -> Event {
        Event::Failed(Failure {
            decoder: self.decoder().id.clone(),
            cause,
            message,
        })
    }

    /// The relay saw tokens from this stream: the stall timeout applies from
    /// now on, and the decoder counts as delivering.
    pub fn saw_tokens(&mut self) {
        if !self.delivering {
            self.deadline = Instant::now() + self.limits.stall;
        }
        self.delivering = true;
        self.clock.tick();
    }

    /// Whether the decoder sent `[DONE]`.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// Ends a finished attempt (the decoder sent `[DONE]`): its load on the
    /// decoder and its span end now; what is left of the response (the
    /// chunked body's end) is read by the returned future, within
    /// [`DRAIN_WAIT`] and [`DRAIN_BYTES`], so that the connection goes back
    /// to the pool instead of being closed and the next request to this
    /// decoder costs no TCP connect. Bytes past the bound, a slow end or a
    /// failure just close the connection, as dropping the attempt would.
    pub fn into_drain(self) -> impl std::future::Future<Output = ()> + Send + 'static {
        // The other fields (the load guard, the span) drop here.
        let Self { mut upstream, .. } = self;
        async move {
            let mut left = DRAIN_BYTES;
            let read_to_end = async {
                while let Some(Ok(bytes)) = upstream.next().await {
                    match left.checked_sub(bytes.len()) {
                        Some(rest) => left = rest,
                        None => break,
                    }
                }
            };
            let _ = tokio::time::timeout(DRAIN_WAIT, read_to_end).await;
        }
    }

    /// The next event of the stream, or why there is none.
    pub async fn next(&mut self) -> Event {
        loop {
            if let Some(data) = self.pending.pop_front() {
                if self.delivering {
                    self.deadline = Instant::now() + self.limits.stall;
                }
                return if data == sse::DONE {
                    self.done = true;
                    Event::Done
                } else {
                    Event::Data(data)
                };
            }
            let read = tokio::select! {
                biased;
                changed = self.lifecycle.wait_for(|l| matches!(l, Lifecycle::Dead | Lifecycle::Migrating)) => {
                    Err(match changed.as_deref() {
                        Ok(Lifecycle::Migrating) => Cause::Migrate,
                        _ => Cause::Dead,
                    })
                }
                read = tokio::time::timeout_at(self.deadline, self.upstream.next()) => Ok(read),
            };
            let read = match read {
                Ok(read) => read,
                Err(cause) => {
                    let what = if cause == Cause::Migrate {
                        "being migrated away from"
                    } else {
                        "dead"
                    };
                    let message = format!("decoder {} is {what}", self.decoder().id);
                    return self.failure(cause, message);
                }
            };
            match read {
                Err(_) if self.delivering => {
                    let message = format!(
                        "decoder {} sent nothing for {} ms",
                        self.decoder().id,
                        self.limits.stall.as_millis()
                    );
                    return self.failure(Cause::Stall, message);
                }
                Err(_) => {
                    let message = format!(
                        "decoder {} sent no token within {} ms",
                        self.decoder().id,
                        self.limits.first_token.as_millis()
                    );
                    return self.failure(Cause::FirstToken, message);
                }
                Ok(Some(Ok(bytes))) => {
                    self.pending.extend(self.parser.push(bytes));
                    if self.parser.pending() > self.limits.max_event {
                        let message = format!(
                            "decoder {} sent an event larger than {} bytes",
                            self.decoder().id,
                            self.limits.max_event
                        );
                        return self.failure(Cause::Protocol, message);
                    }
                }
                Ok(Some(Err(err))) => {
                    let message = format!("decoder {} stream failed: {err}", self.decoder().id);
                    return self.failure(Cause::Reset, message);
                }
                Ok(None) => {
                    let message = format!("decoder {} closed the stream early", self.decoder().id);
                    return self.failure(Cause::Truncated, message);
                }
            }
        }
    }
}
