//! One decoder's stream for a request (an attempt), and every way it can fail.
//!
//! An attempt yields the data of each SSE event the decoder sends, and turns the
//! failures that request resume acts on into a [`Failure`] with its [`Cause`]: the
//! stream erroring or closing early, no event within the stall timeout, or the
//! decoder being declared dead or migrated away from while the stream waits.
//! Dropping an attempt closes the connection, which aborts the engine's request.

use super::output::Source;
use crate::registry::{Instance, Lifecycle, LoadGuard};
use crate::sse::{self, SseParser};
use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Why a decoder failed a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Connection refused, reset or timed out before the response started.
    Connect,
    /// The response body failed mid-stream (reset, broken chunking).
    Reset,
    /// The stream ended without a finish_reason for every choice.
    Truncated,
    /// No event within the stall timeout.
    Stall,
    /// A 5xx status, or an error event with a 5xx code.
    ServerError,
    /// The registry declared the decoder dead (heartbeat TTL).
    Dead,
    /// `drain?migrate=true` on the decoder.
    Migrate,
}

impl Cause {
    /// The `cause` label of `connex_resumes_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Connect => "connect",
            Cause::Reset => "reset",
            Cause::Truncated => "truncated",
            Cause::Stall => "stall",
            Cause::ServerError => "5xx",
            Cause::Dead => "dead",
            Cause::Migrate => "migrate",
        }
    }
}

/// A decoder failure: which decoder, why, and what it said.
#[derive(Debug, Clone)]
pub struct Failure {
    pub decoder: String,
    pub cause: Cause,
    pub message: String,
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

/// A decoder's open stream.
pub struct Attempt {
    pub source: Source,
    guard: LoadGuard,
    upstream: BoxStream<'static, reqwest::Result<Bytes>>,
    parser: SseParser,
    pending: VecDeque<Bytes>,
    lifecycle: watch::Receiver<Lifecycle>,
    stall: Duration,
}

impl Attempt {
    pub fn new(
        response: reqwest::Response,
        guard: LoadGuard,
        source: Source,
        stall: Duration,
    ) -> Self {
        let lifecycle = guard.instance().subscribe();
        Self {
            source,
            upstream: response.bytes_stream().boxed(),
            guard,
            parser: SseParser::default(),
            pending: VecDeque::new(),
            lifecycle,
            stall,
        }
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

    /// The next event of the stream, or why there is none.
    pub async fn next(&mut self) -> Event {
        loop {
            if let Some(data) = self.pending.pop_front() {
                return if data == sse::DONE {
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
                read = tokio::time::timeout(self.stall, self.upstream.next()) => Ok(read),
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
                Err(_) => {
                    let message = format!(
                        "decoder {} sent nothing for {} ms",
                        self.decoder().id,
                        self.stall.as_millis()
                    );
                    return self.failure(Cause::Stall, message);
                }
                Ok(Some(Ok(bytes))) => self.pending.extend(self.parser.push(&bytes)),
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
