//! One request's record from its arrival to its end, however it ends:
//! its `request` tracing span (every log line on its path names it), its
//! metrics, and its access-log line (target `connex::access`, at INFO).
//!
//! A client that goes away before the end is recorded as
//! [`CLIENT_CLOSED`](crate::observe::metrics::CLIENT_CLOSED).

use crate::journal::EntryReader;
use crate::observe::logs::ACCESS_TARGET;
use crate::tenants::Caller;
use axum::http::HeaderMap;
use std::time::{Duration, Instant};
use tracing::field::Empty;
use tracing::Span;

/// The `X-Request-Id` the client sent, or a new one.
pub fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|id| valid_request_id(id))
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

/// Whether `id` may be a request id (it goes into logs and engines'
/// `X-Request-Id`): a client's, or one read back from the shared store.
pub fn valid_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic())
}

/// The id the engines see for a request whose client-facing id is
/// `client_id`: that id with a suffix of its own. vLLM takes `X-Request-Id` as
/// its request id, and two requests with one id (two clients choosing the
/// same, or one reusing its own) collide in its state; the suffix makes each
/// request's unique while logs and engines still show the client's id in it.
/// Prefill and decoders get the same one; the client gets its own id back.
pub fn engine_request_id(client_id: &str) -> String {
    let unique = uuid::Uuid::new_v4().simple().to_string();
    format!("{client_id}-{}", &unique[..16])
}

/// Created when the request arrives; the flow says how it ended with
/// [`RequestRecord::finish`], and the drop writes it all down.
#[derive(Debug)]
pub struct RequestRecord {
    span: Span,
    request_id: String,
    route: &'static str,
    model: Option<String>,
    started: Instant,
    status: Option<u16>,
    /// The request's journal entry, once it has one (after validation).
    entry: Option<EntryReader>,
    /// The request body's share of the router's budget of body bytes in
    /// flight: the body is kept (a resume sends it again) until the request
    /// ends, and so is its share.
    body_share: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Who called (set when the client routes take keys, or always: the
    /// `default` tenant): its usage is written here at the end.
    caller: Option<Caller>,
}

impl RequestRecord {
    pub fn new(route: &'static str, request_id: String) -> Self {
        // At ERROR level so that no filter that lets a request's warning
        // through leaves its span (and so its request id) out.
        let span = tracing::error_span!(
            "request",
            request_id = %request_id,
            route,
            model = Empty,
            tenant = Empty
        );
        Self {
            span,
            request_id,
            route,
            model: None,
            started: Instant::now(),
            status: None,
            entry: None,
            body_share: None,
            caller: None,
        }
    }

    /// Keeps the body's share of the budget until the request ends.
    pub fn hold_body_share(&mut self, share: Option<tokio::sync::OwnedSemaphorePermit>) {
        self.body_share = share;
    }

    /// The caller (its tenant in the span and the access line).
    pub fn set_caller(&mut self, caller: Caller) {
        self.span.record("tenant", &*caller.tenant);
        self.caller = Some(caller);
    }

    /// The span that every step of the request runs in.
    pub fn span(&self) -> &Span {
        &self.span
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The arrival of the request, for its latencies.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The model the request names (known once its body is validated).
    pub fn set_model(&mut self, model: &str) {
        self.span.record("model", model);
        self.model = Some(model.to_string());
    }

    /// The journal entry the access line reads its instances and counts from.
    pub fn set_entry(&mut self, entry: EntryReader) {
        self.entry = Some(entry);
    }

    /// How the request ended (the first call wins).
    pub fn finish(&mut self, status: u16) {
        self.status.get_or_insert(status);
    }
}

/// What the journal knows of the request at its end.
#[derive(Debug, Default)]
struct EntrySummary {
    prefill: String,
    decoders: String,
    resumes: u32,
    ttft: Option<Duration>,
    prompt_tokens: usize,
    completion_tokens: usize,
}

/// Milliseconds, to the hundredth: what a reader of a log line wants.
fn millis(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 100_000.0).round() / 100.0
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        let _entered = self.span.enter();
        let status = self
            .status
            .unwrap_or(crate::observe::metrics::CLIENT_CLOSED);
        let duration = self.started.elapsed();
        let model = self.model.as_deref().unwrap_or("");
        crate::observe::metrics::request_ended(self.route, model, status, duration);
        if let Some(decoder) = self
            .entry
            .as_ref()
            .and_then(|entry| entry.read(|e| e.decoders.last().cloned()))
        {
            crate::observe::metrics::instance_request_ended(&decoder, model, duration);
        }
        let summary = self
            .entry
            .as_ref()
            .map(|entry| {
                entry.read(|e| EntrySummary {
                    prefill: e.prefill.clone().unwrap_or_default(),
                    decoders: e.decoders.join(","),
                    resumes: e.resumes,
                    ttft: e.ttft,
                    prompt_tokens: e.prompt_token_ids.len(),
                    completion_tokens: e.generated(),
                })
            })
            .unwrap_or_default();
        if let Some(caller) = &self.caller {
            if self.entry.is_some() {
                caller.usage.record(
                    summary.prompt_tokens as u64,
                    summary.completion_tokens as u64,
                );
            }
        }
        tracing::info!(
            target: ACCESS_TARGET,
            request_id = %self.request_id,
            tenant = self.caller.as_ref().map(|c| &*c.tenant),
            model,
            route = self.route,
            status,
            prefill = %summary.prefill,
            decoders = %summary.decoders,
            resumes = summary.resumes,
            ttft_ms = summary.ttft.map(millis),
            duration_ms = millis(duration),
            prompt_tokens = summary.prompt_tokens,
            completion_tokens = summary.completion_tokens,
            "request"
        );
    }
}
