//! `RedisStore` itself: its two connections (connected on first use,
//! reconnecting by themselves), every call bounded by the store's timeout,
//! and whether Redis answered lately (up, full), which `/ready` and the
//! metrics tell.

use super::scripts::Scripts;
use super::settings::{RedisSettings, RedisSetupError};
use crate::store::memory::MemoryResponseStore;
use crate::store::stored::{StoreError, StoreResult};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The response store every replica shares (the module's doc).
pub struct RedisStore {
    pub(super) client: redis::Client,
    /// Connected on first use (a router starts while Redis is down) and
    /// reconnecting by itself after: appends, leases, claims and cancels
    /// (small calls that fence the generation, which a large read must not
    /// hold up past the store's timeout).
    pub(super) manager: tokio::sync::Mutex<Option<ConnectionManager>>,
    /// The same, for what reads and removes whole responses: stored
    /// responses, states, event logs (every cross-replica reader of this
    /// replica polls on it: their connections are this one, not one each),
    /// deletes.
    pub(super) bulk: tokio::sync::Mutex<Option<ConnectionManager>>,
    pub(super) settings: RedisSettings,
    pub(super) scripts: Scripts,
    /// What was stored while Redis could not be reached.
    pub(super) fallback: MemoryResponseStore,
    /// Whether the last call reached Redis.
    pub(super) up: AtomicBool,
    /// Whether Redis refused the last write for want of memory (logged once
    /// per time it fills).
    pub(super) full: AtomicBool,
    /// When connecting last failed: calls fail at once for a while after
    /// (each would otherwise wait its timeout, one after the other, on the
    /// connection lock).
    pub(super) connect_failed: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// The calls that write (and so fail in a full store).
const WRITES: [&str; 3] = ["put", "append", "cancel"];

/// How long after a failed connect calls fail without trying again.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(500);

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.settings.prefix)
            .field("up", &self.up.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// The store at `settings.url`; nothing is connected yet.
    pub fn new(settings: RedisSettings) -> Result<Self, RedisSetupError> {
        let tls = match settings.url.split_once("://").map(|(scheme, _)| scheme) {
            Some("redis") => false,
            Some("rediss") => true,
            _ => return Err(RedisSetupError::Scheme(settings.url.clone())),
        };
        let info = redis::IntoConnectionInfo::into_connection_info(settings.url.as_str())
            .map_err(RedisSetupError::Url)?;
        if info.redis_settings().password().is_some() {
            return Err(RedisSetupError::PasswordInUrl);
        }
        let info = match &settings.password {
            Some(password) => {
                let redis = info.redis_settings().clone().set_password(password);
                info.set_redis_settings(redis)
            }
            None => info,
        };
        let client = match &settings.ca_file {
            None => redis::Client::open(info),
            Some(_) if !tls => return Err(RedisSetupError::CaWithoutTls),
            Some(path) => {
                let root_cert = std::fs::read(path).map_err(|source| RedisSetupError::CaFile {
                    path: path.clone(),
                    source,
                })?;
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root_cert),
                };
                redis::Client::build_with_tls(info, certs)
            }
        }
        .map_err(RedisSetupError::Url)?;
        Ok(Self {
            client,
            manager: tokio::sync::Mutex::new(None),
            bulk: tokio::sync::Mutex::new(None),
            fallback: MemoryResponseStore::new(settings.fallback_count, settings.max_bytes),
            scripts: Scripts::new(&settings),
            settings,
            up: AtomicBool::new(true),
            full: AtomicBool::new(false),
            connect_failed: std::sync::Mutex::new(None),
        })
    }

    /// Whether the last call reached Redis.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// Whether Redis answers: the last call's word, or, when that failed, a
    /// `PING` now (so that a store back up is seen without traffic).
    pub async fn check(&self) -> bool {
        self.is_up()
            || self
                .call("ping", async |conn| {
                    redis::cmd("PING").query_async::<String>(conn).await
                })
                .await
                .is_ok()
    }

    pub(super) fn key(&self, id: &str, what: &str) -> String {
        format!("{}{{{id}}}:{what}", self.settings.prefix)
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.settings.timeout))
            .set_response_timeout(Some(self.settings.timeout))
            .set_number_of_retries(1)
    }

    /// The shared connection, connecting it first if need be.
    pub(super) async fn conn(&self) -> StoreResult<ConnectionManager> {
        self.conn_on(&self.manager).await
    }

    /// The connection in `slot`, connecting it first if need be.
    async fn conn_on(
        &self,
        slot: &tokio::sync::Mutex<Option<ConnectionManager>>,
    ) -> StoreResult<ConnectionManager> {
        let failed_lately = || {
            self.connect_failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|at| at.elapsed() < RECONNECT_BACKOFF)
        };
        let backing_off = || StoreError::Unavailable("cannot connect (retrying shortly)".into());
        if failed_lately() {
            return Err(backing_off());
        }
        let mut manager = slot.lock().await;
        if let Some(manager) = manager.as_ref() {
            return Ok(manager.clone());
        }
        // Another caller failed while this one waited for the lock.
        if failed_lately() {
            return Err(backing_off());
        }
        let connecting = self
            .client
            .get_connection_manager_with_config(self.manager_config());
        let made = self
            .bounded("connect", self.settings.timeout, connecting)
            .await;
        *self
            .connect_failed
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = made.is_err().then(tokio::time::Instant::now);
        let mut made = made?;
        // The scripts known to Redis from the start: a script's first call
        // otherwise sends its arguments twice (refused as unknown, then
        // again after loading it), and the first append carries the whole
        // checkpoint, the last one the stored response. Not loaded (or lost
        // to a restart): each call loads its script as it needs it.
        for script in self.scripts.preloaded() {
            let loading = script.load_async(&mut made);
            if tokio::time::timeout(self.settings.timeout, loading)
                .await
                .is_err()
            {
                break;
            }
        }
        *manager = Some(made.clone());
        Ok(made)
    }

    /// Runs `call` on the shared connection within the store's timeout.
    pub(super) async fn call<T, F>(&self, op: &'static str, call: F) -> StoreResult<T>
    where
        F: AsyncFnOnce(&mut ConnectionManager) -> redis::RedisResult<T>,
    {
        let mut conn = self.conn().await?;
        self.bounded(op, self.settings.timeout, call(&mut conn))
            .await
    }

    /// Runs `call` on the bulk connection within the store's timeout.
    pub(super) async fn call_bulk<T, F>(&self, op: &'static str, call: F) -> StoreResult<T>
    where
        F: AsyncFnOnce(&mut ConnectionManager) -> redis::RedisResult<T>,
    {
        let mut conn = self.conn_on(&self.bulk).await?;
        self.bounded(op, self.settings.timeout, call(&mut conn))
            .await
    }

    /// `work` within `bound`: its failure, or its taking longer, is the store
    /// being unavailable; observed as `op`.
    async fn bounded<T>(
        &self,
        op: &'static str,
        bound: Duration,
        work: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> StoreResult<T> {
        let result = tokio::time::timeout(bound, work)
            .await
            .map_err(|_| StoreError::Unavailable(format!("{op} timed out")))
            .and_then(|r| r.map_err(|err| self.refused(op, &err)));
        self.observe(op, result)
    }

    /// A call Redis answered with an error. Out of memory (`maxmemory` under
    /// `noeviction`: every write is refused until keys expire or are
    /// deleted) is counted and said apart: what is written meanwhile stays
    /// in this replica's memory, seen by no other.
    fn refused(&self, op: &'static str, err: &redis::RedisError) -> StoreError {
        let full = err.code() == Some("OOM") || err.to_string().contains("OOM command not allowed");
        if !full {
            return StoreError::Unavailable(err.to_string());
        }
        metrics::counter!(crate::observe::metrics::RESPONSE_STORE_FULL, "op" => op).increment(1);
        if !self.full.swap(true, Ordering::Relaxed) {
            tracing::error!(op, %err, "the response store is full (maxmemory): its writes are refused; responses stay in this replica's memory until it has room");
        }
        StoreError::Unavailable(format!("the response store is full: {err}"))
    }

    /// Notes whether Redis answered, and counts the failures.
    fn observe<T>(&self, op: &'static str, result: StoreResult<T>) -> StoreResult<T> {
        let up = result.is_ok();
        // Reads go on in a full store: only a write says it has room again.
        if up && WRITES.contains(&op) && self.full.swap(false, Ordering::Relaxed) {
            tracing::info!(op, "the response store takes writes again");
        }
        if self.up.swap(up, Ordering::Relaxed) != up {
            if up {
                tracing::info!("the response store is reachable again");
            } else if let Err(err) = &result {
                tracing::warn!(op, %err, "the response store is unreachable; degraded to this replica's memory");
            }
        }
        metrics::gauge!(crate::observe::metrics::RESPONSE_STORE_UP).set(if up { 1.0 } else { 0.0 });
        if !up {
            metrics::counter!(crate::observe::metrics::RESPONSE_STORE_ERRORS, "op" => op)
                .increment(1);
        }
        result
    }

    pub(super) fn ttl_s(&self) -> u64 {
        self.settings.ttl.as_secs().max(1)
    }

    /// Most bytes one response may hold in the store.
    pub fn max_response_bytes(&self) -> usize {
        self.settings.max_response_bytes
    }

    pub fn lease(&self) -> Duration {
        self.settings.lease
    }

    pub(super) fn running_key(&self) -> String {
        format!("{}running", self.settings.prefix)
    }

    pub(super) fn lease_ms(&self) -> u64 {
        u64::try_from(self.settings.lease.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::stored::{ResponseStore, Stored};

    fn settings(url: &str) -> RedisSettings {
        RedisSettings {
            url: url.into(),
            password: None,
            ca_file: None,
            prefix: "t:".into(),
            ttl: Duration::from_secs(60),
            timeout: Duration::from_millis(200),
            lease: Duration::from_secs(1),
            max_bytes: 1 << 20,
            max_response_bytes: 1 << 20,
            fallback_count: 8,
        }
    }

    #[test]
    fn urls_that_cannot_be_a_store_are_refused_at_start() {
        let refused = |s: RedisSettings| RedisStore::new(s).err().map(|e| e.to_string());
        assert!(refused(settings("http://127.0.0.1:6379")).is_some_and(|e| e.contains("redis://")));
        assert!(refused(settings("redis://:pw@127.0.0.1:6379"))
            .is_some_and(|e| e.contains("--response-store-password-file")));
        let mut ca = settings("redis://127.0.0.1:6379");
        ca.ca_file = Some("/nonexistent/ca.crt".into());
        assert!(refused(ca).is_some_and(|e| e.contains("rediss://")));
        assert!(RedisStore::new(settings("redis://127.0.0.1:6379/2")).is_ok());
    }

    /// A store that accepts connections and never answers (packets dropped
    /// after the handshake): every call ends within its bound, and for a while
    /// after a failed connect calls fail at once instead of each waiting.
    #[tokio::test]
    async fn a_silent_store_costs_each_call_its_timeout_and_then_nothing() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                open.push(socket);
            }
        });
        let store = RedisStore::new(settings(&format!("redis://127.0.0.1:{port}")))
            .unwrap_or_else(|e| panic!("{e}"));
        let started = tokio::time::Instant::now();
        assert!(store.get("a").await.is_err());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        assert!(!store.is_up());
        let again = tokio::time::Instant::now();
        let err = store.get("a").await.err().map(|e| e.to_string());
        assert!(
            again.elapsed() < Duration::from_millis(50),
            "{:?}",
            again.elapsed()
        );
        assert!(err.is_some_and(|e| e.contains("retrying shortly")));
        // What is stored meanwhile stays in this replica's memory.
        let response = crate::protocols::client_event::json_of(&serde_json::json!({"id": "b"}));
        let stored = Stored::new(response, &[], "t".into());
        tokio::time::sleep(RECONNECT_BACKOFF).await;
        assert!(matches!(store.put("b", stored).await, Ok(true)));
        assert!(matches!(store.get("b").await, Ok(Some(_))));
        held.abort();
    }
}
