//! Relay: from a decoder's events to the client's bytes.
//!
//! Each chunk is checked before anything of it is relayed (a chunk the protocol
//! does not allow is a decoder failure, never the client's), written to the
//! journal (the one record of what the client has), and formatted by the
//! client's [`Output`]. Chunks whose token ids came without their text are
//! withheld until the chunk that brings it. Relaying batches: what the decoder
//! already sent goes out in one write. Token timing (TTFT, inter-token gaps,
//! resume latency) is measured here, where tokens pass.

use super::attempt::{Attempt, AttemptItem};
use super::failure::{Cause, Failure};
use super::merged::Split;
use crate::error::ApiError;
use crate::journal::{Entry, JournalHandle};
use crate::protocols::openai::chunk::{self, ErrorEvent};
use crate::protocols::openai::output::{Output, Source};
use crate::protocols::openai::request::RequestInfo;
use crate::protocols::openai::stops::Matcher;
use crate::protocols::openai::translated_output::TranslatedOutput;
use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use std::collections::VecDeque;
use std::time::Instant;

/// Why the relay stopped taking events from a decoder.
#[derive(Debug)]
pub enum Halt {
    /// The stream ended: cleanly (`None`, `[DONE]`) or not.
    Ended(Option<Failure>),
    /// A chunk said the decoder failed, or broke the protocol.
    Failed(Failure),
    /// The engine refused the request itself (an error event with a 4xx code).
    Refused(ApiError),
    /// A stop string ends inside this chunk of several tokens: which of them
    /// to keep is asked of the decoder first ([`super::merged`]), then the
    /// cut chunk goes to [`Relay::take_cut`].
    Split(Split),
}

/// Most events gathered into one write to a streaming client, and the size
/// past which a batch goes out anyway.
pub const BATCH_EVENTS: usize = 64;
pub const BATCH_BYTES: usize = 64 * 1024;
/// Scheduler turns a batch waits for the next chunk the decoder already sent
/// (measured: one turn almost never suffices, four almost always do; a chunk
/// not yet sent costs these few turns, microseconds).
const HANDOFF_TURNS: usize = 4;
/// Most chunks withheld for their text. A character is at most 4 bytes, so an
/// engine withholds at most a few tokens; past this bound the chunks are relayed
/// as they are (the bound on memory matters more than the split character).
pub const MAX_WITHHELD: usize = 16;
/// Bytes of events a decoder may send per token it sent (plus
/// [`FREE_TOKENS`] of slack: the role chunk, the finish, a tool call's
/// flushed arguments): a token's chunk with its text, 20 alternatives'
/// logprobs and a tool call's markup is a few KiB. A decoder that sends text
/// without tokens past it has failed (cause `protocol`): what it relays is
/// bounded by the tokens asked for, and so is the journal's text.
pub const EVENT_BYTES_PER_TOKEN: usize = 16 * 1024;
pub const FREE_TOKENS: usize = 8;
/// Bytes a decoder may send, per choice, for each token id of its prompt:
/// its first chunk echoes them (`prompt_token_ids`, asked for so that the
/// journal has them), each at most ten digits and a comma. Without this a
/// long prompt's echo alone passes the bound above (a 35k-token prompt's
/// ids are ~200 KiB, the free tokens' allowance 128 KiB).
pub const PROMPT_ID_BYTES: usize = 11;

/// The relay of one request, across every decoder that serves it.
/// What [`Relay::take_ready`] found.
pub enum Ready {
    /// No event came within the few turns it waits.
    Nothing,
    /// An event came and was relayed; the relay goes on.
    Taken,
    /// An event came that halts the relay of this attempt.
    Halted(Halt),
}

pub struct Relay {
    output: Output,
    journal: JournalHandle,
    /// Bytes for a streaming client, in order.
    out: VecDeque<Bytes>,
    /// Chunks of the current decoder whose token ids came without their text:
    /// the engine's detokenizer holds back a character split across tokens
    /// until its last byte. They are journaled and relayed with the chunk that
    /// brings the text; a resume drops them and continues after the last token
    /// whose text the client has, since the next decoder sees those tokens only
    /// in its prompt and would never emit the held bytes.
    /// By choice: each choice's chunks come in its own order.
    withheld: Vec<Withheld>,
    /// The request's stop strings, matched here (see [`crate::protocols::openai::stops`]).
    stops: Option<Matcher>,
    /// Whether chunks may be withheld (single-choice requests that can resume).
    may_withhold: bool,
    choices: usize,
    /// Most tokens a choice may get: what the client asked for.
    max_tokens: usize,
    /// Event bytes and tokens the current decoder sent.
    attempt_bytes: usize,
    attempt_tokens: usize,
    /// Bytes the current decoder may send for the prompt it was given (its
    /// echo of the prompt's token ids: the request's, and on a resume the
    /// tokens generated before it).
    attempt_prompt_bytes: usize,
    timing: Timing,
}

/// Latency bookkeeping.
struct Timing {
    route: &'static str,
    model: String,
    started: Instant,
    last_token: Option<Instant>,
    /// When the last decoder failure was detected, until the next token.
    failure_detected: Option<Instant>,
    inter_token: Option<metrics::Histogram>,
}

impl Relay {
    pub fn new(
        info: &RequestInfo,
        journal: JournalHandle,
        may_withhold: bool,
        max_tokens: u64,
    ) -> Self {
        let started = journal.read(|e| e.started).unwrap_or_else(Instant::now);
        Self {
            output: Output::new(info),
            journal,
            out: VecDeque::new(),
            withheld: (0..usize::try_from(info.n).unwrap_or(1).max(1))
                .map(|_| Withheld::default())
                .collect(),
            may_withhold,
            choices: usize::try_from(info.n).unwrap_or(1).max(1),
            stops: info
                .stop
                .clone()
                .map(|s| Matcher::new(s, usize::try_from(info.n).unwrap_or(1))),
            max_tokens: usize::try_from(max_tokens).unwrap_or(usize::MAX),
            attempt_bytes: 0,
            attempt_tokens: 0,
            attempt_prompt_bytes: 0,
            timing: Timing {
                route: info.route.path(),
                model: info.model.clone(),
                // TTFT counts from the request's arrival (the journal's
                // start), prefill included.
                started,
                last_token: None,
                failure_detected: None,
                inter_token: None,
            },
        }
    }

    /// The prompt logprobs the prefill computed, for a non-stream answer.
    pub fn set_prompt_logprobs(&mut self, logprobs: Option<serde_json::Value>) {
        self.output.set_prompt_logprobs(logprobs);
    }

    pub fn journal(&self) -> &JournalHandle {
        &self.journal
    }

    /// A new decoder's stream starts.
    pub fn on_attempt(&mut self, decoder: &str) {
        self.timing.inter_token = Some(crate::observe::metrics::inter_token(decoder));
        self.attempt_bytes = 0;
        self.attempt_tokens = 0;
        let prompt = self.journal.read(|e| {
            e.prompt_token_ids.len() + e.choices.iter().map(|c| c.token_ids.len()).sum::<usize>()
        });
        self.attempt_prompt_bytes = prompt
            .saturating_mul(PROMPT_ID_BYTES)
            .saturating_mul(self.choices);
        // A resumed decoder counts text offsets from the end of what the
        // client has.
        let had: Vec<usize> = self
            .journal
            .read(|e| e.choices.iter().map(|c| c.text.chars().count()).collect());
        let bases = had
            .into_iter()
            .enumerate()
            .map(|(index, had)| had + self.stops.as_ref().map_or(0, |m| m.held_chars(index)))
            .collect();
        self.output.set_text_bases(bases);
    }

    /// A decoder failed: chunks withheld from it are dropped (the next decoder
    /// continues after the last token whose text the client has), and the
    /// resume latency runs until the next token.
    pub fn on_failure(&mut self) {
        self.withheld.iter_mut().for_each(Withheld::clear);
        self.timing
            .failure_detected
            .get_or_insert_with(Instant::now);
    }

    /// The next bytes for the client, if any are queued.
    pub fn pop(&mut self) -> Option<Bytes> {
        self.out.pop_front()
    }

    /// The client's protocol is `translated`'s (its first events queued).
    pub fn translate_with(&mut self, translated: Box<dyn TranslatedOutput>) {
        self.out.extend(self.output.translate_with(translated));
    }

    /// Queues the last events of a finished stream; returns what must be
    /// kept before [`Self::finish_last`] queues a translation's.
    pub fn finish(&mut self) -> Option<BoxFuture<'static, ()>> {
        if !self.output.is_stream() {
            return None;
        }
        // Read under the entry's lock; the events are made after it.
        let usage = self.journal.read(|e| self.output.end_usage(e));
        let (events, keeping) = self.output.end_events(usage);
        self.out.extend(events);
        keeping
    }

    /// Queues a translation's last events (once what it keeps is kept).
    pub fn finish_last(&mut self) {
        self.out.extend(self.output.last_events());
    }

    /// Queues the error events of a stream that cannot go on.
    pub fn fail(&mut self, error: &ApiError) {
        if self.output.is_stream() {
            self.out.extend(self.output.fail_events(error));
        }
    }

    /// The one response of a non-stream client.
    pub fn response(&self) -> serde_json::Value {
        self.journal.read(|e| self.output.response(e))
    }

    /// Waits for the next item of `attempt` and relays it; `Some` when the
    /// relay stops taking items from it.
    pub async fn next(&mut self, attempt: &mut Attempt) -> Option<Halt> {
        let item = attempt.next().await;
        self.take(attempt, item)
    }

    /// Takes an item `attempt` already has, waiting a few scheduler turns for
    /// it and no more.
    pub async fn take_ready(&mut self, attempt: &mut Attempt) -> Ready {
        for _ in 0..HANDOFF_TURNS {
            tokio::task::yield_now().await;
            if let Some(item) = attempt.next().now_or_never() {
                return match self.take(attempt, item) {
                    None => Ready::Taken,
                    Some(halt) => Ready::Halted(halt),
                };
            }
        }
        Ready::Nothing
    }

    fn take(&mut self, attempt: &mut Attempt, item: AttemptItem) -> Option<Halt> {
        let data = match item {
            AttemptItem::Data(data) => data,
            AttemptItem::Done => return Some(Halt::Ended(None)),
            AttemptItem::Failed(failure) => return Some(Halt::Ended(Some(failure))),
        };
        self.take_data(attempt, &data, true)
    }

    /// Relays the chunk of a [`Halt::Split`], cut to the tokens an engine
    /// checking each token for the stop would have kept.
    pub fn take_cut(&mut self, attempt: &mut Attempt, data: &Bytes) -> Option<Halt> {
        self.take_data(attempt, data, false)
    }

    fn take_data(&mut self, attempt: &mut Attempt, data: &Bytes, may_split: bool) -> Option<Halt> {
        let decoder = attempt.decoder().id.clone();
        let result = self.on_chunk(data, attempt.source, &decoder, may_split);
        if result.as_ref().is_ok_and(|tokens| *tokens > 0) {
            attempt.saw_tokens();
        }
        match result {
            // Every choice ended (a stop string, here): the decoder, which
            // does not know the stop strings, is cut off.
            Ok(_) if self.stops.is_some() && self.journal.read(|e| e.all_finished()) => {
                Some(Halt::Ended(None))
            }
            Ok(_) => None,
            Err(stop) => Some(stop),
        }
    }

    /// Checks, journals and relays one chunk; returns its tokens.
    #[cfg(test)]
    pub fn on_data(&mut self, data: &Bytes, source: Source, decoder: &str) -> Result<usize, Halt> {
        self.on_chunk(data, source, decoder, true)
    }

    /// [`Self::on_data`]; with `may_split`, a chunk of several tokens in which
    /// a stop string ends is handed back as [`Halt::Split`] instead.
    fn on_chunk(
        &mut self,
        data: &Bytes,
        source: Source,
        decoder: &str,
        may_split: bool,
    ) -> Result<usize, Halt> {
        let protocol =
            |message: String| Halt::Failed(Failure::new(decoder, Cause::Protocol, message));
        let Some(parsed) = chunk::parse(data) else {
            return Err(protocol(format!(
                "decoder {decoder} sent an invalid chunk (not JSON, or token ids that are not integers)"
            )));
        };
        if let Some(raw) = parsed.error {
            let error = ErrorEvent::parse(raw);
            if error.is_server_error() {
                return Err(Halt::Failed(Failure::new(
                    decoder,
                    Cause::ServerError,
                    format!("decoder {decoder} failed: {}", error.message),
                )));
            }
            // The engine refused the request itself: retrying will not help.
            return Err(Halt::Refused(ApiError::BadGateway {
                instance: decoder.to_string(),
                message: error.message,
            }));
        }
        if let Some(choice) = parsed.choices.iter().find(|c| c.index >= self.choices) {
            return Err(protocol(format!(
                "decoder {decoder} sent choice {} of a request with {} choice(s)",
                choice.index, self.choices
            )));
        }
        // vLLM finishes a request it could not run (e.g. its KV could not be
        // loaded, with kv_load_failure_policy "fail") with finish_reason "error":
        // that is the decoder failing, not the request ending.
        if parsed
            .choices
            .iter()
            .any(|c| c.finish_reason.as_deref() == Some("error"))
        {
            return Err(Halt::Failed(Failure::new(
                decoder,
                Cause::ServerError,
                format!("decoder {decoder} finished the request with an error"),
            )));
        }
        let tokens: usize = parsed
            .choices
            .iter()
            .map(|c| c.token_ids.as_ref().map_or(0, Vec::len))
            .sum();
        self.attempt_bytes = self.attempt_bytes.saturating_add(data.len());
        self.attempt_tokens = self.attempt_tokens.saturating_add(tokens);
        let allowed = (self.attempt_tokens + FREE_TOKENS * self.choices)
            .saturating_mul(EVENT_BYTES_PER_TOKEN)
            .saturating_add(self.attempt_prompt_bytes);
        if self.attempt_bytes > allowed {
            return Err(protocol(format!(
                "decoder {decoder} sent {} bytes for {} tokens (at most {} bytes a token)",
                self.attempt_bytes, self.attempt_tokens, EVENT_BYTES_PER_TOKEN
            )));
        }
        if tokens > 0 {
            let over = self.journal.read(|e| {
                parsed.choices.iter().any(|c| {
                    let had = e.choices.get(c.index).map_or(0, |s| s.token_ids.len());
                    let new = c.token_ids.as_ref().map_or(0, Vec::len);
                    let held = self.withheld.get(c.index).map_or(0, |w| w.tokens);
                    had + held + new > self.max_tokens
                })
            });
            if over {
                return Err(protocol(format!(
                    "decoder {decoder} sent more than the {} tokens asked for",
                    self.max_tokens
                )));
            }
            // After the checks (a chunk past max_tokens is refused whole, not
            // cut), before anything of it is taken.
            if let Some(split) = may_split.then(|| self.merged_stop(&parsed, data)).flatten() {
                return Err(Halt::Split(split));
            }
            self.on_tokens(decoder);
        }
        if let Some(held) = text_withheld(&parsed)
            .filter(|_| self.may_withhold)
            .and_then(|index| self.withheld.get_mut(index))
            .filter(|held| held.chunks.len() < MAX_WITHHELD)
        {
            held.chunks.push(data.clone());
            held.tokens += tokens;
            return Ok(tokens);
        }
        // The chunks this one's choices withheld go first.
        for choice in &parsed.choices {
            let Some(held) = self.withheld.get_mut(choice.index) else {
                continue;
            };
            held.tokens = 0;
            for chunk in std::mem::take(&mut held.chunks) {
                if let Some(parsed) = chunk::parse(&chunk) {
                    self.relay(&parsed, &chunk, source);
                }
            }
        }
        self.relay(&parsed, data, source);
        Ok(tokens)
    }

    /// A stop string ending inside this chunk of several tokens, if one does.
    /// Not while chunks are withheld: the chunk's text then also belongs to
    /// their tokens (a character split across tokens), and all are kept.
    fn merged_stop(&self, parsed: &chunk::Chunk<'_>, data: &Bytes) -> Option<Split> {
        let matcher = self.stops.as_ref()?;
        let [choice] = parsed.choices.as_slice() else {
            return None;
        };
        if self
            .withheld
            .get(choice.index)
            .is_some_and(|held| !held.chunks.is_empty())
        {
            return None;
        }
        let ids = choice.token_ids.as_ref().filter(|ids| ids.len() > 1)?;
        let text = choice.text();
        let through = matcher.stop_end(choice.index, text)?;
        // What the client has, then what is held back, then the new text.
        let had = self.journal.read(|e| {
            e.choices
                .get(choice.index)
                .map_or(0, |c| c.text.chars().count())
        });
        Some(Split {
            data: data.clone(),
            index: choice.index,
            ids: ids.clone(),
            before: had + matcher.held_chars(choice.index),
            through,
            length: text.chars().count(),
        })
    }

    /// Journals one (checked) chunk and queues what a streaming client gets of it.
    fn relay(&mut self, parsed: &chunk::Chunk<'_>, data: &[u8], source: Source) {
        if let Some(edited) = self.stops.as_mut().and_then(|m| m.edit(data)) {
            if let Some(parsed) = chunk::parse(&edited) {
                self.journal.update(|e| record(e, &parsed));
                if let Some(bytes) = self.output.event(&parsed, &edited, source) {
                    self.out.push_back(bytes);
                }
            }
            return;
        }
        self.journal.update(|e| record(e, parsed));
        if let Some(bytes) = self.output.event(parsed, data, source) {
            self.out.push_back(bytes);
        }
    }

    fn on_tokens(&mut self, decoder: &str) {
        let now = Instant::now();
        match self.timing.last_token {
            None => {
                let ttft = now - self.timing.started;
                self.journal.update(|e| e.ttft = Some(ttft));
                crate::observe::metrics::first_token(
                    self.timing.route,
                    decoder,
                    &self.timing.model,
                    ttft,
                )
            }
            Some(last) => {
                if let Some(histogram) = &self.timing.inter_token {
                    histogram.record((now - last).as_secs_f64());
                }
            }
        }
        if let Some(detected) = self.timing.failure_detected.take() {
            crate::observe::metrics::resume_latency(now - detected);
        }
        self.timing.last_token = Some(now);
    }
}

/// Writes what one chunk brings to the journal.
fn record(entry: &mut Entry, parsed: &chunk::Chunk<'_>) {
    for choice in &parsed.choices {
        let Some(state) = entry.choices.get_mut(choice.index) else {
            continue;
        };
        state.text.push_str(choice.text());
        if let Some(ids) = choice.token_ids.as_ref().filter(|ids| !ids.is_empty()) {
            state.token_ids.extend_from_slice(ids);
            state
                .chunk_lens
                .push(u32::try_from(ids.len()).unwrap_or(u32::MAX));
        }
        state.parsed_output |= choice.has_other_output();
        // As vLLM's derenderer pins them: a call's id is the first one seen
        // at its index.
        for call in choice.tool_calls() {
            if let Some(id) = &call.id {
                if call.index >= state.tool_call_ids.len() {
                    state.tool_call_ids.push(id.to_string());
                }
            }
        }
        if let Some(reason) = &choice.finish_reason {
            state.finish_reason = Some(reason.to_string());
            state.stop_reason = choice
                .stop_reason
                .and_then(|r| serde_json::from_str(r.get()).ok());
        }
    }
}

/// The choice of a chunk that brings token ids but not yet their text (and
/// no finish): a chunk of one choice, as engines stream them.
fn text_withheld(parsed: &chunk::Chunk<'_>) -> Option<usize> {
    match parsed.choices.as_slice() {
        [choice]
            if choice.token_ids.as_ref().is_some_and(|ids| !ids.is_empty())
                && choice.text().is_empty()
                && !choice.has_other_output()
                && choice.finish_reason.is_none() =>
        {
            Some(choice.index)
        }
        _ => None,
    }
}

/// One choice's chunks withheld for their text, and their tokens.
#[derive(Debug, Default)]
struct Withheld {
    chunks: Vec<Bytes>,
    tokens: usize,
}

impl Withheld {
    fn clear(&mut self) {
        self.chunks.clear();
        self.tokens = 0;
    }
}

/// The bytes of one write to a streaming client: the first bytes, then what
/// else is ready, up to [`BATCH_EVENTS`] events or [`BATCH_BYTES`] bytes.
pub struct Batch {
    first: Bytes,
    rest: Option<BytesMut>,
    events: usize,
}

impl Batch {
    pub fn new(first: Bytes) -> Self {
        Self {
            first,
            rest: None,
            events: 1,
        }
    }

    pub fn push(&mut self, bytes: Bytes) {
        let first = &self.first;
        self.rest
            .get_or_insert_with(|| BytesMut::from(&first[..]))
            .extend_from_slice(&bytes);
        self.events += 1;
    }

    pub fn is_full(&self) -> bool {
        self.events >= BATCH_EVENTS || self.rest.as_ref().is_some_and(|b| b.len() >= BATCH_BYTES)
    }

    pub fn finish(self) -> Bytes {
        self.rest.map_or(self.first, BytesMut::freeze)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::Journal;
    use crate::protocols::openai::request::Route;
    use std::sync::Arc;

    fn info(n: u64, stream: bool) -> RequestInfo {
        RequestInfo {
            route: Route::Completions,
            request_id: "r".into(),
            model: "m".into(),
            stream,
            include_usage: false,
            return_token_ids: false,
            n,
            chat_top_logprobs: None,
            stop: None,
            echo_text: None,
            hide_reasoning: false,
            forced_tool_call: false,
            cache_root: crate::prefix::hash::ROOT,
        }
    }

    fn relay(n: u64, max_tokens: u64) -> (Arc<Journal>, Relay) {
        let journal = Arc::new(Journal::default());
        let handle = journal.open("r", "/v1/completions", "m", true, n as usize);
        (
            journal,
            Relay::new(&info(n, true), handle, n == 1, max_tokens),
        )
    }

    fn chunk(index: usize, text: &str, ids: &[u32]) -> Bytes {
        Bytes::from(
            serde_json::json!({"id":"e","choices":[{"index":index,"text":text,"token_ids":ids,"finish_reason":null}]})
                .to_string(),
        )
    }

    fn cause(stop: Halt) -> Cause {
        match stop {
            Halt::Failed(failure) => failure.cause,
            other => panic!("not a failure: {other:?}"),
        }
    }

    #[test]
    fn relays_and_journals_a_chunk() {
        let (_journal, mut relay) = relay(1, 16);
        assert_eq!(
            relay
                .on_data(&chunk(0, " a", &[5]), Source::Native, "d0")
                .ok(),
            Some(1)
        );
        let out = relay.pop().expect("an event");
        let event: serde_json::Value =
            serde_json::from_slice(&out[b"data: ".len()..]).expect("one event");
        assert_eq!(event["id"], "cmpl-r");
        assert_eq!(
            relay.journal().read(|e| e.choices[0].token_ids.clone()),
            vec![5]
        );
    }

    #[test]
    fn protocol_violations_are_decoder_failures_never_relayed() {
        let bad: [&[u8]; 3] = [
            b"not json",
            br#"{"choices":[{"index":0,"text":"x","token_ids":[1.5]}]}"#,
            br#"{"choices":[{"index":0,"text":"x","token_ids":["a"]}]}"#,
        ];
        for data in bad {
            let (_journal, mut relay) = relay(1, 16);
            let stop = relay
                .on_data(&Bytes::from_static(data), Source::Native, "d0")
                .expect_err("refused");
            assert_eq!(cause(stop), Cause::Protocol);
            assert!(relay.pop().is_none(), "nothing relayed");
        }
        // Choice 7 of an `n: 1` request.
        let (_journal, mut relay) = relay(1, 16);
        let stop = relay
            .on_data(&chunk(7, "x", &[1]), Source::Native, "d0")
            .expect_err("refused");
        assert_eq!(cause(stop), Cause::Protocol);
        assert!(relay.pop().is_none());
        assert_eq!(relay.journal().read(Entry::generated), 0);
    }

    #[test]
    fn more_tokens_than_asked_for_is_a_protocol_failure() {
        let (_journal, mut relay) = relay(1, 2);
        assert!(relay
            .on_data(&chunk(0, "a", &[1, 2]), Source::Native, "d0")
            .is_ok());
        let stop = relay
            .on_data(&chunk(0, "b", &[3]), Source::Native, "d0")
            .expect_err("over");
        assert_eq!(cause(stop), Cause::Protocol);
    }

    #[test]
    fn chunks_without_text_wait_for_theirs_and_are_bounded() {
        let (_journal, mut relay) = relay(1, 1000);
        relay
            .on_data(&chunk(0, "", &[1]), Source::Native, "d0")
            .ok();
        assert!(relay.pop().is_none(), "withheld");
        relay
            .on_data(&chunk(0, "é", &[2]), Source::Native, "d0")
            .ok();
        assert!(
            relay.pop().is_some() && relay.pop().is_some(),
            "both relayed"
        );
        for id in 0..(MAX_WITHHELD as u32 + 4) {
            relay
                .on_data(&chunk(0, "", &[id]), Source::Native, "d0")
                .ok();
        }
        assert!(relay.withheld[0].chunks.len() <= MAX_WITHHELD);
        // A failure drops what was withheld: the resume continues before it.
        relay.on_failure();
        assert!(relay.withheld[0].chunks.is_empty());
    }

    #[test]
    fn an_engine_refusal_ends_the_request_and_a_server_error_fails_the_decoder() {
        let (_journal, mut relay) = relay(1, 16);
        let refused = relay.on_data(
            &Bytes::from_static(br#"{"error":{"message":"bad","code":400}}"#),
            Source::Native,
            "d0",
        );
        assert!(matches!(refused, Err(Halt::Refused(_))));
        let failed = relay
            .on_data(
                &Bytes::from_static(br#"{"error":{"message":"boom","code":500}}"#),
                Source::Native,
                "d0",
            )
            .expect_err("failure");
        assert_eq!(cause(failed), Cause::ServerError);
    }
}
