//! The router's own state: the responses it keeps between turns and while
//! they run in the background, in this process or in the store every replica
//! shares. Persistence only: nothing here runs a generation (`background/`
//! does, above `pd/`), so any layer that keeps or reads a response may use it.
//!
//! - `stored.rs`: a stored response and the `ResponseStore` trait;
//!   `memory.rs` the bounded in-memory store (one replica).
//! - `live.rs`: this replica's background responses' event logs.
//! - `redis/`: the store every replica shares (`--response-store`): stored
//!   responses, event logs as Redis Streams, leases and checkpoints.
//! - `patch.rs`: a checkpoint's changes since the last one, as the writer
//!   sends them; `renewal.rs`: the task that keeps running responses' keys
//!   alive.

pub mod live;
pub mod memory;
pub mod patch;
pub mod redis;
pub mod renewal;
pub mod stored;

/// Where the router keeps responses: what `/v1/responses/{id}` reads, and
/// what a response's translation writes when it ends.
pub struct ResponseStores {
    /// Stored responses: the conversations behind `previous_response_id`,
    /// whatever engines serve the next turn (in memory, or `shared`).
    pub stored: std::sync::Arc<dyn stored::ResponseStore>,
    /// This replica's background responses' event logs
    /// (`--max-background-responses`).
    pub live: live::LiveResponses,
    /// The store every replica shares (`--response-store`), which is also
    /// `stored`: other replicas' background responses are read there.
    pub shared: Option<std::sync::Arc<redis::RedisStore>>,
}
