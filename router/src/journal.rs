//! The journal: per-request state of every request in flight.
//!
//! It records what a resume needs (the prefill's `kv_transfer_params`, the prompt
//! token ids, the tokens and text generated so far, the decoder and the attempt),
//! and is what `GET /admin/requests` shows. An entry lives as long as its
//! [`JournalHandle`], which the request flow owns.

use crate::holds::Hold;
use dashmap::DashMap;
use serde::Serialize;
use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The state of one request.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub request_id: String,
    pub route: &'static str,
    pub model: String,
    pub stream: bool,
    pub phase: &'static str,
    pub prefill: Option<String>,
    pub decoder: Option<String>,
    pub attempt: u32,
    /// Resumes so far, and the cause of each.
    pub resumes: u32,
    pub causes: Vec<&'static str>,
    pub kv_transfer_params: Option<Value>,
    /// The resume epoch of the latest attempt.
    pub epoch: u64,
    /// The hold named by `kv_transfer_params`, and when it was last renewed.
    #[serde(skip)]
    pub hold: Option<(Hold, Instant)>,
    pub prompt_token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<String>,
    #[serde(skip)]
    pub started: Option<Instant>,
}

/// All requests in flight.
#[derive(Debug, Default)]
pub struct Journal {
    /// Keyed by a sequence number: clients may reuse an `X-Request-Id`.
    entries: DashMap<u64, Arc<Mutex<Entry>>>,
    next_key: std::sync::atomic::AtomicU64,
}

impl Journal {
    /// Opens an entry; it is removed when the returned handle drops.
    pub fn open(
        self: &Arc<Self>,
        request_id: &str,
        route: &'static str,
        model: &str,
        stream: bool,
    ) -> JournalHandle {
        let entry = Arc::new(Mutex::new(Entry {
            request_id: request_id.to_string(),
            route,
            model: model.to_string(),
            stream,
            phase: "prefill",
            prefill: None,
            decoder: None,
            attempt: 0,
            resumes: 0,
            causes: Vec::new(),
            kv_transfer_params: None,
            epoch: 0,
            hold: None,
            prompt_token_ids: Vec::new(),
            generated_token_ids: Vec::new(),
            text: String::new(),
            finish_reason: None,
            started: Some(Instant::now()),
        }));
        let key = self
            .next_key
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.entries.insert(key, entry.clone());
        JournalHandle {
            journal: self.clone(),
            key,
            entry,
        }
    }

    /// A JSON view of every entry; prompt contents only when `verbose`.
    pub fn view(&self, verbose: bool) -> Vec<Value> {
        let mut out: Vec<Value> = self
            .entries
            .iter()
            .map(|e| {
                let entry = e.value().lock().unwrap_or_else(|p| p.into_inner());
                let mut value = serde_json::to_value(&*entry).unwrap_or(Value::Null);
                value["prompt_tokens"] = entry.prompt_token_ids.len().into();
                value["generated_tokens"] = entry.generated_token_ids.len().into();
                value["age_ms"] = entry
                    .started
                    .map(|s| s.elapsed().as_millis() as u64)
                    .unwrap_or(0)
                    .into();
                if !verbose {
                    if let Some(map) = value.as_object_mut() {
                        for key in ["prompt_token_ids", "generated_token_ids", "text"] {
                            map.remove(key);
                        }
                    }
                }
                value
            })
            .collect();
        out.sort_by(|a, b| a["request_id"].as_str().cmp(&b["request_id"].as_str()));
        out
    }

    /// The holds of running requests that are due for renewal (half their lease
    /// since the last renewal), with the epoch to renew at; marks them renewed.
    pub fn holds_to_renew(&self, now: Instant) -> Vec<(Hold, u32)> {
        let mut due = Vec::new();
        for entry in self.entries.iter() {
            let mut entry = entry.value().lock().unwrap_or_else(|p| p.into_inner());
            let epoch = u32::try_from(entry.epoch).unwrap_or(u32::MAX);
            if let Some((hold, renewed)) = &mut entry.hold {
                if now.duration_since(*renewed) >= hold.lease / 2 {
                    *renewed = now;
                    due.push((hold.clone(), epoch));
                }
            }
        }
        due
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Owner of one journal entry.
#[derive(Debug)]
pub struct JournalHandle {
    journal: Arc<Journal>,
    key: u64,
    entry: Arc<Mutex<Entry>>,
}

impl JournalHandle {
    /// Records the hold the request now uses.
    pub fn set_hold(&self, kv_transfer_params: &Value) {
        let hold = Hold::from_params(kv_transfer_params).map(|h| (h, Instant::now()));
        self.update(|e| {
            e.kv_transfer_params = Some(kv_transfer_params.clone());
            e.hold = hold;
        });
    }

    /// Changes the entry.
    pub fn update<R>(&self, change: impl FnOnce(&mut Entry) -> R) -> R {
        change(&mut self.entry.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Drop for JournalHandle {
    fn drop(&mut self) {
        self.journal.entries.remove(&self.key);
    }
}
