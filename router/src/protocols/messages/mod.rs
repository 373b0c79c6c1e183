//! Anthropic's Messages API (`/v1/messages`) on the router's chat path: a
//! request becomes a chat completion (`request.rs`), run through prefill and
//! decode (resumed like any chat), and its stream becomes Messages events or
//! one message (`stream.rs`). Errors on the route are in Anthropic's shape
//! (`crate::error::ApiError::anthropic_body`).

pub mod request;
pub mod stream;
