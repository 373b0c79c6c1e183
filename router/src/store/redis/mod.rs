//! The response store every router replica shares: Redis (`--response-store
//! redis://...`). Stored responses, and each background response's event log,
//! live there, so that any replica answers `GET /v1/responses/{id}` (and its
//! `?stream=true&starting_after=N`), `previous_response_id`, `DELETE` and
//! `cancel`, whichever replica made the response.
//!
//! Keys (each with the store's TTL, so that nothing outlives it, renewed for
//! every key of a running response, `store/renewal.rs`; a delete removes them all,
//! `RESPONSE_KEYS`; one Redis
//! or a Sentinel-managed primary: the scripts touch a response's keys and the
//! set of running ones together, which Redis Cluster does not allow):
//! - `PREFIX{ID}:stored`: the stored response and its conversation (JSON).
//! - `PREFIX{ID}:bg`: a background response's tenant, response as it stands,
//!   and whether it is done (a hash).
//! - `PREFIX{ID}:events`: its events, a Redis Stream whose entry ids are
//!   `0-(sequence_number + 1)`: any replica reads after any sequence number
//!   (`XREAD` is exclusive of the id given) and blocks for the live tail.
//! - `PREFIX{ID}:cancel`: set by a `cancel` on any replica; the replica
//!   generating the response polls it.
//! - `PREFIX{ID}:origin`: the request as translated (the chat, the tenant,
//!   the conversation), and `PREFIX{ID}:checkpoint`: the generation's
//!   progress as of the last events written (`pd::checkpoint`, and the
//!   Responses events' state), written with them: what another replica
//!   continues from. A list: the checkpoint whole, then what changed since,
//!   one patch per write (`store/patch.rs`; each write sends only its changes).
//! - `PREFIX{ID}:lease`: the generating replica's claim (a token of its own,
//!   renewed with every write, `--response-lease`), and `PREFIXrunning`:
//!   the ids of running responses by lease expiry. A replica whose lease was
//!   taken can no longer write (its appends are fenced by the token).
//!
//! What is read back is input: events are checked (`stored_event`), and
//! a checkpoint's hold is checked before a takeover uses it
//! (`pd::checked_hold`).
//!
//! Redis down (or full: writes refused, counted apart): what a replica stores goes to its own memory (found again by
//! it alone, never by another), every call is bounded by the store's timeout,
//! and `/ready` says `response_store: unavailable`; serving goes on.
//!
//! One job per module: `settings.rs` (how to reach it), `connection.rs`
//! (`RedisStore`: connections, bounded calls, up or full), `scripts.rs` (the
//! Lua scripts), `stored.rs` (stored responses, deletes), `log.rs` (event
//! logs: appends and reads), `lease.rs` (leases, the running set),
//! `checkpoint.rs` (what a takeover reads back).

mod checkpoint;
mod connection;
mod lease;
mod log;
mod scripts;
mod settings;
mod stored;

pub use checkpoint::{checkpoint_of, Taken};
pub use connection::RedisStore;
pub use lease::lease_token;
pub use log::{Append, AppendError, AppendResponse, CheckpointWrite, LogState};
pub use settings::{RedisSettings, RedisSetupError};
