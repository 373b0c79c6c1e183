//! A request's decode progress as another router replica needs it to take the
//! generation over (a background response whose replica died): the hold it
//! pulls from, the prompt ids, and what the client has of the one choice
//! (token ids, their chunking and the tool call ids, which the continuation's
//! parsers are rebuilt from, `derender.rs`). The replica that takes over
//! continues exactly as a decoder-failure resume does, from these tokens.

use crate::journal::{ChoiceProgress, Entry};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DecodeCheckpoint {
    /// The prefill instance holding the prompt's KV.
    pub prefill: String,
    pub kv_transfer_params: Value,
    pub prompt_token_ids: Vec<u32>,
    /// The resume epoch of the attempt the checkpoint was taken in.
    pub epoch: u64,
    pub choice: ChoiceState,
}

/// `ChoiceProgress` whole (the journal's view leaves fields out).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChoiceState {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub chunk_lens: Vec<u32>,
    pub tool_call_ids: Vec<String>,
    pub parsed_output: bool,
    pub finish_reason: Option<String>,
    pub stop_reason: Option<Value>,
}

impl DecodeCheckpoint {
    /// The checkpoint of `entry`: None before its prefill answered, or for a
    /// request of several choices (the protocols taken over have one).
    pub fn of(entry: &Entry) -> Option<Self> {
        let [choice] = entry.choices.as_slice() else {
            return None;
        };
        Some(Self {
            prefill: entry.prefill.clone()?,
            kv_transfer_params: entry.kv_transfer_params.clone()?,
            prompt_token_ids: entry.prompt_token_ids.clone(),
            epoch: entry.epoch,
            choice: ChoiceState {
                text: choice.text.clone(),
                token_ids: choice.token_ids.clone(),
                chunk_lens: choice.chunk_lens.clone(),
                tool_call_ids: choice.tool_call_ids.clone(),
                parsed_output: choice.parsed_output,
                finish_reason: choice.finish_reason.clone(),
                stop_reason: choice.stop_reason.clone(),
            },
        })
    }
}

impl From<ChoiceState> for ChoiceProgress {
    fn from(c: ChoiceState) -> Self {
        ChoiceProgress {
            text: c.text,
            token_ids: c.token_ids,
            chunk_lens: c.chunk_lens,
            tool_call_ids: c.tool_call_ids,
            parsed_output: c.parsed_output,
            finish_reason: c.finish_reason,
            stop_reason: c.stop_reason,
        }
    }
}
