//! What the client sees of a request, whichever decoders served it: one response
//! id, every choice's text and token ids exactly once (as the journal records
//! them), and usage counted by the router.
//!
//! A streaming client gets each decoder chunk edited (the router's id, token-id
//! fields it did not ask for removed) or, when a chat request was resumed through
//! the completions route, re-wrapped as a chat chunk. A non-stream client gets one
//! response built from what was collected.

use super::chunk::{self, Chunk, Field};
use super::request::{RequestInfo, Route};
use crate::error::ApiError;
use crate::journal::Entry;
use crate::sse;
use bytes::Bytes;
use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// Which kind of stream a decoder chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The client's own route and body (first attempt, or a fail-over before the
    /// first token).
    Native,
    /// A resumed request: `/v1/completions` on prompt ids + generated ids.
    Resumed,
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
        }
    }

    pub fn is_stream(&self) -> bool {
        self.stream
    }

    /// The bytes a streaming client gets of one decoder chunk (none for a
    /// non-stream client).
    pub fn event(&mut self, parsed: &Chunk<'_>, raw: &[u8], source: Source) -> Option<Bytes> {
        if !self.stream || parsed.choices.is_empty() {
            // Engine usage chunks are dropped: the router sends its own count.
            return None;
        }
        let event = match (source, self.route) {
            (Source::Native, _) => {
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
                chunk::rewrite_event(raw, &self.id, strip)
            }
            (Source::Resumed, Route::Chat) => sse::event(&self.chat_chunk(parsed)).to_vec(),
        };
        Some(Bytes::from(event))
    }

    /// A completions chunk of a resumed chat request, as a chat chunk.
    fn chat_chunk(&mut self, parsed: &Chunk<'_>) -> Vec<u8> {
        let choices: Vec<Value> = parsed
            .choices
            .iter()
            .map(|c| {
                let mut delta = json!({"content": c.text()});
                if !self.role_sent {
                    delta["role"] = json!("assistant");
                }
                let mut choice = json!({"index": c.index, "delta": delta, "logprobs": null,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason});
                if self.return_token_ids {
                    choice["token_ids"] = json!(c.token_ids);
                }
                choice
            })
            .collect();
        self.role_sent = true;
        let chunk = json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": choices});
        serde_json::to_vec(&chunk).unwrap_or_default()
    }

    fn usage(entry: &Entry) -> Value {
        let prompt = entry.prompt_token_ids.len();
        let completion = entry.generated();
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    fn object(&self) -> &'static str {
        match (self.route, self.stream) {
            (Route::Completions, _) => "text_completion",
            (Route::Chat, true) => "chat.completion.chunk",
            (Route::Chat, false) => "chat.completion",
        }
    }

    /// The last events of a finished stream: usage (when asked for) and `[DONE]`.
    pub fn end_events(&self, entry: &Entry) -> Vec<Bytes> {
        let mut events = Vec::with_capacity(2);
        if self.include_usage {
            let chunk = json!({"id": self.id, "object": self.object(), "created": self.created,
                "model": self.model, "choices": [], "usage": Self::usage(entry)});
            events.push(sse::event(chunk.to_string().as_bytes()));
        }
        events.push(sse::event(sse::DONE));
        events
    }

    /// The last events of a stream that cannot go on: an OpenAI error event, never
    /// a silent truncation.
    pub fn error_events(error: &ApiError) -> Vec<Bytes> {
        vec![
            sse::event(error.body().to_string().as_bytes()),
            sse::event(sse::DONE),
        ]
    }

    /// The one response of a non-stream client.
    pub fn response(&self, entry: &Entry) -> Value {
        let choices: Vec<Value> = entry
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let mut choice = match self.route {
                    Route::Completions => json!({"index": index, "text": c.text, "logprobs": null}),
                    Route::Chat => json!({"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": null}),
                };
                choice["finish_reason"] = json!(c.finish_reason);
                choice["stop_reason"] = c.stop_reason.clone().unwrap_or(Value::Null);
                if self.return_token_ids {
                    choice["token_ids"] = json!(c.token_ids);
                    if self.route == Route::Completions {
                        choice["prompt_token_ids"] = json!(entry.prompt_token_ids);
                    }
                }
                choice
            })
            .collect();
        let mut response = json!({"id": self.id, "object": self.object(), "created": self.created,
            "model": self.model, "choices": choices, "usage": Self::usage(entry)});
        if self.return_token_ids && self.route == Route::Chat {
            response["prompt_token_ids"] = json!(entry.prompt_token_ids);
        }
        response
    }
}
