//! What the engine saw: one record per generation request, for tests and the demo.

use serde::Serialize;
use serde_json::Value;
use std::sync::Mutex;

/// How a request ended on this engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Running,
    Completed,
    /// The client went away before the end (router abort or disconnect).
    Aborted,
    Failed,
}

/// One generation request as the engine received it.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub path: String,
    pub request_id: Option<String>,
    /// The W3C `traceparent` (and `tracestate`) the call carried.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    pub body: Value,
    pub outcome: Outcome,
    pub tokens_emitted: u32,
    /// Prompt tokens this engine computed itself (not pulled from a hold).
    pub computed_prompt_tokens: usize,
    /// KV bytes pulled from a prefill's hold (and verified) for this request.
    pub pulled_bytes: u64,
}

/// A request body as recorded: each string longer than `max` bytes stands as
/// `"<N bytes>"`, so that `/mock/stats` of an engine that served bodies of
/// tens of MB is not tens of MB itself (a debug build serving and a test
/// parsing 120 MB of records under load took longer than the test's client
/// allows).
pub fn recorded(body: &Value, max: Option<usize>) -> Value {
    let Some(max) = max else {
        return body.clone();
    };
    match body {
        Value::String(s) if s.len() > max => Value::String(format!("<{} bytes>", s.len())),
        Value::Array(items) => Value::Array(items.iter().map(|v| recorded(v, Some(max))).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), recorded(v, Some(max))))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Bounded log of request records.
#[derive(Debug, Default)]
pub struct RequestLog {
    records: Mutex<Vec<RequestRecord>>,
}

impl RequestLog {
    /// Appends a record and returns its index, dropping it when the log is full.
    pub fn push(&self, record: RequestRecord, max: usize) -> Option<usize> {
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if records.len() >= max {
            return None;
        }
        records.push(record);
        Some(records.len() - 1)
    }

    /// Updates record `index` in place.
    pub fn update(&self, index: Option<usize>, change: impl FnOnce(&mut RequestRecord)) {
        let Some(index) = index else { return };
        let mut records = self.records.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(record) = records.get_mut(index) {
            change(record);
        }
    }

    /// A copy of every record.
    pub fn snapshot(&self) -> Vec<RequestRecord> {
        self.records
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}
