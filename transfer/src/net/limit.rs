//! At most so many of something at once per peer address, in arrival order:
//! pulls from one holder (a burst of requests at a decoder starts a pull
//! each, and more connections to one holder than it serves from one peer
//! would be closed and fail), connects to one engine (a burst of requests
//! would overflow its listen backlog, and each connect lost there costs a
//! SYN retry). Each waiter bounds its own wait.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bound, per address.
pub struct KeyedLimit {
    max: usize,
    /// Only addresses with places taken or awaited (an entry goes with its
    /// last user), so peers that come and go leave nothing behind.
    slots: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// A place under the bound; given back on drop.
pub struct Admitted {
    permit: Option<OwnedSemaphorePermit>,
    /// Dropped under the map's lock, so that of two places given back at once
    /// the second sees the first gone and removes the entry.
    semaphore: Option<Arc<Semaphore>>,
    addr: String,
    limit: Arc<KeyedLimit>,
}

impl KeyedLimit {
    /// At most `max` (at least 1) at once per address.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            slots: Mutex::new(HashMap::new()),
        })
    }

    /// Waits for a place under the bound of `addr` (the caller bounds the
    /// wait).
    pub async fn enter(self: &Arc<Self>, addr: &str) -> Admitted {
        let semaphore = {
            let mut slots = self.lock();
            slots
                .entry(addr.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(self.max)))
                .clone()
        };
        let mut admitted = Admitted {
            permit: None,
            semaphore: Some(semaphore.clone()),
            addr: addr.to_string(),
            limit: self.clone(),
        };
        // Never closed: `acquire_owned` cannot fail.
        admitted.permit = semaphore.acquire_owned().await.ok();
        admitted
    }

    /// Addresses with places taken or awaited (for tests).
    #[cfg(test)]
    fn addresses(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Semaphore>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        drop(self.permit.take());
        let mut slots = self.limit.lock();
        let Some(semaphore) = self.semaphore.take() else {
            return;
        };
        // The map's reference and this one: nobody else runs or waits.
        if Arc::strong_count(&semaphore) == 2 {
            slots.remove(&self.addr);
        }
        drop(semaphore);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn past_the_bound_a_caller_waits_for_a_place_and_entries_go_with_it() {
        let admission = KeyedLimit::new(2);
        let a = admission.enter("h:1").await;
        let b = admission.enter("h:1").await;
        let other = admission.enter("h:2").await;
        let third = tokio::time::timeout(Duration::from_millis(100), admission.enter("h:1")).await;
        assert!(third.is_err(), "a third pull from h:1 waits");
        drop(a);
        let c = tokio::time::timeout(Duration::from_secs(1), admission.enter("h:1"))
            .await
            .expect("admitted once one ends");
        assert_eq!(admission.addresses(), 2);
        drop((b, c, other));
        assert_eq!(admission.addresses(), 0, "nothing left behind");
    }
}
