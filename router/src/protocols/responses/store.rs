//! Where responses live between turns: the router, not an engine, so the next
//! turn may be served by any prefill and decoder. One trait; the in-memory
//! store is the default (one replica), bounded in count and bytes, the oldest
//! evicted first.

use crate::protocols::event::json_of;
use futures_util::future::BoxFuture;
use serde_json::value::RawValue;
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// A stored response: the object a `GET` returns, and the conversation it
/// ends (input items, then its output as input items) for the next turn.
/// Both kept as their JSON, written once: one allocation each, where a tree
/// of values is one per node (and a copy, and a drop node by node, per
/// response stored and per one evicted).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Stored {
    pub response: Box<RawValue>,
    /// A JSON array of items.
    pub conversation: Box<RawValue>,
    /// The tenant that created it: the only one that may read, continue or
    /// delete it (others are told it does not exist).
    pub tenant: String,
}

impl Stored {
    pub fn new(response: Box<RawValue>, conversation: &[Value], tenant: String) -> Self {
        Self {
            response,
            conversation: json_of(&conversation),
            tenant,
        }
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

/// Where stored responses live: this process (`MemoryStore`) or a store that
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

/// The default store: in this process, at most `max_count` responses and
/// `max_bytes` of them.
#[derive(Debug)]
pub struct MemoryStore {
    max_count: usize,
    max_bytes: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, (Stored, usize)>,
    /// Ids, oldest first (deleted ones are skipped when met).
    order: VecDeque<String>,
    bytes: usize,
}

impl MemoryStore {
    pub fn new(max_count: usize, max_bytes: usize) -> Self {
        Self {
            max_count: max_count.max(1),
            max_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Responses and bytes held now.
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.entries.len(), inner.bytes)
    }

    /// `put`, at once (this store never waits).
    pub fn put_now(&self, id: &str, stored: Stored) -> bool {
        let size = stored.bytes();
        if size > self.max_bytes {
            return false;
        }
        // What is evicted is dropped after the lock (a response's tree).
        let mut evicted = Vec::new();
        let mut inner = self.lock();
        if let Some((gone, old)) = inner.entries.remove(id) {
            inner.bytes -= old;
            evicted.push(gone);
        }
        while inner.entries.len() >= self.max_count || inner.bytes + size > self.max_bytes {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some((gone, old)) = inner.entries.remove(&oldest) {
                inner.bytes -= old;
                evicted.push(gone);
            }
        }
        inner.bytes += size;
        inner.entries.insert(id.to_string(), (stored, size));
        inner.order.push_back(id.to_string());
        // Deleted ids linger in `order` until met; keep it near the count.
        if inner.order.len() > 2 * self.max_count {
            let Inner { entries, order, .. } = &mut *inner;
            order.retain(|id| entries.contains_key(id));
        }
        drop(inner);
        drop(evicted);
        true
    }

    pub fn get_now(&self, id: &str) -> Option<Stored> {
        self.lock()
            .entries
            .get(id)
            .map(|(stored, _)| stored.clone())
    }

    pub fn delete_now(&self, id: &str) -> bool {
        let mut inner = self.lock();
        match inner.entries.remove(id) {
            Some((_, size)) => {
                inner.bytes -= size;
                true
            }
            None => false,
        }
    }
}

impl ResponseStore for MemoryStore {
    fn put<'a>(&'a self, id: &'a str, stored: Stored) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(std::future::ready(Ok(self.put_now(id, stored))))
    }

    fn get<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<Option<Stored>>> {
        Box::pin(std::future::ready(Ok(self.get_now(id))))
    }

    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, StoreResult<bool>> {
        Box::pin(std::future::ready(Ok(self.delete_now(id))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> Stored {
        Stored::new(json_of(&json!({"id": text})), &[json!(text)], "t".into())
    }

    #[test]
    fn the_oldest_go_first_past_the_count_or_the_bytes() {
        let store = MemoryStore::new(2, 1000);
        assert!(store.put_now("a", stored("a")));
        assert!(store.put_now("b", stored("b")));
        assert!(store.put_now("c", stored("c")));
        assert!(store.get_now("a").is_none(), "evicted past the count");
        assert!(store.get_now("b").is_some() && store.get_now("c").is_some());
        assert!(store.delete_now("b"));
        assert!(!store.delete_now("b"));
        assert_eq!(store.held().0, 1);
        let small = MemoryStore::new(100, 60);
        assert!(small.put_now("x", stored("x")));
        assert!(small.put_now("y", stored(&"y".repeat(20))));
        assert!(small.get_now("x").is_none(), "evicted past the bytes");
        assert!(
            !small.put_now("z", stored(&"z".repeat(100))),
            "larger than the store"
        );
        assert!(small.held().1 <= 60);
    }
}
