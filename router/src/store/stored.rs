//! A stored response and the trait of every store that keeps them: the
//! router keeps responses between turns, not an engine, so the next turn may
//! be served by any prefill and decoder. In this process (`memory.rs`) or in
//! the store every replica shares (`redis/`).

use crate::protocols::client_event::json_of;
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;
use serde_json::Value;
use std::sync::Arc;

/// A stored response: the object a `GET` returns, and the conversation it
/// ends (input items, then its output as input items) for the next turn.
/// Both kept as their JSON, written once and shared: a reader (a `GET`, the
/// next turn) takes a reference, never a copy.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Stored {
    pub response: Arc<RawValue>,
    /// A JSON array of items.
    pub conversation: Arc<RawValue>,
    /// The tenant that created it: the only one that may read, continue or
    /// delete it (others are told it does not exist).
    pub tenant: String,
    /// Its tenant's bounds on what the store keeps (the router's defaults
    /// where the tenants file says nothing): not stored, applied when put.
    #[serde(skip)]
    pub quota: TenantQuota,
}

/// What one tenant may keep in a store (None: the store's own default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantQuota {
    pub max_count: Option<usize>,
    pub max_bytes: Option<usize>,
}

impl Stored {
    pub fn new(response: Box<RawValue>, conversation: &[Value], tenant: String) -> Self {
        Self {
            response: response.into(),
            conversation: json_of(&conversation).into(),
            tenant,
            quota: TenantQuota::default(),
        }
    }

    /// With its tenant's quota.
    pub fn with_quota(mut self, quota: TenantQuota) -> Self {
        self.quota = quota;
        self
    }

    /// What the store holds of it.
    pub fn bytes(&self) -> usize {
        self.response.get().len() + self.conversation.get().len()
    }

    /// The conversation's items.
    pub fn conversation(&self) -> StoreResult<Vec<Value>> {
        serde_json::from_str(self.conversation.get())
            .map_err(|err| StoreError::Malformed(err.to_string()))
    }

    /// The response object's JSON as bytes that share its allocation (a
    /// `GET` answers with them: no copy per reader).
    pub fn response_bytes(&self) -> bytes::Bytes {
        bytes::Bytes::from_owner(SharedJson(self.response.clone()))
    }
}

/// Stored JSON as a body's bytes.
struct SharedJson(Arc<RawValue>);

impl AsRef<[u8]> for SharedJson {
    fn as_ref(&self) -> &[u8] {
        self.0.get().as_bytes()
    }
}

/// Why the store could not answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the response store is unavailable: {0}")]
    Unavailable(String),
    #[error("the response store holds a malformed entry: {0}")]
    Malformed(String),
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Where stored responses live: this process (`MemoryResponseStore`) or a store that
/// every replica shares (`RedisStore`, which answers across the network:
/// hence futures).
pub trait ResponseStore: Send + Sync {
    /// Keeps `stored` under `id` (evicting older ones past the bounds); false
    /// when it alone is larger than the store.
    fn put<'a>(&'a self, id: &'a str, stored: Stored) -> BoxFuture<'a, StoreResult<bool>>;
    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<Option<Stored>>>;
    /// Whether `id` was there.
    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<bool>>;
}
