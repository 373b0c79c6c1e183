//! Generation that runs apart from a client's request: the translation
//! driver every translated route feeds from the relay, background responses
//! run to their end, their mirror into the shared store, and the takeover of
//! another replica's background responses. Above `pd/` (it runs chats
//! through `pd::run` and `pd::continue_from`) and `store/` (it keeps what
//! they make); below `edge/`, which only starts them and answers.
//!
//! - `translation.rs`: a client protocol's `Translation` of a chat and the
//!   driver that writes its events where they go.
//! - `response_translation.rs`: the Responses protocol's translation (its
//!   stored response kept as it ends).
//! - `run.rs`: a background response driven to its end, checkpointed.
//! - `mirror.rs`: its events and checkpoints copied into the shared store
//!   under a lease.
//! - `takeover.rs`: expired leases claimed, another replica's generation
//!   continued from its last checkpoint.

pub mod mirror;
pub mod response_translation;
pub mod run;
pub mod takeover;
pub mod translation;
