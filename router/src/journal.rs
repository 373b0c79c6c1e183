//! The journal: per-request state of every request in flight.
//!
//! It records what a resume needs (the prefill's `kv_transfer_params`, the prompt
//! token ids, the tokens and text generated so far, the decoder and the attempt),
//! and is what `GET /admin/requests` shows. An entry lives as long as its
//! [`JournalHandle`], which the request flow owns.

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
    entries: DashMap<String, Arc<Mutex<Entry>>>,
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
            prompt_token_ids: Vec::new(),
            generated_token_ids: Vec::new(),
            text: String::new(),
            finish_reason: None,
            started: Some(Instant::now()),
        }));
        self.entries.insert(request_id.to_string(), entry.clone());
        JournalHandle {
            journal: self.clone(),
            id: request_id.to_string(),
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
    id: String,
    entry: Arc<Mutex<Entry>>,
}

impl JournalHandle {
    /// Changes the entry.
    pub fn update<R>(&self, change: impl FnOnce(&mut Entry) -> R) -> R {
        change(&mut self.entry.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Drop for JournalHandle {
    fn drop(&mut self) {
        self.journal.entries.remove(&self.id);
    }
}
