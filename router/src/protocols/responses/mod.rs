//! OpenAI's Responses API (`/v1/responses`) on the router's chat path.
//!
//! A request is translated to a chat completion (`request.rs`): its input
//! items (and, with `previous_response_id`, the stored conversation before
//! them) become chat messages, its tools chat tools. The chat runs through
//! prefill and decode like any other, resumed on a decoder failure; its
//! answer becomes output items (`output.rs`), or its stream Responses events
//! with sequence numbers (`stream.rs`). Responses are kept in a bounded store
//! (`store.rs`) unless `store: false`, so the next turn can be served by any
//! prefill and decoder: in this process, or in Redis, which every replica
//! shares (`redis_store.rs`; a background response's events are copied
//! there as they come, `mirror.rs`).

pub mod limits;
pub mod live;
pub mod mirror;
pub mod output;
pub mod patch;
pub mod redis_store;
pub mod renewal;
pub mod request;
pub mod store;
pub mod stream;

/// Where the router keeps responses: what `/v1/responses/{id}` reads, and
/// what a response's translation writes when it ends.
pub struct ResponseStores {
    /// Stored responses: the conversations behind `previous_response_id`,
    /// whatever engines serve the next turn (in memory, or `shared`).
    pub stored: std::sync::Arc<dyn store::ResponseStore>,
    /// This replica's background responses' event logs
    /// (`--max-background-responses`).
    pub live: live::LiveResponses,
    /// The store every replica shares (`--response-store`), which is also
    /// `stored`: other replicas' background responses are read there.
    pub shared: Option<std::sync::Arc<redis_store::RedisStore>>,
}

/// A new item or response id with its OpenAI prefix.
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}
