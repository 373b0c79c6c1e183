//! The journal: the one record of every request in flight.
//!
//! The relay writes it (each choice's token ids, text and finish as they reach
//! the client); resume reads it (what to continue from); `GET /admin/requests`
//! shows it. It records the prefill's `kv_transfer_params`, the prompt token ids,
//! the decoder and the attempt. An entry lives as long as its [`JournalHandle`],
//! which the request flow owns.
//!
//! The journal knows nothing of holds: their renewal is the hold keeper's
//! (`pd/holds/`), which tracks each request's lease itself.

use dashmap::DashMap;
use serde::Serialize;
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Waiting for the prefill's answer.
    Prefill,
    /// Streaming from a decoder (or opening one).
    Decode,
    /// The hold was lost: prefilling prompt + generated again.
    Reprefill,
    Finished,
    Failed,
}

/// What one choice produced so far, as the client has it.
#[derive(Debug, Default, Clone, Serialize)]
pub struct ChoiceProgress {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// How many of `token_ids` each chunk brought, in order: a chat
    /// continuation replays the engine's reasoning and tool parsers over the
    /// same chunks (`pd::derender`).
    #[serde(skip)]
    pub chunk_lens: Vec<u32>,
    /// The ids of the tool calls the client has, by call index: a
    /// continuation keeps them.
    #[serde(skip)]
    pub tool_call_ids: Vec<String>,
    /// Whether the engine's chat parsers made reasoning or tool calls of
    /// this choice's tokens (a continuation must go through them again).
    #[serde(skip)]
    pub parsed_output: bool,
    pub finish_reason: Option<String>,
    #[serde(skip)]
    pub stop_reason: Option<Value>,
}

/// The state of one request.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub request_id: String,
    pub route: &'static str,
    pub model: String,
    pub stream: bool,
    pub phase: Phase,
    pub prefill: Option<String>,
    pub decoder: Option<String>,
    /// Every decoder that served the request, in order.
    pub decoders: Vec<String>,
    pub attempt: u32,
    /// Resumes so far, and the cause of each.
    pub resumes: u32,
    pub causes: Vec<&'static str>,
    pub kv_transfer_params: Option<Value>,
    /// The resume epoch of the latest attempt.
    pub epoch: u64,
    pub prompt_token_ids: Vec<u32>,
    /// Every choice of the request (one unless `n > 1`).
    #[serde(skip)]
    pub choices: Vec<ChoiceProgress>,
    #[serde(skip)]
    pub started: Option<Instant>,
    /// Arrival (of the request at the router) to its first token.
    #[serde(skip)]
    pub ttft: Option<Duration>,
}

impl Entry {
    /// Tokens generated so far, over all choices.
    pub fn generated(&self) -> usize {
        self.choices.iter().map(|c| c.token_ids.len()).sum()
    }

    /// Whether every choice has its finish_reason.
    pub fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish_reason.is_some())
    }
}

/// All requests in flight.
#[derive(Debug, Default)]
pub struct Journal {
    /// Keyed by a sequence number: clients may reuse an `X-Request-Id`.
    entries: DashMap<u64, Arc<Mutex<Entry>>>,
    next_key: AtomicU64,
}

impl Journal {
    /// Opens an entry for a request of `choices` choices; it is removed when the
    /// returned handle drops.
    #[cfg(test)]
    pub fn open(
        self: &Arc<Self>,
        request_id: &str,
        route: &'static str,
        model: &str,
        stream: bool,
        choices: usize,
    ) -> JournalHandle {
        self.open_at(request_id, route, model, stream, choices, Instant::now())
    }

    /// [`Journal::open`] for a request that arrived at `started`.
    pub fn open_at(
        self: &Arc<Self>,
        request_id: &str,
        route: &'static str,
        model: &str,
        stream: bool,
        choices: usize,
        started: Instant,
    ) -> JournalHandle {
        let entry = Arc::new(Mutex::new(Entry {
            request_id: request_id.to_string(),
            route,
            model: model.to_string(),
            stream,
            phase: Phase::Prefill,
            prefill: None,
            decoder: None,
            decoders: Vec::new(),
            attempt: 0,
            resumes: 0,
            causes: Vec::new(),
            kv_transfer_params: None,
            epoch: 0,
            prompt_token_ids: Vec::new(),
            choices: vec![ChoiceProgress::default(); choices.max(1)],
            started: Some(started),
            ttft: None,
        }));
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        self.entries.insert(key, entry.clone());
        JournalHandle {
            journal: self.clone(),
            key,
            entry,
        }
    }

    /// A JSON view of every entry; prompt and generated contents only when
    /// `verbose`.
    pub fn view(&self, verbose: bool) -> Vec<Value> {
        let mut out: Vec<Value> = self
            .entries
            .iter()
            .map(|e| {
                view_entry(
                    &e.value().lock().unwrap_or_else(|p| p.into_inner()),
                    verbose,
                )
            })
            .collect();
        out.sort_by(|a, b| a["request_id"].as_str().cmp(&b["request_id"].as_str()));
        out
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn view_entry(entry: &Entry, verbose: bool) -> Value {
    let mut value = serde_json::to_value(entry).unwrap_or(Value::Null);
    value["prompt_tokens"] = entry.prompt_token_ids.len().into();
    value["generated_tokens"] = entry.generated().into();
    value["finish_reason"] = entry
        .choices
        .first()
        .and_then(|c| c.finish_reason.clone())
        .into();
    value["age_ms"] = entry
        .started
        .map(|s| s.elapsed().as_millis() as u64)
        .unwrap_or(0)
        .into();
    if let Some(map) = value.as_object_mut() {
        if verbose {
            let first = entry.choices.first().cloned().unwrap_or_default();
            map.insert("generated_token_ids".into(), first.token_ids.into());
            map.insert("text".into(), first.text.into());
        } else {
            map.remove("prompt_token_ids");
        }
    }
    value
}

/// Owner of one journal entry.
#[derive(Debug)]
pub struct JournalHandle {
    journal: Arc<Journal>,
    key: u64,
    entry: Arc<Mutex<Entry>>,
}

impl JournalHandle {
    /// Changes the entry.
    pub fn update<R>(&self, change: impl FnOnce(&mut Entry) -> R) -> R {
        change(&mut self.entry.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Reads the entry.
    pub fn read<R>(&self, read: impl FnOnce(&Entry) -> R) -> R {
        read(&self.entry.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn set_phase(&self, phase: Phase) {
        self.update(|e| e.phase = phase);
    }

    /// A reader of the entry that outlives the handle (and the entry's place
    /// in the journal): what the request's record reads at its very end.
    pub fn reader(&self) -> EntryReader {
        EntryReader(self.entry.clone())
    }
}

/// Reads one entry, after its request left the journal too.
#[derive(Debug, Clone)]
pub struct EntryReader(Arc<Mutex<Entry>>);

impl EntryReader {
    pub fn read<R>(&self, read: impl FnOnce(&Entry) -> R) -> R {
        read(&self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Drop for JournalHandle {
    fn drop(&mut self) {
        self.journal.entries.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_lives_as_long_as_its_handle_and_shows_its_phase() {
        let journal = Arc::new(Journal::default());
        let handle = journal.open("r1", "/v1/completions", "m", true, 1);
        handle.update(|e| {
            e.phase = Phase::Decode;
            e.choices[0].token_ids.extend([1, 2]);
            e.choices[0].text.push_str("ab");
        });
        let view = journal.view(true);
        assert_eq!(view[0]["phase"], "decode");
        assert_eq!(view[0]["generated_tokens"], 2);
        assert_eq!(view[0]["generated_token_ids"], serde_json::json!([1, 2]));
        assert_eq!(view[0]["text"], "ab");
        assert!(journal.view(false)[0].get("text").is_none());
        drop(handle);
        assert!(journal.is_empty());
    }
}
