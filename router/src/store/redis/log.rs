//! Background responses' event logs in the shared store: each write of a
//! generating replica (its events, its state, its checkpoint, under its
//! lease), and what readers on any replica read back (its state, its events,
//! a cancel asked).

use super::connection::RedisStore;
use crate::protocols::client_event::ClientEvent;
use crate::store::stored::{StoreError, StoreResult, Stored};
use redis::streams::StreamReadReply;
use redis::AsyncCommands;
use serde_json::Value;

/// A background response as the store has it.
#[derive(Debug, Clone)]
pub struct LogState {
    pub tenant: String,
    pub response: Value,
    pub done: bool,
}

/// Why an append wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Another replica holds the lease: it took the generation over.
    #[error("another replica took the response over")]
    Fenced,
    /// A patch of a checkpoint the store does not have (it lost it): the
    /// writer writes the whole one.
    #[error("the store has no checkpoint to patch")]
    NoCheckpoint,
}

/// A checkpoint as one append writes it.
#[derive(Debug, Clone, Copy)]
pub enum CheckpointWrite<'a> {
    /// The whole checkpoint (JSON), instead of what the store had.
    Whole(&'a str),
    /// Its changes since the last one written (`patch::diff`, JSON).
    Patch(&'a str),
}

/// One write of a background response (`RedisStore::append_write`).
#[derive(Debug, Clone, Copy)]
pub struct Append<'a> {
    /// Its tenant (None: the store has it already).
    pub tenant: Option<&'a str>,
    pub response: AppendResponse<'a>,
    pub done: bool,
    pub checkpoint: Option<CheckpointWrite<'a>>,
    /// What a replica taking it over needs (given once).
    pub origin: Option<&'a Value>,
    /// Its stored response, as it ends.
    pub stored: Option<&'a Stored>,
}

/// The response as one write sets it.
#[derive(Debug, Clone, Copy)]
pub enum AppendResponse<'a> {
    /// The store has it.
    Kept,
    Whole(&'a Value),
    /// The one the write's stored response holds (the same as this): read
    /// there by the script, where it can be.
    Stored(&'a Value),
}

/// Where a stored response's own JSON starts in it as serialized (`Stored`'s
/// first field): `{"response":`.
const STORED_RESPONSE_AT: usize = 12;

/// Most events one read returns.
const READ_COUNT: usize = 512;

impl RedisStore {
    /// Appends `events` of background response `id` (those already there are
    /// skipped), sets its state (its response Null: the last one stays) and
    /// `checkpoint` (None: the last one stays) and `origin` (given once), and
    /// renews the lease `token` holds on it. Returns whether a cancel was
    /// asked for it (on any replica).
    pub async fn append(
        &self,
        id: &str,
        token: &str,
        state: &LogState,
        events: &[ClientEvent],
        checkpoint: Option<CheckpointWrite<'_>>,
        origin: Option<&Value>,
    ) -> Result<bool, AppendError> {
        let write = Append {
            tenant: Some(&state.tenant),
            response: match &state.response {
                Value::Null => AppendResponse::Kept,
                response => AppendResponse::Whole(response),
            },
            done: state.done,
            checkpoint,
            origin,
            stored: None,
        };
        self.append_write(id, token, write, events).await
    }

    /// `append` of `write`: its tenant (None keeps the last), its response,
    /// and, as the response ends, its stored response (as `put_final`), in
    /// the same call.
    pub async fn append_write(
        &self,
        id: &str,
        token: &str,
        write: Append<'_>,
        events: &[ClientEvent],
    ) -> Result<bool, AppendError> {
        // One past the per-response bound is not stored (counted and said
        // by `storable`); its end is written all the same (its log's
        // response, as `GET` then answers it).
        let stored = match write.stored {
            Some(stored) if self.storable(id, stored) => Some(
                serde_json::to_string(stored)
                    .map_err(|err| StoreError::Malformed(err.to_string()))?,
            ),
            _ => None,
        };
        let response = match write.response {
            AppendResponse::Kept => String::new(),
            AppendResponse::Whole(response) => response.to_string(),
            // Its bytes in the stored response, not sent twice (where they
            // are where the script takes them).
            AppendResponse::Stored(response) => match (&stored, write.stored) {
                (Some(text), Some(kept))
                    if text.get(
                        STORED_RESPONSE_AT..STORED_RESPONSE_AT + kept.response.get().len(),
                    ) == Some(kept.response.get()) =>
                {
                    format!("@{}", kept.response.get().len())
                }
                _ => response.to_string(),
            },
        };
        let checkpoint = match write.checkpoint {
            None => String::new(),
            Some(CheckpointWrite::Whole(whole)) => format!("={whole}"),
            Some(CheckpointWrite::Patch(patch)) => format!("+{patch}"),
        };
        // Done, and which of the arguments that follow are given.
        let mut what = String::from(if write.done { "1" } else { "0" });
        let mut given = Vec::new();
        let optional = [
            ('t', write.tenant.map(str::to_string)),
            ('r', (!response.is_empty()).then_some(response)),
            ('o', write.origin.map(Value::to_string)),
            ('s', stored),
        ];
        for (letter, arg) in optional {
            if let Some(arg) = arg {
                what.push(letter);
                given.push(arg);
            }
        }
        let mut invocation = self.scripts.append.prepare_invoke();
        invocation.arg(id).arg(token).arg(checkpoint).arg(what);
        for arg in given {
            invocation.arg(arg);
        }
        for event in events {
            let Some(n) = event.sequence() else {
                continue;
            };
            invocation.arg(n).arg(event.json());
        }
        let answer: i64 = self
            .call("append", async |conn| invocation.invoke_async(conn).await)
            .await?;
        match answer {
            -1 => Err(AppendError::Fenced),
            -2 => Err(AppendError::NoCheckpoint),
            cancelled => Ok(cancelled == 1),
        }
    }

    /// Stores `stored`, the end of background response `id`, while the lease
    /// is `token`'s (as `APPEND`: or none's, and the response not done),
    /// renewing it: the writer that lost it to another replica never
    /// overwrites what that one stores. One larger than a response may be in
    /// the store is not stored (as `put`). The writer sends it with its last
    /// events instead (`append_write`).
    pub async fn put_final(
        &self,
        id: &str,
        token: &str,
        stored: &Stored,
    ) -> Result<(), AppendError> {
        let write = Append {
            tenant: None,
            response: AppendResponse::Kept,
            done: false,
            checkpoint: None,
            origin: None,
            stored: Some(stored),
        };
        self.append_write(id, token, write, &[]).await.map(|_| ())
    }

    /// The sequence number of the last event of background response `id`
    /// (None: none), from its entry id alone (the event itself may be
    /// malformed): what a failure written after it is numbered from.
    pub async fn last_sequence(&self, id: &str) -> StoreResult<Option<u64>> {
        let key = self.key(id, "events");
        let top: redis::streams::StreamRangeReply = self
            .call_bulk("read", async |conn| {
                conn.xrevrange_count(key, "+", "-", 1).await
            })
            .await?;
        Ok(top.ids.first().and_then(|entry| {
            entry
                .id
                .strip_prefix("0-")
                .and_then(|n| n.parse::<u64>().ok())
                .and_then(|n| n.checked_sub(1))
        }))
    }

    /// Background response `id` as the store has it (None: no such one, or
    /// its keys expired).
    pub async fn log_state(&self, id: &str) -> StoreResult<Option<LogState>> {
        let key = self.key(id, "bg");
        let fields: std::collections::HashMap<String, String> = self
            .call_bulk("state", async |conn| conn.hgetall(key).await)
            .await?;
        let (Some(tenant), Some(response)) = (fields.get("tenant"), fields.get("response")) else {
            return Ok(None);
        };
        let response =
            serde_json::from_str(response).map_err(|err| StoreError::Malformed(err.to_string()))?;
        Ok(Some(LogState {
            tenant: tenant.clone(),
            response,
            done: fields.get("done").is_some_and(|d| d == "1"),
        }))
    }

    /// Whether background response `id` is done (None: no such one, or its
    /// keys expired or were deleted): one small field, for readers that poll.
    pub async fn log_done(&self, id: &str) -> StoreResult<Option<bool>> {
        let key = self.key(id, "bg");
        let done: Option<String> = self
            .call_bulk("state", async |conn| conn.hget(key, "done").await)
            .await?;
        Ok(done.map(|d| d == "1"))
    }

    /// Events of background response `id` after sequence number `after` (all,
    /// without one), at most READ_COUNT, as they are now (no wait: readers
    /// poll, all on the bulk connection).
    pub async fn read_events(&self, id: &str, after: Option<u64>) -> StoreResult<Vec<ClientEvent>> {
        // Event n is entry 0-(n+1); nothing can follow the last number
        // (`starting_after=18446744073709551615`: entry 0-u64::MAX is the
        // highest, and the read is exclusive of it).
        let from = after.map_or_else(
            || "0-0".to_string(),
            |n| format!("0-{}", n.saturating_add(1)),
        );
        let options = redis::streams::StreamReadOptions::default().count(READ_COUNT);
        let key = self.key(id, "events");
        let (keys, ids) = ([key], [from]);
        let reply = self
            .call_bulk("read", async |conn| {
                conn.xread_options::<_, _, Option<StreamReadReply>>(&keys, &ids, &options)
                    .await
            })
            .await?;
        let mut events = Vec::new();
        for stream in reply.map(|r| r.keys).unwrap_or_default() {
            for entry in stream.ids {
                match stored_event(&entry) {
                    Ok(event) => events.push(event),
                    // The events before it are had; the next read fails.
                    Err(_) if !events.is_empty() => return Ok(events),
                    Err(err) => return Err(err),
                }
            }
        }
        Ok(events)
    }

    /// Asks the replica generating background response `id` to stop it.
    pub async fn request_cancel(&self, id: &str) -> StoreResult<()> {
        let key = self.key(id, "cancel");
        let ttl = self.ttl_s();
        self.call("cancel", async |conn| conn.set_ex(key, 1u8, ttl).await)
            .await
    }

    /// Whether some replica asked to stop background response `id`.
    pub async fn cancel_requested(&self, id: &str) -> StoreResult<bool> {
        let key = self.key(id, "cancel");
        self.call("cancel", async |conn| conn.exists(key).await)
            .await
    }
}

/// The event a stream entry holds, checked as input: one event (a name for
/// its type, one line of JSON) whose `sequence_number` is the one its entry
/// id says (`0-(n+1)`), so that a reader that goes on after the last number
/// it got always moves forward.
fn stored_event(entry: &redis::streams::StreamId) -> StoreResult<ClientEvent> {
    let malformed = |why: String| StoreError::Malformed(format!("event {}: {why}", entry.id));
    let Some(redis::Value::BulkString(bytes)) = entry.map.get("e") else {
        return Err(malformed("no event".into()));
    };
    let event = ClientEvent::parse(bytes).map_err(|err| malformed(err.to_string()))?;
    let numbered = entry
        .id
        .strip_prefix("0-")
        .and_then(|n| n.parse::<u64>().ok())
        .and_then(|n| n.checked_sub(1));
    match (numbered, event.sequence()) {
        (Some(id), Some(sequence)) if id == sequence => Ok(event),
        (_, sequence) => Err(malformed(format!(
            "its sequence_number ({sequence:?}) is not its place in the log"
        ))),
    }
}
