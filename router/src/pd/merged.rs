//! A stop string that ends inside a merged chunk.
//!
//! vLLM's API server merges several tokens into one stream chunk when it lags
//! behind its engine (often a stream's first tokens). An engine that matches a
//! stop string itself checks after every token, and keeps the token ids up to
//! the one that completed the stop. The router matches the stop strings (see
//! [`crate::protocols::openai::stops`]) on chunks, whose text is not split by token: when a stop
//! ends inside a chunk of several tokens, it asks the decoder's `/detokenize`
//! how much text the output makes through each of the chunk's tokens (a
//! binary search: a few calls, at most once per choice, again only after a
//! resume) and keeps the tokens that reach the stop's end, with their
//! logprobs, and the chunk's text through that end (so that the stop the
//! matcher then finds is the one that ended first, as an engine checking
//! each token finds it). The whole output is detokenized, not the chunk
//! alone: a chunk's text need not start where its tokens do (an engine holds
//! back a character split across tokens until the token that completes it).
//!
//! The chunk keeps all its tokens (the text is cut right either way) when the
//! decoder cannot say in time, or when its tokens' text is not the text the
//! router has (reasoning or tool-call text, skipped special tokens, an echoed
//! prompt): that is checked first, so a mismatch never costs a token.

use super::upstream::{ask_tokenizer, Upstream};
use bytes::Bytes;
use serde_json::{json, Value};
use std::time::Duration;

/// Prompt tokens given to `/detokenize` before the output: a tokenizer joins
/// a token's text to its neighbours' (a leading space), and vLLM's
/// incremental detokenizer starts the output with the prompt's last tokens.
pub const PROMPT_CONTEXT_TOKENS: usize = 8;

/// A chunk of several tokens in which a stop string ends.
#[derive(Debug)]
pub struct Split {
    /// The chunk's event data, as the decoder sent it.
    pub data: Bytes,
    /// Its one choice's index.
    pub index: usize,
    /// Its one choice's token ids.
    pub ids: Vec<u32>,
    /// Characters of the choice's output text before this chunk's text.
    pub before: usize,
    /// Characters of this chunk's text through the stop's end.
    pub through: usize,
    /// Characters of this chunk's text.
    pub length: usize,
}

/// Where the decoder's tokenizer is asked.
pub struct Detokenizer<'a> {
    pub upstream: &'a dyn Upstream,
    pub url: &'a str,
    pub model: &'a str,
    pub timeout: Duration,
}

impl Detokenizer<'_> {
    /// How many of `split`'s tokens an engine checking each token would have
    /// kept: the fewest through which the output's text reaches the stop's
    /// end. `prompt` and `output` are the choice's token ids before the chunk.
    /// `None` when the decoder could not say within the timeout.
    pub async fn tokens_through(
        &self,
        prompt: &[u32],
        output: &[u32],
        split: &Split,
    ) -> Option<usize> {
        let search = self.search(prompt, output, split);
        tokio::time::timeout(self.timeout, search)
            .await
            .ok()
            .flatten()
    }

    async fn search(&self, prompt: &[u32], output: &[u32], split: &Split) -> Option<usize> {
        let prompt = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        let context = self.chars_of(prompt).await?;
        // Characters of the output's text through the chunk's first `through` tokens.
        let output_chars = |through: usize| {
            let ids: Vec<u32> = [prompt, output, &split.ids[..through]].concat();
            async move { Some(self.chars_of(&ids).await?.saturating_sub(context)) }
        };
        // The tokens' text must be the text the router has, or the counts
        // below mean nothing: then every token is kept.
        let all = split.ids.len();
        if output_chars(all).await? != split.before + split.length {
            tracing::debug!(
                "a merged chunk's tokens do not detokenize to the text relayed: all kept"
            );
            return Some(all);
        }
        // The output's text grows with each token: the fewest of the chunk's
        // tokens that reach the stop's end, by bisection (all of them do).
        let end = split.before + split.through;
        let (mut low, mut high) = (1, all);
        while low < high {
            let middle = low + (high - low) / 2;
            if output_chars(middle).await? >= end {
                high = middle;
            } else {
                low = middle + 1;
            }
        }
        Some(low)
    }

    /// Characters of the text of `ids` (vLLM's `/detokenize`).
    async fn chars_of(&self, ids: &[u32]) -> Option<usize> {
        if ids.is_empty() {
            return Some(0);
        }
        #[derive(serde::Deserialize)]
        struct Answer {
            prompt: String,
        }
        let request =
            Bytes::from(serde_json::to_vec(&json!({"model": self.model, "tokens": ids})).ok()?);
        let answer: Answer =
            ask_tokenizer(self.upstream, self.url, "/detokenize", request.into()).await?;
        // Tokens that end inside a character decode to U+FFFD for its bytes so
        // far; an engine's stream holds that character back until it is whole.
        Some(answer.prompt.trim_end_matches('\u{FFFD}').chars().count())
    }
}

/// `data` with its one choice cut to its first `keep` tokens (token ids and
/// logprobs) and its text to its first `chars` characters (the stop's end:
/// the matcher cuts the rest).
pub fn keep_tokens(data: &[u8], keep: usize, chars: usize) -> Option<Bytes> {
    let mut chunk: Value = serde_json::from_slice(data).ok()?;
    let choice = chunk.get_mut("choices")?.get_mut(0)?;
    let text = match choice.get_mut("delta") {
        Some(delta) => delta.get_mut("content"),
        None => choice.get_mut("text"),
    };
    if let Some(Value::String(text)) = text {
        *text = text.chars().take(chars).collect();
    }
    if let Some(ids) = choice.get_mut("token_ids").and_then(Value::as_array_mut) {
        ids.truncate(keep);
    }
    if let Some(logprobs) = choice.get_mut("logprobs").and_then(Value::as_object_mut) {
        // Chat: one entry per token under `content`; completions: parallel
        // arrays, one entry per token each.
        for key in [
            "content",
            "tokens",
            "token_logprobs",
            "top_logprobs",
            "text_offset",
        ] {
            if let Some(list) = logprobs.get_mut(key).and_then(Value::as_array_mut) {
                list.truncate(keep);
            }
        }
    }
    serde_json::to_vec(&chunk).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_tokens_cuts_ids_logprobs_and_text_of_both_routes() {
        let completion = json!({"choices": [{"index": 0, "text": " a b c", "token_ids": [1, 2, 3],
            "logprobs": {"tokens": [" a", " b", " c"], "token_logprobs": [-1.0, -2.0, -3.0],
                "top_logprobs": [{}, {}, {}], "text_offset": [0, 2, 4]}}]});
        let cut = keep_tokens(completion.to_string().as_bytes(), 2, 4).expect("cut");
        let cut: Value = serde_json::from_slice(&cut).expect("JSON");
        let choice = &cut["choices"][0];
        assert_eq!(choice["token_ids"], json!([1, 2]));
        assert_eq!(choice["logprobs"]["tokens"], json!([" a", " b"]));
        assert_eq!(choice["logprobs"]["token_logprobs"], json!([-1.0, -2.0]));
        assert_eq!(choice["logprobs"]["text_offset"], json!([0, 2]));
        assert_eq!(choice["text"], " a b", "through the stop's end");
        let chat = json!({"choices": [{"index": 0, "delta": {"content": "xy"}, "token_ids": [7, 8],
            "logprobs": {"content": [{"token": "x"}, {"token": "y"}]}}]});
        let cut = keep_tokens(chat.to_string().as_bytes(), 1, 1).expect("cut");
        let cut: Value = serde_json::from_slice(&cut).expect("JSON");
        assert_eq!(cut["choices"][0]["token_ids"], json!([7]));
        assert_eq!(cut["choices"][0]["delta"]["content"], "x");
        assert_eq!(
            cut["choices"][0]["logprobs"]["content"],
            json!([{"token": "x"}])
        );
    }
}
