//! The relay's output when the client's protocol is not chat's own
//! (Responses, Messages): the relay feeds it each chat chunk as it journals
//! it, so the chunk is parsed once, for the journal and the translation
//! alike, and a resumed chat goes on in the client's protocol as it goes on
//! in chat's. (What each protocol makes of the chunks is its `Translation`,
//! `background/translation.rs`; one request's run of it, the
//! `TranslationDriver` there, is the one implementation of this.)

use super::chunk::Chunk;
use crate::error::ApiError;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use serde_json::Value;

/// What the relay writes a translated client's output through: fed the
/// chat's chunks and its end, it gives the client's bytes.
pub trait TranslatedOutput: Send {
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
impl std::fmt::Debug for dyn TranslatedOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TranslatedOutput")
    }
}
