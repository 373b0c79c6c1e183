//! One decoder's stream for a request (an attempt), and every way it can fail.
//!
//! An attempt yields the data of each SSE event the decoder sends, and turns the
//! failures that request resume acts on into a `Failure` with its `Cause`: the
//! stream erroring or closing early, no first token within the first-token
//! timeout, no event within the stall timeout after it, an event larger than the
//! router reads, or the decoder being declared dead or migrated away from while
//! the stream waits. Dropping an attempt closes the connection, which aborts the
//! engine's request.

use super::derender::{self, Derender};
use super::failure::{Cause, Failure};
use super::upstream::ByteStream;
use crate::config::EngineArgs;
use crate::membership::{Instance, Lifecycle, LoadGuard};
use crate::policy::outlier::DeliveryClock;
use crate::protocols::openai::output::Source;
use crate::protocols::sse::{self, SseParser};
use bytes::Bytes;
use futures_util::StreamExt;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// What an attempt yields next (the relay takes each; distinct from a
/// translated protocol's `ClientEvent`).
#[derive(Debug)]
pub enum AttemptItem {
    /// The data of one event (a JSON chunk).
    Data(Bytes),
    /// `[DONE]`.
    Done,
    Failed(Failure),
}

/// Longest wait, after `[DONE]`, for the rest of the decoder's response (the
/// chunked body's terminator), which gives its connection back to the pool.
/// The terminator comes with `[DONE]` or right after it; an engine that
/// delays it costs a new connection, not a stuck request.
pub const DRAIN_WAIT: Duration = Duration::from_millis(20);
/// Most bytes read after `[DONE]` while draining (the terminator is 5 bytes).
pub const DRAIN_BYTES: usize = 4 * 1024;

/// One response stream of an attempt. An attempt has one, except a resumed
/// request of several choices: one lane per unfinished choice, each its own
/// one-sequence request on the decoder.
pub struct Lane {
    upstream: ByteStream,
    parser: SseParser,
    pending: VecDeque<Bytes>,
    /// The choice whose chunks this lane brings, when their `index` must be
    /// set to it (the lane's request has one choice, index 0).
    choice: Option<usize>,
    /// A chat continuation's derenderer: the lane's token chunks become chat
    /// chunks through it (`derender.rs`).
    derender: Option<Derender>,
    /// The lane sent `[DONE]`.
    done: bool,
}

impl Lane {
    pub fn new(upstream: ByteStream, choice: Option<usize>, derender: Option<Derender>) -> Self {
        Self {
            upstream,
            parser: SseParser::default(),
            pending: VecDeque::new(),
            choice,
            derender,
            done: false,
        }
    }
}

/// A decoder's open stream.
pub struct Attempt {
    pub source: Source,
    guard: LoadGuard,
    lanes: Vec<Lane>,
    /// The lane whose chunk is being derendered.
    derendering: Option<usize>,
    lifecycle: watch::Receiver<Lifecycle>,
    /// Its time and size limits (`--first-token-timeout`, `--stall-timeout`,
    /// `--max-sse-event-bytes`).
    limits: EngineArgs,
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
    /// An attempt of several lanes (see [`Lane`]).
    pub fn of_lanes(
        lanes: Vec<Lane>,
        guard: LoadGuard,
        source: Source,
        limits: EngineArgs,
        clock: DeliveryClock,
    ) -> Self {
        let lifecycle = guard.instance().subscribe();
        Self {
            source,
            lanes,
            derendering: None,
            guard,
            lifecycle,
            deadline: Instant::now() + limits.first_token_timeout,
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

    pub fn decoder(&self) -> &Arc<Instance> {
        self.guard.instance()
    }

    fn failed(&self, cause: Cause, message: String) -> LaneItem {
        LaneItem::Failed(Failure {
            decoder: self.decoder().id.clone(),
            cause,
            message,
        })
    }

    /// The relay saw tokens from this stream: the stall timeout applies from
    /// now on, and the decoder counts as delivering.
    pub fn saw_tokens(&mut self) {
        if !self.delivering {
            self.deadline = Instant::now() + self.limits.stall_timeout;
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
        // The other fields (the load guard, the span) drop here. A response
        // of several lanes is closed, not drained (a resume's rarity).
        let Self { mut lanes, .. } = self;
        let mut upstream = match (lanes.len(), lanes.pop()) {
            (1, Some(lane)) => Some(lane.upstream),
            _ => None,
        };
        async move {
            let Some(upstream) = upstream.as_mut() else {
                return;
            };
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

    /// The next event of the stream, or why there is none. Cancel-safe: a
    /// chunk being derendered when the caller stops polling comes with the
    /// next call.
    pub async fn next(&mut self) -> AttemptItem {
        loop {
            if let Some(at) = self.derendering {
                let finished = match self.lanes.get_mut(at).and_then(|l| l.derender.as_mut()) {
                    Some(derender) => derender.finish().await,
                    None => None,
                };
                self.derendering = None;
                match finished {
                    Some(Ok(chunk)) => return AttemptItem::Data(self.of_lane(at, chunk)),
                    Some(Err(failure)) => return AttemptItem::Failed(failure),
                    None => continue,
                }
            }
            let (at, data) = match self.next_raw().await {
                LaneItem::Data(at, data) => (at, data),
                LaneItem::Done => return AttemptItem::Done,
                LaneItem::Failed(failure) => return AttemptItem::Failed(failure),
            };
            match self.lanes.get_mut(at).and_then(|l| l.derender.as_mut()) {
                Some(derender) if derender::needs_derender(&data) => {
                    derender.start_chunk(&data);
                    self.derendering = Some(at);
                }
                Some(_) => {
                    return AttemptItem::Data(self.of_lane(at, derender::passed_through(data)))
                }
                None => return AttemptItem::Data(self.of_lane(at, data)),
            }
        }
    }

    /// A chunk of lane `at` with its choice's index, when the lane has one.
    fn of_lane(&self, at: usize, data: Bytes) -> Bytes {
        match self.lanes.get(at).and_then(|l| l.choice) {
            Some(choice) => with_choice_index(&data, choice),
            None => data,
        }
    }

    /// The next event of the decoder's own streams: a lane's data, or the
    /// end (every lane sent `[DONE]`), or why there is none.
    async fn next_raw(&mut self) -> LaneItem {
        loop {
            let ready = self
                .lanes
                .iter_mut()
                .enumerate()
                .find_map(|(at, lane)| lane.pending.pop_front().map(|data| (at, data)));
            if let Some((at, data)) = ready {
                if self.delivering {
                    self.deadline = Instant::now() + self.limits.stall_timeout;
                }
                if data == sse::DONE {
                    self.lanes[at].done = true;
                    if self.lanes.iter().all(|l| l.done) {
                        self.done = true;
                        return LaneItem::Done;
                    }
                    continue;
                }
                return LaneItem::Data(at, data);
            }
            let read = tokio::select! {
                biased;
                changed = self.lifecycle.wait_for(|l| matches!(l, Lifecycle::Dead | Lifecycle::Migrating)) => {
                    Err(match changed.as_deref() {
                        Ok(Lifecycle::Migrating) => Cause::Migrate,
                        _ => Cause::Dead,
                    })
                }
                read = tokio::time::timeout_at(self.deadline, read_any(&mut self.lanes)) => Ok(read),
            };
            let (at, read) = match read {
                Ok(Ok((at, read))) => (at, Ok(read)),
                Ok(Err(elapsed)) => (0, Err(elapsed)),
                Err(cause) => {
                    let what = if cause == Cause::Migrate {
                        "being migrated away from"
                    } else {
                        "dead"
                    };
                    let message = format!("decoder {} is {what}", self.decoder().id);
                    return self.failed(cause, message);
                }
            };
            match read {
                Err(_) if self.delivering => {
                    let message = format!(
                        "decoder {} sent nothing for {} ms",
                        self.decoder().id,
                        self.limits.stall_timeout.as_millis()
                    );
                    return self.failed(Cause::Stall, message);
                }
                Err(_) => {
                    let message = format!(
                        "decoder {} sent no token within {} ms",
                        self.decoder().id,
                        self.limits.first_token_timeout.as_millis()
                    );
                    return self.failed(Cause::FirstToken, message);
                }
                Ok(Some(Ok(bytes))) => {
                    let lane = &mut self.lanes[at];
                    lane.pending.extend(lane.parser.push(bytes));
                    if lane.parser.pending() > self.limits.max_sse_event_bytes {
                        let message = format!(
                            "decoder {} sent an event larger than {} bytes",
                            self.decoder().id,
                            self.limits.max_sse_event_bytes
                        );
                        return self.failed(Cause::Protocol, message);
                    }
                }
                Ok(Some(Err(err))) => {
                    let message = format!("decoder {} stream failed: {err}", self.decoder().id);
                    return self.failed(Cause::Reset, message);
                }
                Ok(None) => {
                    let message = format!("decoder {} closed the stream early", self.decoder().id);
                    return self.failed(Cause::Truncated, message);
                }
            }
        }
    }
}

/// What the decoder's own streams give (before derendering).
enum LaneItem {
    /// An event's data, of lane `.0`.
    Data(usize, Bytes),
    /// Every lane sent `[DONE]`.
    Done,
    Failed(Failure),
}

/// The next bytes of any lane still streaming: which, and what. One lane
/// (every request but a resume of several choices) is read directly.
async fn read_any(lanes: &mut [Lane]) -> (usize, Option<Result<Bytes, String>>) {
    if let [lane] = lanes {
        return (0, lane.upstream.next().await);
    }
    let reads: Vec<_> = lanes
        .iter_mut()
        .enumerate()
        .filter(|(_, lane)| !lane.done)
        .map(|(at, lane)| Box::pin(async move { (at, lane.upstream.next().await) }))
        .collect();
    if reads.is_empty() {
        return std::future::pending().await;
    }
    futures_util::future::select_all(reads).await.0
}

/// `data` (a chunk of a one-choice request) with its choices' `index` set
/// to `choice`.
fn with_choice_index(data: &[u8], choice: usize) -> Bytes {
    let Ok(mut chunk) = serde_json::from_slice::<serde_json::Value>(data) else {
        return Bytes::copy_from_slice(data);
    };
    if let Some(choices) = chunk
        .get_mut("choices")
        .and_then(serde_json::Value::as_array_mut)
    {
        for entry in choices {
            entry["index"] = serde_json::json!(choice);
        }
    }
    serde_json::to_vec(&chunk).map_or_else(|_| Bytes::copy_from_slice(data), Bytes::from)
}
