//! What a replica taking a background response over reads back: its state,
//! its origin, its last checkpoint (the whole one with its patches applied)
//! and its events.

use super::connection::RedisStore;
use super::log::LogState;
use crate::protocols::client_event::ClientEvent;
use crate::store::stored::{StoreError, StoreResult};
use redis::AsyncCommands;
use serde_json::Value;

/// What a replica that takes a background response over starts from.
#[derive(Debug)]
pub struct Taken {
    pub state: LogState,
    /// What the generating replica wrote once, at the start (`publish`).
    pub origin: Value,
    /// The last checkpoint (with the last events written).
    pub checkpoint: Option<Value>,
    pub events: Vec<ClientEvent>,
}

impl RedisStore {
    /// What a replica that won background response `id` continues from.
    pub async fn taken(&self, id: &str) -> StoreResult<Option<Taken>> {
        let Some(state) = self.log_state(id).await? else {
            return Ok(None);
        };
        let origin_key = self.key(id, "origin");
        let origin: Option<String> = self
            .call_bulk("taken", async |conn| conn.get(origin_key).await)
            .await?;
        let checkpoint = self.read_checkpoint(id).await?;
        let parse = |text: String| {
            serde_json::from_str::<Value>(&text)
                .map_err(|err| StoreError::Malformed(err.to_string()))
        };
        let Some(origin) = origin.map(parse).transpose()? else {
            return Ok(None);
        };
        let mut events: Vec<ClientEvent> = Vec::new();
        // What its writer may have written: its bound, passed by at most
        // what one checkpoint adds and the events that fail it.
        let most = self.settings.max_response_bytes.saturating_mul(2);
        let mut bytes = 0usize;
        loop {
            if bytes > most {
                return Err(StoreError::Malformed(format!(
                    "the event log of {id} is larger than --response-store-max-response-bytes allows"
                )));
            }
            let after = events.last().and_then(ClientEvent::sequence);
            let more = self.read_events(id, after).await?;
            bytes += more.iter().map(|e| e.json().len()).sum::<usize>();
            if more.is_empty() {
                break;
            }
            // Each read goes on past the last (`stored_event`: numbers are
            // places), so the log is read in at most its length of reads.
            let forward = more
                .first()
                .and_then(ClientEvent::sequence)
                .is_some_and(|first| after.is_none_or(|after| first > after));
            if !forward {
                return Err(StoreError::Malformed(format!(
                    "the event log of {id} does not go forward"
                )));
            }
            events.extend(more);
        }
        Ok(Some(Taken {
            state,
            origin,
            checkpoint,
            events,
        }))
    }

    /// The last checkpoint of background response `id`: the whole one written,
    /// with every patch written since applied (None: none written).
    pub(super) async fn read_checkpoint(&self, id: &str) -> StoreResult<Option<Value>> {
        let mut invocation = self.scripts.read_checkpoint.prepare_invoke();
        invocation.key(self.key(id, "checkpoint"));
        let parts: Vec<String> = self
            .call_bulk("taken", async |conn| invocation.invoke_async(conn).await)
            .await?;
        checkpoint_of(&parts)
    }
}

/// A checkpoint from its parts as the store keeps them (the whole one
/// written, then every patch written since, each JSON), patches applied;
/// None without parts.
pub fn checkpoint_of(parts: &[String]) -> StoreResult<Option<Value>> {
    let malformed = |err: String| StoreError::Malformed(err);
    let mut parts = parts.iter();
    let Some(whole) = parts.next() else {
        return Ok(None);
    };
    let mut checkpoint: Value =
        serde_json::from_str(whole).map_err(|err| malformed(err.to_string()))?;
    for part in parts {
        let patch: Value = serde_json::from_str(part).map_err(|err| malformed(err.to_string()))?;
        crate::store::patch::apply(&mut checkpoint, &patch)
            .map_err(|err| malformed(err.to_string()))?;
    }
    Ok(Some(checkpoint))
}
