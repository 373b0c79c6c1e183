//! Stored responses in the shared store (`PREFIX{ID}:stored`), the
//! `ResponseStore` of a router with `--response-store`: in this replica's
//! memory while Redis cannot be reached; and a delete, which removes every
//! key of a response.

use super::connection::RedisStore;
use crate::store::stored::{ResponseStore, StoreError, StoreResult, Stored};
use futures_util::future::BoxFuture;
use redis::aio::ConnectionManager;
use redis::AsyncCommands;

/// Every key a response has (`PREFIX{ID}:WHAT`): what a delete removes.
const RESPONSE_KEYS: [&str; 7] = [
    "stored",
    "bg",
    "events",
    "checkpoint",
    "origin",
    "cancel",
    "lease",
];

impl RedisStore {
    async fn put_shared(&self, id: &str, stored: &Stored) -> StoreResult<()> {
        let key = self.key(id, "stored");
        let text =
            serde_json::to_string(stored).map_err(|err| StoreError::Malformed(err.to_string()))?;
        let ttl = self.ttl_s();
        self.call("put", async |conn| conn.set_ex(key, text, ttl).await)
            .await
    }

    async fn get_shared(&self, id: &str) -> StoreResult<Option<Stored>> {
        let key = self.key(id, "stored");
        let text: Option<Vec<u8>> = self
            .call_bulk("get", async |conn| conn.get(key).await)
            .await?;
        text.map(|text| {
            serde_json::from_slice(&text).map_err(|err| StoreError::Malformed(err.to_string()))
        })
        .transpose()
    }

    /// Whether `stored` (response `id`) is within
    /// `--response-store-max-response-bytes`; one past it is counted and
    /// logged, and not stored.
    pub(super) fn storable(&self, id: &str, stored: &Stored) -> bool {
        if stored.bytes() <= self.settings.max_response_bytes {
            return true;
        }
        metrics::counter!(crate::observe::metrics::RESPONSE_STORE_TOO_LARGE, "kind" => "stored")
            .increment(1);
        tracing::warn!(
            id,
            bytes = stored.bytes(),
            limit = self.settings.max_response_bytes,
            "a response larger than --response-store-max-response-bytes is not stored"
        );
        false
    }
}

impl ResponseStore for RedisStore {
    fn put<'a>(&'a self, id: &'a str, stored: Stored) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            if !self.storable(id, &stored) {
                return Ok(false);
            }
            match self.put_shared(id, &stored).await {
                Ok(()) => Ok(true),
                Err(err) => {
                    tracing::warn!(id, %err, "response kept in this replica's memory only");
                    Ok(self.fallback.put_now(id, stored))
                }
            }
        })
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<Option<Stored>>> {
        Box::pin(async move {
            match self.get_shared(id).await {
                Ok(Some(stored)) => Ok(Some(stored)),
                // Stored here while Redis was down (no other replica has it).
                Ok(None) => Ok(self.fallback.get_now(id)),
                Err(err) => self.fallback.get_now(id).map(Some).ok_or(err),
            }
        })
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(async move {
            let local = self.fallback.delete_now(id);
            let keys = RESPONSE_KEYS.map(|what| self.key(id, what));
            let running = self.running_key();
            // Every key of the response, and its place among the running
            // ones (UNLINK: a large one is freed off Redis's main thread).
            let deleting = async |conn: &mut ConnectionManager| {
                let (removed,): (u64,) = redis::pipe()
                    .unlink(&keys)
                    .zrem(running, id)
                    .ignore()
                    .query_async(conn)
                    .await?;
                Ok(removed)
            };
            match self.call_bulk("delete", deleting).await {
                Ok(n) => Ok(n > 0 || local),
                Err(_) if local => Ok(true),
                Err(err) => Err(err),
            }
        })
    }
}
