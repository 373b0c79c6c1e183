//! The mock "model": a byte-level tokenizer, a chat template and a next-token
//! function that depends only on the whole context (prompt ids + generated ids).
//!
//! Because the next token is a pure function of the context, any decoder that is
//! handed a prompt plus the tokens generated so far continues exactly where the
//! previous one stopped. That property is what lets the end-to-end tests prove
//! that a resumed stream equals an uninterrupted one.

use serde_json::Value;

/// Size of the mock vocabulary. Ids below 256 are raw bytes (prompts); generated
/// ids are always at or above [`FIRST_WORD_ID`] so they detokenize to words.
pub const VOCAB_SIZE: u32 = 32_000;
/// First id the model generates.
pub const FIRST_WORD_ID: u32 = 256;

/// Running hash of a context. Absorbing the same ids always gives the same state,
/// however the context was split between prefill, decode and resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextHash(u64);

impl Default for ContextHash {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl ContextHash {
    /// A context hash over `ids`.
    pub fn of(ids: &[u32]) -> Self {
        let mut hash = Self::default();
        for &id in ids {
            hash.absorb(id);
        }
        hash
    }

    /// Appends one token to the context.
    pub fn absorb(&mut self, id: u32) {
        for byte in id.to_le_bytes() {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// The token the model produces after this context.
    pub fn next_token(&self) -> u32 {
        // splitmix64 finaliser: spreads the FNV state over the vocabulary.
        let mut z = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        FIRST_WORD_ID + (z % u64::from(VOCAB_SIZE - FIRST_WORD_ID)) as u32
    }
}

/// The end-of-sequence token (`--eos-after-tokens`): a control byte no text
/// prompt has, whose text is empty (vLLM skips special tokens' text).
pub const EOS_ID: u32 = 2;

/// Generates `count` tokens after `context`, the reference any test compares to.
pub fn generate(context: &[u32], count: usize) -> Vec<u32> {
    let mut hash = ContextHash::of(context);
    (0..count)
        .map(|_| {
            let token = hash.next_token();
            hash.absorb(token);
            token
        })
        .collect()
}

/// Whether a generated token is the first part of a character split across two
/// tokens, as a byte-level BPE model splits a multi-byte character: a stream
/// sends its text only with the next token's (vLLM's detokenizer holds back an
/// incomplete UTF-8 sequence), and a decoder handed it as the last token of its
/// prompt never sends that text at all. One generated token in five.
pub fn is_split(id: u32) -> bool {
    id >= FIRST_WORD_ID && id % 5 == 0
}

/// Byte-level tokenization of prompt text.
pub fn tokenize(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// This model's tokenizer as a Hugging Face `tokenizer.json` (what a router
/// given `--tokenizer mock=PATH` loads): byte-level, one token per byte, the
/// byte's value its id, as [`tokenize`]. The byte-level pre-tokenizer splits
/// the text into words with GPT-2's pattern, as real byte-level tokenizers do
/// (without it a whole prompt is one word, and its BPE costs a millisecond per
/// 2 k characters that no cache spares), and maps each byte to a printable
/// character (GPT-2's table); the vocabulary maps that character back to the
/// byte, and no merges join them.
pub fn tokenizer_json() -> Value {
    let vocab: serde_json::Map<String, Value> = (0..=255u8)
        .map(|byte| (byte_char(byte).to_string(), Value::from(byte)))
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": true});
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []},
    })
}

/// GPT-2's printable character for `byte` (the byte-level pre-tokenizer's
/// table): printable Latin-1 bytes stand for themselves, the others are
/// numbered from U+0100 in byte order.
fn byte_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let rank = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + rank).unwrap_or('?')
}

/// Text of one token.
pub fn token_text(id: u32) -> String {
    if id == EOS_ID {
        String::new()
    } else if id < FIRST_WORD_ID {
        // Prompt bytes are not valid UTF-8 one by one; show them as-is when ASCII.
        char::from_u32(id).map(String::from).unwrap_or_default()
    } else {
        format!(" w{id}")
    }
}

/// Text of a run of tokens.
pub fn detokenize(ids: &[u32]) -> String {
    ids.iter().map(|&id| token_text(id)).collect()
}

/// Renders chat messages into the prompt text the model sees.
///
/// Returns `None` when `messages` is not a list of objects with a string `role`.
pub fn apply_chat_template(messages: &Value) -> Option<String> {
    let mut prompt = String::new();
    for message in messages.as_array()? {
        let role = message.get("role")?.as_str()?;
        prompt.push_str("<|");
        prompt.push_str(role);
        prompt.push_str("|>");
        prompt.push_str(&message_text(message.get("content")));
        prompt.push('\n');
    }
    prompt.push_str("<|assistant|>");
    Some(prompt)
}

/// The text of a message's `content`: a string or a list of `{type: text}` parts.
fn message_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuation_from_any_split_is_identical() {
        let prompt = tokenize("hello world");
        let full = generate(&prompt, 50);
        for split in [0, 1, 17, 49] {
            let mut context = prompt.clone();
            context.extend_from_slice(&full[..split]);
            assert_eq!(generate(&context, 50 - split), full[split..]);
        }
    }

    #[test]
    fn generated_ids_are_words() {
        let ids = generate(&tokenize("x"), 200);
        assert!(ids
            .iter()
            .all(|&id| (FIRST_WORD_ID..VOCAB_SIZE).contains(&id)));
        assert!(detokenize(&ids[..2]).starts_with(" w"));
    }

    #[test]
    fn chat_template_renders_roles() {
        let messages = serde_json::json!([{"role":"user","content":"hi"}]);
        assert_eq!(
            apply_chat_template(&messages).as_deref(),
            Some("<|user|>hi\n<|assistant|>")
        );
        assert_eq!(apply_chat_template(&serde_json::json!("x")), None);
    }
}
