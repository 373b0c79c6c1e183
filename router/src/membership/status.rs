//! Connectivity of the membership store, for `/ready` and the metrics.
//!
//! A replica whose store (etcd) is unreachable keeps routing on its last view;
//! this is where it says so: `connected`, and since when the view may be stale.

use metrics::{counter, gauge};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Gauge: 1 while the membership store is reachable (always 1 for memory).
pub const CONNECTED: &str = "connex_registry_connected";
/// Counter: full re-lists of the membership (start, watch compacted away).
pub const RELISTS: &str = "connex_registry_relists_total";
/// Counter: membership changes applied from the watch.
pub const EVENTS: &str = "connex_registry_events_total";
/// Counter: reconnections of the membership watch after it broke.
pub const RECONNECTS: &str = "connex_registry_reconnects_total";
/// Counter: membership records ignored because their id disagrees with their key.
pub const MISMATCHED: &str = "connex_registry_mismatched_records_total";
/// Counter: membership records refused because their registration would have
/// been, by `reason` (`id`, `url`, `ctrl`, `full`).
pub const REFUSED: &str = "connex_registry_refused_records_total";

/// The `# HELP` text of the membership's families (after the recorder is
/// installed).
pub fn describe_metrics() {
    metrics::describe_gauge!(
        CONNECTED,
        "1 while the membership store is reachable (always 1 for memory)."
    );
    metrics::describe_counter!(
        RELISTS,
        "Full re-lists of the membership (start, watch compacted away)."
    );
    metrics::describe_counter!(EVENTS, "Membership changes applied from the watch.");
    metrics::describe_counter!(
        RECONNECTS,
        "Reconnections of the membership watch after it broke."
    );
    metrics::describe_counter!(
        MISMATCHED,
        "Membership records ignored because their id disagrees with their key."
    );
    metrics::describe_counter!(
        REFUSED,
        "Membership records refused because their registration would have been (reason: id, url, ctrl, full)."
    );
}

/// What `/ready` reports about membership.
#[derive(Debug, Clone, Serialize)]
pub struct StoreStatus {
    pub backend: &'static str,
    pub connected: bool,
    /// The view may miss changes made through other replicas.
    pub stale: bool,
    /// How long the store has been unreachable, in milliseconds.
    pub stale_for_ms: Option<u64>,
    /// The store revision the view reflects (etcd), if any.
    pub revision: Option<i64>,
}

/// Shared connectivity state of one store.
#[derive(Debug)]
pub struct Connectivity {
    backend: &'static str,
    connected: AtomicBool,
    since: Mutex<Instant>,
    revision: AtomicI64,
}

#[cfg_attr(not(feature = "etcd"), allow(dead_code))] // most of it etcd's only
impl Connectivity {
    /// Starts disconnected (stale) until the first successful list.
    pub fn new(backend: &'static str, connected: bool) -> Self {
        gauge!(CONNECTED).set(if connected { 1.0 } else { 0.0 });
        Self {
            backend,
            connected: AtomicBool::new(connected),
            since: Mutex::new(Instant::now()),
            revision: AtomicI64::new(0),
        }
    }

    pub fn set_connected(&self, connected: bool) {
        if self.connected.swap(connected, Ordering::Relaxed) != connected {
            *self.since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
            if connected {
                tracing::info!(backend = self.backend, "membership store reachable");
            } else {
                tracing::warn!(
                    backend = self.backend,
                    "membership store unreachable; routing on the last view"
                );
            }
        }
        gauge!(CONNECTED).set(if connected { 1.0 } else { 0.0 });
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    pub fn set_revision(&self, revision: i64) {
        self.revision.fetch_max(revision, Ordering::Relaxed);
    }

    pub fn revision(&self) -> i64 {
        self.revision.load(Ordering::Relaxed)
    }

    pub fn relisted(&self) {
        counter!(RELISTS).increment(1);
    }

    pub fn applied(&self, events: usize) {
        counter!(EVENTS).increment(events as u64);
    }

    pub fn mismatched(&self) {
        counter!(MISMATCHED).increment(1);
    }

    pub fn refused(&self, reason: &'static str) {
        counter!(REFUSED, "reason" => reason).increment(1);
    }

    pub fn reconnecting(&self) {
        counter!(RECONNECTS).increment(1);
    }

    pub fn status(&self, has_revision: bool) -> StoreStatus {
        let connected = self.is_connected();
        let since = *self.since.lock().unwrap_or_else(|e| e.into_inner());
        StoreStatus {
            backend: self.backend,
            connected,
            stale: !connected,
            stale_for_ms: (!connected).then(|| since.elapsed().as_millis() as u64),
            revision: has_revision.then(|| self.revision()),
        }
    }
}
