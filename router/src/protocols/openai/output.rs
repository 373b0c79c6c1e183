//! What the client sees of a request, whichever decoders served it: one response
//! id, every choice's text and token ids exactly once (as the journal records
//! them), and usage counted by the router.
//!
//! A streaming client gets each decoder chunk edited (the router's id, token-id
//! fields it did not ask for removed) or, when a chat request was resumed through
//! the completions route, re-wrapped as a chat chunk. A non-stream client gets one
//! response assembled from the chunks ([`Assembly`]) as the engine would have
//! answered it. Usage is the router's count with whatever else the engine's
//! usage gave (its details).

use super::assemble::Assembly;
use super::chunk::{self, Chunk, Field};
use super::request::{RequestInfo, Route};
use crate::error::ApiError;
use crate::journal::Entry;
use crate::protocols::openai::translated_output::TranslatedOutput;
use crate::protocols::sse;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde_json::{json, Map, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// Which kind of stream a decoder chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The client's own route and body (first attempt, or a fail-over before the
    /// first token).
    Native,
    /// A resumed request: `/v1/completions` on prompt ids + generated ids.
    Resumed,
    /// A resumed chat through the engine's tokens API: chat chunks as the
    /// engine's chat route makes them (`derender.rs`).
    Derendered,
}

/// How the client sees a request: the formatting of its chunks and of its one
/// response. What was generated is the journal's ([`Entry`]), read here.
#[derive(Debug)]
pub struct Output {
    id: String,
    created: u64,
    route: Route,
    stream: bool,
    include_usage: bool,
    return_token_ids: bool,
    model: String,
    /// Whether a chat client got the `role` delta yet.
    role_sent: bool,
    /// A non-stream client's answer so far.
    assembly: Option<Assembly>,
    /// The engine's last usage object: its details (cached prompt tokens...)
    /// go to the client with the router's counts.
    engine_usage: Option<Value>,
    /// Characters of text the client had of each choice when the current
    /// decoder started: a resumed decoder's completions `text_offset`s count
    /// from there.
    text_bases: Vec<usize>,
    /// Chat logprobs asked for: alternatives per token.
    chat_top_logprobs: Option<usize>,
    /// Completions `echo`: the prompt text, and which choices have it yet.
    echo: Option<(String, Vec<bool>)>,
    /// The prompt's logprobs as the prefill computed them (a stream cannot
    /// carry them): a non-stream answer's `prompt_logprobs`.
    prompt_logprobs: Option<Value>,
    /// Chat `include_reasoning: false` (see [`without_reasoning`]).
    hide_reasoning: bool,
    /// The client's protocol, when it is not chat's own (Responses,
    /// Messages): what a streaming client gets is its translation.
    translated: Option<Box<dyn TranslatedOutput>>,
}

impl Output {
    pub fn new(info: &RequestInfo) -> Self {
        Self {
            id: format!("{}-{}", info.route.id_prefix(), info.request_id),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            route: info.route,
            stream: info.stream,
            include_usage: info.include_usage,
            return_token_ids: info.return_token_ids,
            model: info.model.clone(),
            role_sent: false,
            assembly: (!info.stream).then(|| {
                Assembly::new(info.route, usize::try_from(info.n).unwrap_or(1))
                    .forcing_tool_call(info.forced_tool_call)
            }),
            engine_usage: None,
            text_bases: Vec::new(),
            chat_top_logprobs: info.chat_top_logprobs,
            echo: info.echo_text.clone().map(|text| {
                let n = usize::try_from(info.n).unwrap_or(1).max(1);
                (text, vec![false; n])
            }),
            prompt_logprobs: None,
            hide_reasoning: info.hide_reasoning,
            translated: None,
        }
    }

    /// The client's protocol is `translated`'s; returns what the client gets
    /// before the first chunk.
    pub fn translate_with(&mut self, mut translated: Box<dyn TranslatedOutput>) -> Option<Bytes> {
        let first = translated.start();
        self.translated = Some(translated);
        first
    }

    /// The prompt logprobs of a non-stream answer (from the prefill's answer).
    pub fn set_prompt_logprobs(&mut self, logprobs: Option<Value>) {
        self.prompt_logprobs = logprobs.filter(|l| !l.is_null());
    }

    /// `raw` with the echoed prompt text before the first text of each choice
    /// that has not had it; `None` when nothing changes.
    fn echoed(&mut self, raw: &[u8]) -> Option<Vec<u8>> {
        let (text, done) = self.echo.as_mut()?;
        if done.iter().all(|d| *d) {
            return None;
        }
        let mut chunk: Value = serde_json::from_slice(raw).ok()?;
        let mut changed = false;
        let choices = chunk.get_mut("choices").and_then(Value::as_array_mut);
        for choice in choices.into_iter().flatten() {
            let index = choice.get("index").and_then(Value::as_u64);
            let Some(slot) = index.and_then(|i| done.get_mut(usize::try_from(i).ok()?)) else {
                continue;
            };
            if *slot {
                continue;
            }
            if let Some(Value::String(piece)) = choice.get_mut("text") {
                piece.insert_str(0, text);
                *slot = true;
                changed = true;
            }
        }
        changed.then(|| serde_json::to_vec(&chunk).unwrap_or_else(|_| raw.to_vec()))
    }

    /// Where the next decoder's text starts, in characters of the choice's text.
    pub fn set_text_bases(&mut self, chars: Vec<usize>) {
        self.text_bases = chars;
    }

    pub fn is_stream(&self) -> bool {
        self.stream
    }

    /// The bytes a streaming client gets of one decoder chunk (none for a
    /// non-stream client).
    pub fn event(&mut self, parsed: &Chunk<'_>, raw: &[u8], source: Source) -> Option<Bytes> {
        if let Some(usage) = parsed.usage.filter(|u| u.get() != "null") {
            self.engine_usage = serde_json::from_str(usage.get()).ok();
        }
        if let Some(translated) = &mut self.translated {
            // Engine usage chunks are not the client's: the router counts.
            return match parsed.choices.is_empty() {
                true => None,
                false => translated.chunk(parsed),
            };
        }
        // Echo requests never resume: their chunks are all the client's route.
        let echoed = self.echoed(raw);
        let raw = echoed.as_deref().unwrap_or(raw);
        let hidden;
        let raw = if self.hide_reasoning && self.route == Route::Chat && source != Source::Resumed {
            hidden = without_reasoning(raw)?;
            hidden.as_slice()
        } else {
            raw
        };
        if !self.stream {
            // Usage chunks too: they carry the last top-level fields
            // (`system_fingerprint`).
            self.assemble(parsed, raw, source);
            return None;
        }
        if parsed.choices.is_empty() {
            // Engine usage chunks are dropped: the router sends its own count.
            return None;
        }
        let event = match (source, self.route) {
            (Source::Native | Source::Derendered, _) => {
                self.role_sent = true;
                let strip: &[Field] = if self.return_token_ids {
                    &[]
                } else {
                    &[Field::TokenIds, Field::PromptTokenIds]
                };
                chunk::rewrite_event(raw, &self.id, strip)
            }
            (Source::Resumed, Route::Completions) => {
                // The resumed request's prompt is prompt + generated: the client
                // already has its prompt ids from the first chunk.
                let strip: &[Field] = if self.return_token_ids {
                    &[Field::PromptTokenIds]
                } else {
                    &[Field::TokenIds, Field::PromptTokenIds]
                };
                match self.rebased(parsed, raw) {
                    Some(chunk) => chunk::rewrite_event(
                        &serde_json::to_vec(&chunk).unwrap_or_default(),
                        &self.id,
                        strip,
                    ),
                    None => chunk::rewrite_event(raw, &self.id, strip),
                }
            }
            (Source::Resumed, Route::Chat) => {
                let chunk = self.chat_chunk(parsed, raw);
                sse::event(&serde_json::to_vec(&chunk).unwrap_or_default()).to_vec()
            }
        };
        Some(Bytes::from(event))
    }

    /// Adds a chunk to a non-stream client's answer.
    fn assemble(&mut self, parsed: &Chunk<'_>, raw: &[u8], source: Source) {
        let chunk = match (source, self.route) {
            (Source::Resumed, Route::Chat) => self.chat_chunk(parsed, raw),
            (Source::Resumed, Route::Completions) => match self.rebased(parsed, raw) {
                Some(chunk) => chunk,
                None => return,
            },
            (Source::Native | Source::Derendered, _) => match serde_json::from_slice(raw) {
                Ok(chunk) => chunk,
                Err(_) => return,
            },
        };
        if let Some(assembly) = &mut self.assembly {
            assembly.add(&chunk);
        }
    }

    /// A resumed completions chunk with its logprobs' `text_offset`s counted
    /// from the start of the client's text; `None` when it has no logprobs
    /// (and is not JSON, for a non-stream client).
    fn rebased(&self, parsed: &Chunk<'_>, raw: &[u8]) -> Option<Value> {
        let mut chunk: Value = serde_json::from_slice(raw).ok()?;
        if !parsed.choices.iter().any(|c| c.has_logprobs()) {
            return (!self.stream).then_some(chunk);
        }
        let choices = chunk.get_mut("choices").and_then(Value::as_array_mut);
        for choice in choices.into_iter().flatten() {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let base = usize::try_from(index)
                .ok()
                .and_then(|i| self.text_bases.get(i))
                .copied()
                .unwrap_or(0);
            let offsets = choice
                .pointer_mut("/logprobs/text_offset")
                .and_then(Value::as_array_mut);
            for offset in offsets.into_iter().flatten() {
                if let Some(at) = offset.as_u64() {
                    *offset = json!(at + base as u64);
                }
            }
        }
        Some(chunk)
    }

    /// A completions chunk of a resumed chat request, as a chat chunk (with
    /// the chunk's other top-level fields, such as `system_fingerprint`).
    fn chat_chunk(&mut self, parsed: &Chunk<'_>, raw: &[u8]) -> Value {
        let choices: Vec<Value> = parsed
            .choices
            .iter()
            .map(|c| {
                let mut delta = json!({"content": c.text()});
                if !self.role_sent {
                    delta["role"] = json!("assistant");
                }
                let logprobs = match (self.chat_top_logprobs, c.logprobs) {
                    (Some(top), Some(raw)) => chat_logprobs(raw.get(), top),
                    _ => Value::Null,
                };
                let mut choice = json!({"index": c.index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason});
                if self.return_token_ids {
                    choice["token_ids"] = json!(c.token_ids);
                }
                choice
            })
            .collect();
        self.role_sent = true;
        let mut chunk = json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": choices});
        if let (Ok(Value::Object(original)), Some(out)) =
            (serde_json::from_slice(raw), chunk.as_object_mut())
        {
            for (key, value) in original {
                let completions_only =
                    ["prompt_token_ids", "kv_transfer_params", "object", "usage"];
                if !out.contains_key(&key) && !completions_only.contains(&key.as_str()) {
                    out.insert(key, value);
                }
            }
        }
        chunk
    }

    /// The router's counts (a resumed decoder counts the generated tokens as
    /// prompt), with the rest of the engine's usage.
    fn usage(&self, entry: &Entry) -> Value {
        let prompt = entry.prompt_token_ids.len();
        let completion = entry.generated();
        let mut usage = match &self.engine_usage {
            Some(Value::Object(usage)) => usage.clone(),
            _ => Map::new(),
        };
        usage.insert("prompt_tokens".into(), json!(prompt));
        usage.insert("completion_tokens".into(), json!(completion));
        usage.insert("total_tokens".into(), json!(prompt + completion));
        if !self.stream {
            // A non-stream answer lists the details vLLM's stream leaves out
            // when null.
            for key in super::assemble::USAGE_DEFAULTS {
                usage.entry(*key).or_insert(Value::Null);
            }
        }
        Value::Object(usage)
    }

    fn object(&self) -> &'static str {
        match (self.route, self.stream) {
            (Route::Completions, _) => "text_completion",
            (Route::Chat, true) => "chat.completion.chunk",
            (Route::Chat, false) => "chat.completion",
        }
    }

    /// The usage a finished stream ends with, where it has one (read of
    /// the journal's entry).
    pub fn end_usage(&self, entry: &Entry) -> Option<Value> {
        (self.include_usage || self.translated.is_some()).then(|| self.usage(entry))
    }

    /// The last events of a finished stream, with its `end_usage`: usage
    /// (when asked for) and `[DONE]`; a translated protocol's are made after
    /// what it keeps (returned), by [`Self::last_events`].
    pub fn end_events(
        &mut self,
        usage: Option<Value>,
    ) -> (Vec<Bytes>, Option<BoxFuture<'static, ()>>) {
        if let Some(translated) = &mut self.translated {
            return (Vec::new(), translated.finish(usage.unwrap_or_default()));
        }
        let mut events = Vec::with_capacity(2);
        if let Some(usage) = usage {
            let chunk = json!({"id": self.id, "object": self.object(), "created": self.created,
                "model": self.model, "choices": [], "usage": usage});
            events.push(sse::event(chunk.to_string().as_bytes()));
        }
        events.push(sse::event(sse::DONE));
        (events, None)
    }

    /// A translated protocol's last events (after [`Self::end_events`] or
    /// [`Self::fail_events`]).
    pub fn last_events(&mut self) -> Option<Bytes> {
        self.translated.as_mut().and_then(|t| t.last())
    }

    /// The last events of a stream that cannot go on, in the client's
    /// protocol.
    pub fn fail_events(&mut self, error: &ApiError) -> Vec<Bytes> {
        match &mut self.translated {
            Some(translated) => {
                translated.fail(error);
                translated.last().into_iter().collect()
            }
            None => Self::error_events(error),
        }
    }

    /// The last events of a stream that cannot go on: an OpenAI error event, never
    /// a silent truncation.
    pub fn error_events(error: &ApiError) -> Vec<Bytes> {
        vec![
            sse::event(error.body().to_string().as_bytes()),
            sse::event(sse::DONE),
        ]
    }

    /// The one response of a non-stream client: the assembled chunks, with the
    /// router's id, usage and (when the client asked for them) token ids.
    pub fn response(&self, entry: &Entry) -> Value {
        let empty;
        let assembly = match &self.assembly {
            Some(assembly) => assembly,
            None => {
                empty = Assembly::new(self.route, entry.choices.len());
                &empty
            }
        };
        let choices: Vec<Value> = entry
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let mut choice = assembly.choice(index);
                let token_ids = self.return_token_ids.then(|| json!(c.token_ids));
                choice.insert("token_ids".into(), token_ids.unwrap_or(Value::Null));
                if self.route == Route::Completions {
                    self.insert_prompt(&mut choice, entry);
                }
                Value::Object(choice)
            })
            .collect();
        let mut response = Map::new();
        response.insert("id".into(), json!(self.id));
        response.insert("object".into(), json!(self.object()));
        response.insert("created".into(), json!(self.created));
        response.insert("model".into(), json!(self.model));
        response.insert("choices".into(), Value::Array(choices));
        response.extend(assembly.top());
        response.insert("usage".into(), self.usage(entry));
        // The decoder's own transfer parameters are the router's business.
        response.insert("kv_transfer_params".into(), Value::Null);
        if self.route == Route::Chat {
            self.insert_prompt(&mut response, entry);
        }
        Value::Object(response)
    }

    /// The prompt's token ids (null unless asked for) and its logprobs (when
    /// asked for): on each choice of a completion, on a chat completion.
    fn insert_prompt(&self, into: &mut Map<String, Value>, entry: &Entry) {
        let prompt = self.return_token_ids.then(|| json!(entry.prompt_token_ids));
        into.insert("prompt_token_ids".into(), prompt.unwrap_or(Value::Null));
        if let Some(logprobs) = &self.prompt_logprobs {
            into.insert("prompt_logprobs".into(), logprobs.clone());
        }
    }
}

/// A chat chunk as a client that asked `include_reasoning: false` gets it,
/// as vLLM hides it: no reasoning, and no token ids or logprobs (they would
/// show the reasoning's tokens); `None` when nothing is left to send (a chunk
/// of reasoning alone, which vLLM does not send such a client).
fn without_reasoning(raw: &[u8]) -> Option<Vec<u8>> {
    let Ok(mut chunk) = serde_json::from_slice::<Value>(raw) else {
        return Some(raw.to_vec());
    };
    let mut keep = true;
    if let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) {
        keep = choices.is_empty();
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            choice.remove("token_ids");
            if choice.contains_key("logprobs") {
                choice.insert("logprobs".into(), Value::Null);
            }
            keep |= choice.get("finish_reason").is_some_and(|f| !f.is_null());
            if let Some(Value::Object(delta)) = choice.get_mut("delta") {
                delta.remove("reasoning");
                delta.remove("reasoning_content");
                keep |= !delta.is_empty();
            }
        }
    }
    chunk.as_object_mut().map(|c| c.remove("prompt_token_ids"));
    keep.then(|| serde_json::to_vec(&chunk).unwrap_or_else(|_| raw.to_vec()))
}

/// Completions logprobs (`tokens`, `token_logprobs`, `top_logprobs` maps) as
/// chat logprobs (`content`: each token with its bytes and its `top` best
/// alternatives, best first), as vLLM gives them on the chat route.
fn chat_logprobs(completions: &str, top: usize) -> Value {
    let Ok(lp) = serde_json::from_str::<Value>(completions) else {
        return Value::Null;
    };
    let entry = |token: &str, logprob: &Value| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    let tokens = lp["tokens"].as_array().cloned().unwrap_or_default();
    let content: Vec<Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, token)| {
            let token = token.as_str().unwrap_or_default();
            let mut out = entry(token, &lp["token_logprobs"][i]);
            let mut alternatives: Vec<(&String, &Value)> = lp["top_logprobs"][i]
                .as_object()
                .map(|m| m.iter().collect())
                .unwrap_or_default();
            alternatives.sort_by(|a, b| {
                let (a, b) = (
                    a.1.as_f64().unwrap_or(f64::MIN),
                    b.1.as_f64().unwrap_or(f64::MIN),
                );
                b.total_cmp(&a)
            });
            out["top_logprobs"] = alternatives
                .into_iter()
                .take(top)
                .map(|(t, l)| entry(t, l))
                .collect();
            out
        })
        .collect();
    json!({"content": content})
}
