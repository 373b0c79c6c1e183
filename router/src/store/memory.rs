//! The in-memory response store, the default (one replica): bounded in count
//! and bytes per tenant and in total: past a tenant's own bounds its oldest
//! go, past the totals the oldest of the tenant holding the most, so that one
//! tenant never evicts another's responses while it holds more than that one.

use super::stored::{ResponseStore, StoreResult, Stored, TenantQuota};
use futures_util::future::BoxFuture;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// The default store: in this process, at most `max_count` responses and
/// `max_bytes` of them in all, and per tenant its quota (`tenant_default`
/// where its quota says nothing).
#[derive(Debug)]
pub struct MemoryResponseStore {
    max_count: usize,
    max_bytes: usize,
    tenant_default: TenantQuota,
    inner: Mutex<MemoryState>,
}

#[derive(Debug, Default)]
struct MemoryState {
    /// Each response, its size, and the stamp of its put.
    entries: HashMap<String, (Stored, usize, u64)>,
    tenants: HashMap<String, Held>,
    count: usize,
    bytes: usize,
    /// The next put's stamp.
    next: u64,
}

/// One tenant's part of the store.
#[derive(Debug, Default)]
struct Held {
    /// Its puts, oldest first, each by its id and stamp: one whose entry was
    /// deleted, or put again since (a newer stamp), is skipped when met, so
    /// that a response put again counts from its last put.
    order: VecDeque<(String, u64)>,
    count: usize,
    bytes: usize,
}

impl MemoryState {
    /// Removes `id` (if there) from the store and its tenant's part.
    fn remove(&mut self, id: &str) -> Option<Stored> {
        let (stored, size, _) = self.entries.remove(id)?;
        self.count -= 1;
        self.bytes -= size;
        if let Some(held) = self.tenants.get_mut(&stored.tenant) {
            held.count -= 1;
            held.bytes -= size;
            if held.count == 0 {
                self.tenants.remove(&stored.tenant);
            }
        }
        Some(stored)
    }

    /// Evicts `tenant`'s oldest response; false when it has none.
    fn evict_oldest_of(&mut self, tenant: &str, evicted: &mut Vec<Stored>) -> bool {
        loop {
            let Some((oldest, stamp)) = self
                .tenants
                .get_mut(tenant)
                .and_then(|held| held.order.pop_front())
            else {
                return false;
            };
            if !self.is_current(&oldest, stamp) {
                continue;
            }
            if let Some(gone) = self.remove(&oldest) {
                evicted.push(gone);
                return true;
            }
        }
    }

    /// Whether the put of `id` stamped `stamp` is the one held now.
    fn is_current(&self, id: &str, stamp: u64) -> bool {
        self.entries
            .get(id)
            .is_some_and(|(_, _, held)| *held == stamp)
    }

    /// The tenant holding the most bytes (the one that gives up its oldest
    /// past the totals).
    fn largest(&self) -> Option<String> {
        self.tenants
            .iter()
            .max_by_key(|(_, held)| (held.bytes, held.count))
            .map(|(tenant, _)| tenant.clone())
    }
}

impl MemoryResponseStore {
    pub fn new(max_count: usize, max_bytes: usize) -> Self {
        Self::with_tenant_default(max_count, max_bytes, TenantQuota::default())
    }

    /// A store whose tenants keep at most `tenant_default` each (where their
    /// own quota says nothing; None: the totals).
    pub fn with_tenant_default(
        max_count: usize,
        max_bytes: usize,
        tenant_default: TenantQuota,
    ) -> Self {
        Self {
            max_count: max_count.max(1),
            max_bytes,
            tenant_default,
            inner: Mutex::new(MemoryState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Responses and bytes held now.
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.count, inner.bytes)
    }

    /// `put`, at once (this store never waits).
    pub fn put_now(&self, id: &str, stored: Stored) -> bool {
        let size = stored.bytes();
        let tenant_count = stored
            .quota
            .max_count
            .or(self.tenant_default.max_count)
            .unwrap_or(self.max_count)
            .clamp(1, self.max_count);
        let tenant_bytes = stored
            .quota
            .max_bytes
            .or(self.tenant_default.max_bytes)
            .unwrap_or(self.max_bytes)
            .min(self.max_bytes);
        if size > tenant_bytes {
            return false;
        }
        // What is evicted is dropped after the lock (a response's JSON).
        let mut evicted = Vec::new();
        let mut inner = self.lock();
        evicted.extend(inner.remove(id));
        let tenant = stored.tenant.clone();
        // The tenant's own bounds: its own oldest go.
        while inner
            .tenants
            .get(&tenant)
            .is_some_and(|held| held.count >= tenant_count || held.bytes + size > tenant_bytes)
        {
            if !inner.evict_oldest_of(&tenant, &mut evicted) {
                break;
            }
        }
        // The totals: the tenant holding the most gives up its oldest.
        while inner.count >= self.max_count || inner.bytes + size > self.max_bytes {
            let Some(largest) = inner.largest() else {
                break;
            };
            if !inner.evict_oldest_of(&largest, &mut evicted) {
                break;
            }
        }
        inner.count += 1;
        inner.bytes += size;
        let stamp = inner.next;
        inner.next += 1;
        let MemoryState {
            entries, tenants, ..
        } = &mut *inner;
        let held = tenants.entry(tenant).or_default();
        held.count += 1;
        held.bytes += size;
        // Deleted and put-again ids linger in `order` until met; keep it
        // near the count.
        if held.order.len() > 2 * held.count + 16 {
            held.order
                .retain(|(id, stamp)| entries.get(id).is_some_and(|(_, _, held)| held == stamp));
        }
        held.order.push_back((id.to_string(), stamp));
        inner.entries.insert(id.to_string(), (stored, size, stamp));
        drop(inner);
        drop(evicted);
        true
    }

    /// The response `id`: a reference to its JSON, not a copy.
    pub fn get_now(&self, id: &str) -> Option<Stored> {
        self.lock()
            .entries
            .get(id)
            .map(|(stored, _, _)| stored.clone())
    }

    pub fn delete_now(&self, id: &str) -> bool {
        let gone = self.lock().remove(id);
        gone.is_some()
    }
}

impl ResponseStore for MemoryResponseStore {
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
    use crate::protocols::client_event::json_of;
    use serde_json::json;
    use std::sync::Arc;

    fn stored(text: &str) -> Stored {
        of("t", text)
    }

    fn of(tenant: &str, text: &str) -> Stored {
        Stored::new(json_of(&json!({"id": text})), &[json!(text)], tenant.into())
    }

    /// Every tenant's `order` stays near its count, however many ids were
    /// deleted or put again.
    fn assert_order_near_count(store: &MemoryResponseStore) {
        let inner = store.lock();
        assert!(inner
            .tenants
            .values()
            .all(|held| held.order.len() <= 2 * held.count + 17));
    }

    #[test]
    fn the_oldest_go_first_past_the_count_or_the_bytes() {
        let store = MemoryResponseStore::new(2, 1000);
        assert!(store.put_now("a", stored("a")));
        assert!(store.put_now("b", stored("b")));
        assert!(store.put_now("c", stored("c")));
        assert!(store.get_now("a").is_none(), "evicted past the count");
        assert!(store.get_now("b").is_some() && store.get_now("c").is_some());
        assert!(store.delete_now("b"));
        assert!(!store.delete_now("b"));
        assert_eq!(store.held().0, 1);
        let small = MemoryResponseStore::new(100, 60);
        assert!(small.put_now("x", stored("x")));
        assert!(small.put_now("y", stored(&"y".repeat(20))));
        assert!(small.get_now("x").is_none(), "evicted past the bytes");
        assert!(
            !small.put_now("z", stored(&"z".repeat(100))),
            "larger than the store"
        );
        assert!(small.held().1 <= 60);
    }

    #[test]
    fn a_tenant_past_its_quota_or_the_totals_evicts_its_own_oldest() {
        let store = MemoryResponseStore::new(10, 10_000);
        assert!(store.put_now("b1", of("b", "b1")));
        for n in 0..50 {
            let quota = TenantQuota {
                max_count: Some(4),
                max_bytes: None,
            };
            assert!(store.put_now(&format!("a{n}"), of("a", "a").with_quota(quota)));
        }
        assert!(store.get_now("b1").is_some(), "b's response stays");
        assert!(store.get_now("a49").is_some() && store.get_now("a45").is_none());
        assert_eq!(store.held().0, 5);
        // Past the total count, the tenant with the most gives.
        for n in 0..50 {
            assert!(store.put_now(&format!("c{n}"), of("c", "c")));
        }
        assert!(store.get_now("b1").is_some(), "b's response still stays");
        assert_eq!(store.held().0, 10);
        // Deleted ids and their order are forgotten.
        for n in 40..50 {
            store.delete_now(&format!("c{n}"));
        }
        assert!(store.get_now("b1").is_some());
        assert_order_near_count(&store);
    }

    #[test]
    fn a_response_put_again_counts_from_its_last_put() {
        let store = MemoryResponseStore::new(2, 10_000);
        assert!(store.put_now("a", stored("a")));
        assert!(store.put_now("b", stored("b")));
        // `a` again (its new copy): now `b` is the oldest.
        assert!(store.put_now("a", of("t", "a2")));
        assert!(store.put_now("c", stored("c")));
        assert!(store.get_now("b").is_none(), "the oldest goes");
        let again = store.get_now("a").map(|s| s.response.get().to_string());
        assert_eq!(
            again.as_deref(),
            Some(r#"{"id":"a2"}"#),
            "the new copy stays"
        );
        assert!(store.get_now("c").is_some());
        assert_eq!(store.held().0, 2);
        // Put again many times: its order stays near the count.
        for _ in 0..100 {
            assert!(store.put_now("c", stored("c")));
        }
        assert!(store.get_now("a").is_some() && store.get_now("c").is_some());
        assert_order_near_count(&store);
    }

    #[test]
    fn a_reader_shares_the_stored_bytes() {
        let store = MemoryResponseStore::new(10, 10_000);
        assert!(store.put_now("a", stored("a")));
        let (one, two) = (store.get_now("a"), store.get_now("a"));
        let (Some(one), Some(two)) = (one, two) else {
            unreachable!("stored")
        };
        assert!(Arc::ptr_eq(&one.response, &two.response));
        assert_eq!(one.response_bytes().as_ptr(), one.response.get().as_ptr());
    }
}
