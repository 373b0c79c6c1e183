//! Phase 3: relay. Reads the decoder's SSE stream, journals every token, and
//! either re-emits each chunk to a streaming client (with the router's response
//! id, and without the token-id fields the client did not ask for) or collects
//! them into one response for a non-stream client. Usage is the router's own
//! count, so that every token is counted once.

use super::decode::Opened;
use super::request::{RequestInfo, Route};
use crate::error::ApiError;
use crate::journal::JournalHandle;
use crate::registry::LoadGuard;
use crate::sse::{self, SseParser};
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// What one choice produced so far.
#[derive(Debug, Default, Clone)]
struct ChoiceState {
    text: String,
    token_ids: Vec<u32>,
    finish_reason: Option<Value>,
    stop_reason: Option<Value>,
}

/// The relay of one request's decode stream.
pub struct Relay {
    info: RequestInfo,
    id: String,
    created: u64,
    prompt_token_ids: Vec<u32>,
    upstream: BoxStream<'static, reqwest::Result<Bytes>>,
    parser: SseParser,
    guard: LoadGuard,
    journal: JournalHandle,
    choices: Vec<ChoiceState>,
    out: VecDeque<Bytes>,
    started: Instant,
    last_token: Option<Instant>,
    inter_token: metrics::Histogram,
    ended: bool,
    status: u16,
}

impl Relay {
    pub fn new(
        info: RequestInfo,
        prompt_token_ids: Vec<u32>,
        opened: Opened,
        journal: JournalHandle,
    ) -> Self {
        let id = format!("{}-{}", info.route.id_prefix(), info.request_id);
        let inter_token = crate::metrics::inter_token(&opened.guard.instance().id);
        Self {
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            id,
            prompt_token_ids,
            upstream: opened.response.bytes_stream().boxed(),
            parser: SseParser::default(),
            guard: opened.guard,
            journal,
            choices: vec![ChoiceState::default(); usize::try_from(info.n).unwrap_or(1)],
            out: VecDeque::new(),
            started: Instant::now(),
            last_token: None,
            inter_token,
            ended: false,
            status: 200,
            info,
        }
    }

    pub fn info(&self) -> &RequestInfo {
        &self.info
    }

    fn decoder(&self) -> &str {
        &self.guard.instance().id
    }

    /// The next bytes for a streaming client; `None` at the end.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if let Some(chunk) = self.out.pop_front() {
                return Some(chunk);
            }
            if self.ended {
                return None;
            }
            match self.upstream.next().await {
                Some(Ok(bytes)) => {
                    for data in self.parser.push(&bytes) {
                        self.on_event(&data);
                    }
                }
                Some(Err(err)) => {
                    self.fail(&format!("decoder {} stream failed: {err}", self.decoder()))
                }
                None => self.fail(&format!(
                    "decoder {} ended the stream before finishing",
                    self.decoder()
                )),
            }
        }
    }

    /// Handles one event payload of the decoder's stream.
    fn on_event(&mut self, data: &[u8]) {
        if self.ended {
            return;
        }
        if data == sse::DONE {
            if self.choices.iter().all(|c| c.finish_reason.is_some()) {
                self.finish();
            } else {
                self.fail(&format!(
                    "decoder {} ended the stream before finishing",
                    self.decoder()
                ));
            }
            return;
        }
        let Ok(mut chunk) = serde_json::from_slice::<Value>(data) else {
            return self.fail(&format!("decoder {} sent an invalid chunk", self.decoder()));
        };
        if let Some(error) = chunk.get("error") {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("decoder error")
                .to_string();
            return self.fail(&message);
        }
        let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut) else {
            return;
        };
        if choices.is_empty() {
            return; // the engine's usage chunk: the router sends its own
        }
        let now = Instant::now();
        for choice in choices.iter_mut() {
            self.absorb(choice, now);
            if !self.info.return_token_ids {
                if let Some(map) = choice.as_object_mut() {
                    map.remove("token_ids");
                    map.remove("prompt_token_ids");
                }
            }
        }
        if let Some(map) = chunk.as_object_mut() {
            map.insert("id".into(), Value::String(self.id.clone()));
            map.remove("kv_transfer_params");
            if !self.info.return_token_ids {
                map.remove("prompt_token_ids");
            }
        }
        if self.info.stream {
            self.out.push_back(sse::event(chunk.to_string().as_bytes()));
        }
    }

    /// Journals what one choice of a chunk carries.
    fn absorb(&mut self, choice: &Value, now: Instant) {
        let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        let Some(state) = self.choices.get_mut(index) else {
            return;
        };
        let text = match self.info.route {
            Route::Completions => choice.get("text"),
            Route::Chat => choice.pointer("/delta/content"),
        };
        if let Some(text) = text.and_then(Value::as_str) {
            state.text.push_str(text);
        }
        let ids: Vec<u32> = choice
            .get("token_ids")
            .and_then(Value::as_array)
            .map(|ids| {
                ids.iter()
                    .filter_map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                    .collect()
            })
            .unwrap_or_default();
        if !ids.is_empty() {
            match self.last_token {
                None => crate::metrics::first_token(
                    self.info.route.path(),
                    &self.guard.instance().id,
                    now - self.started,
                ),
                Some(last) => self.inter_token.record((now - last).as_secs_f64()),
            }
            self.last_token = Some(now);
        }
        state.token_ids.extend_from_slice(&ids);
        if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
            state.finish_reason = Some(reason.clone());
            state.stop_reason = choice.get("stop_reason").cloned();
        }
        if index == 0 {
            let finish = state
                .finish_reason
                .as_ref()
                .and_then(Value::as_str)
                .map(str::to_string);
            let text = text.and_then(Value::as_str).unwrap_or_default().to_string();
            self.journal.update(|e| {
                e.generated_token_ids.extend_from_slice(&ids);
                e.text.push_str(&text);
                e.finish_reason = finish;
            });
        }
    }

    fn usage(&self) -> Value {
        let prompt = self.prompt_token_ids.len();
        let completion: usize = self.choices.iter().map(|c| c.token_ids.len()).sum();
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    fn object(&self) -> &'static str {
        match (self.info.route, self.info.stream) {
            (Route::Completions, _) => "text_completion",
            (Route::Chat, true) => "chat.completion.chunk",
            (Route::Chat, false) => "chat.completion",
        }
    }

    /// The decoder finished every choice.
    fn finish(&mut self) {
        self.ended = true;
        if self.info.stream {
            if self.info.include_usage {
                let chunk = json!({"id": self.id, "object": self.object(), "created": self.created,
                    "model": self.info.model, "choices": [], "usage": self.usage()});
                self.out.push_back(sse::event(chunk.to_string().as_bytes()));
            }
            self.out.push_back(sse::event(sse::DONE));
        }
        self.record(200);
    }

    /// The stream cannot go on: the client gets an OpenAI error event, never a
    /// silent truncation.
    fn fail(&mut self, message: &str) {
        if self.ended {
            return;
        }
        tracing::warn!(request_id = %self.info.request_id, decoder = %self.decoder(), %message, "decode failed");
        crate::metrics::upstream_error(&self.guard.instance().id, "decode", "stream");
        self.ended = true;
        let error = ApiError::BadGateway {
            instance: self.decoder().to_string(),
            message: message.to_string(),
        };
        if self.info.stream {
            self.out
                .push_back(sse::event(error.body().to_string().as_bytes()));
            self.out.push_back(sse::event(sse::DONE));
        }
        self.record(502);
    }

    fn record(&mut self, status: u16) {
        self.status = status;
        crate::metrics::request_finished(self.info.route.path(), status, self.started.elapsed());
    }

    /// A streaming response that relays chunk by chunk.
    pub fn into_sse_response(self) -> Response {
        let request_id = self.info.request_id.clone();
        let body = futures_util::stream::unfold(self, |mut relay| async move {
            relay
                .next_chunk()
                .await
                .map(|chunk| (Ok::<_, std::convert::Infallible>(chunk), relay))
        });
        (
            [
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
                ("x-request-id", request_id.as_str()),
            ],
            Body::from_stream(body),
        )
            .into_response()
    }

    /// Reads the whole stream and answers one response (non-stream client).
    pub async fn collect(mut self) -> Result<Response, ApiError> {
        while self.next_chunk().await.is_some() {}
        if self.status != 200 {
            return Err(ApiError::BadGateway {
                instance: self.decoder().to_string(),
                message: "decoder failed before finishing".into(),
            });
        }
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let mut choice = match self.info.route {
                    Route::Completions => json!({"index": index, "text": c.text, "logprobs": null}),
                    Route::Chat => json!({"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": null}),
                };
                choice["finish_reason"] = c.finish_reason.clone().unwrap_or(Value::Null);
                choice["stop_reason"] = c.stop_reason.clone().unwrap_or(Value::Null);
                if self.info.return_token_ids {
                    choice["token_ids"] = json!(c.token_ids);
                    if self.info.route == Route::Completions {
                        choice["prompt_token_ids"] = json!(self.prompt_token_ids);
                    }
                }
                choice
            })
            .collect();
        let mut response = json!({"id": self.id, "object": self.object(), "created": self.created,
            "model": self.info.model, "choices": choices, "usage": self.usage()});
        if self.info.return_token_ids && self.info.route == Route::Chat {
            response["prompt_token_ids"] = json!(self.prompt_token_ids);
        }
        let request_id = self.info.request_id.clone();
        Ok((
            [("x-request-id", request_id.as_str())],
            axum::Json(response),
        )
            .into_response())
    }
}
