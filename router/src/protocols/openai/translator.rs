//! A client protocol made from the chat completion the router runs for it
//! (Responses, Messages), fed each chat chunk as the relay journals it: the
//! chunk is parsed once, for the journal and the translation alike, and a
//! resumed chat goes on in the client's protocol as it goes on in chat's.

use super::chunk::Chunk;
use crate::error::ApiError;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde_json::Value;

/// What the relay feeds one request's translation through (the one
/// implementation is `background::translation::TranslationDriver`).
pub trait Translator: Send {
    /// What the client gets before the first chunk.
    fn start(&mut self) -> Option<Bytes>;
    /// What the client gets of one chat chunk (one with choices; its text is
    /// `text()`, whichever route the decoder served).
    fn chunk(&mut self, chunk: &Chunk<'_>) -> Option<Bytes>;
    /// The chat ended (`usage`: the router's count); what must be kept
    /// before the last bytes go out (a stored response, so that a client
    /// that read them can at once continue from it).
    fn finish(&mut self, usage: Value) -> Option<BoxFuture<'static, ()>>;
    /// The chat failed and cannot go on.
    fn fail(&mut self, error: &ApiError);
    /// The last bytes, once `finish`'s keeping is done (or after `fail`).
    fn last(&mut self) -> Option<Bytes>;
}

/// (The client's output, which holds one, is `Debug`.)
impl std::fmt::Debug for dyn Translator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Translator")
    }
}
