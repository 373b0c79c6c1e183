//! OpenAI's Responses API (`/v1/responses`) on the router's chat path.
//!
//! A request is translated to a chat completion (`request.rs`): its input
//! items (and, with `previous_response_id`, the stored conversation before
//! them) become chat messages, its tools chat tools. The chat runs through
//! prefill and decode like any other, resumed on a decoder failure; its
//! answer becomes output items (`output.rs`), or its stream Responses events
//! with sequence numbers (`stream.rs`). Where responses are kept between
//! turns is the router's state, not a wire format: `store/`.

pub mod limits;
pub mod output;
pub mod request;
pub mod stream;

/// Whether `id` may be a response id: a client's (in a path or
/// `previous_response_id`) or one read back from the shared store (the
/// running set), before it names a key: 1 to 128 ASCII letters, digits, `_`
/// and `-`, as the ids this router makes (`resp_` and 32 hex digits) are.
/// Nothing else can be a response, and nothing else goes into a key name
/// (where a `}` or `:` would name another key).
pub fn valid_response_id(id: &str) -> bool {
    (1..=MAX_RESPONSE_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Most bytes of a response id (`valid_response_id`).
pub const MAX_RESPONSE_ID: usize = 128;

/// A new item or response id with its OpenAI prefix.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}
