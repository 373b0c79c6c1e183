//! The response store every router replica shares: Redis (`--response-store
//! redis://...`). Stored responses, and each background response's event log,
//! live there, so that any replica answers `GET /v1/responses/{id}` (and its
//! `?stream=true&starting_after=N`), `previous_response_id`, `DELETE` and
//! `cancel`, whichever replica made the response.
//!
//! Keys (each with the store's TTL, so that nothing outlives it, renewed for
//! every key of a running response, `renewal.rs`; a delete removes them all,
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
//!   one patch per write (`patch.rs`; each write sends only its changes).
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

use super::store::{MemoryStore, ResponseStore, StoreError, StoreResult, Stored};
use crate::protocols::event::Event;
use futures_util::future::BoxFuture;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::streams::StreamReadReply;
use redis::AsyncCommands;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How to reach the store.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// `redis://HOST:PORT[/DB]` or `rediss://...` (TLS).
    pub url: String,
    pub password: Option<String>,
    /// CA certificate (PEM) the server's certificate must chain to
    /// (`rediss://`; without it, the system's roots).
    pub ca_file: Option<PathBuf>,
    /// Prefix of every key (replicas of one cluster share it).
    pub prefix: String,
    /// Time every key lives (refreshed as a background response is written).
    pub ttl: Duration,
    /// Bound of each call (and of each connection attempt).
    pub timeout: Duration,
    /// How long a replica's claim on a background response it generates
    /// lasts unrenewed: past it, another replica takes the generation over.
    pub lease: Duration,
    /// Most bytes of what this replica stores in its own memory while Redis
    /// is down.
    pub max_bytes: usize,
    /// Most bytes one response may hold in Redis (a stored response's object
    /// and conversation; a background response's events).
    pub max_response_bytes: usize,
    /// Bounds of the memory that holds what is stored while Redis is down.
    pub fallback_count: usize,
}

/// Why the store could not be set up (a start error).
#[derive(Debug, thiserror::Error)]
pub enum RedisSetupError {
    #[error("--response-store {0}: give redis://HOST:PORT[/DB] or rediss://...")]
    Scheme(String),
    #[error("--response-store: {0}")]
    Url(redis::RedisError),
    #[error(
        "--response-store carries a password: give it with --response-store-password-file \
         or CONNEX_RESPONSE_STORE_PASSWORD (a URL shows in `ps` and in logs)"
    )]
    PasswordInUrl,
    #[error("cannot read --response-store-ca-file {path}: {source}")]
    CaFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--response-store-ca-file needs a rediss:// URL")]
    CaWithoutTls,
}

/// A background response as the store has it.
#[derive(Debug, Clone)]
pub struct LogState {
    pub tenant: String,
    pub response: Value,
    pub done: bool,
}

/// Appends a background response's events past those already there (so that
/// a retried append writes each event once), sets its state and checkpoint
/// (and its origin, once; and its stored response, as it ends), and renews
/// the writer's lease on it; all at once, and only while the lease is the
/// writer's (another replica that took the generation over has it: -1, and
/// nothing is written; none has it, as after it ran out while the store was
/// unreachable: the writer takes it again, unless the response is done,
/// ended by a replica that took it over). Done: the lease and the
/// response's place among the running ones go. Returns whether a cancel was
/// asked (1) or not (0): the writer needs no call of its own to know.
/// K (the response's keys, named here from the prefix and the id): state
/// hash, events stream, checkpoint, lease, running set, cancel, origin,
/// stored. A write goes ten times a second: it sends its changes, not what
/// is the same every time (key names; the key prefix, TTL and lease, which
/// are the script's own, `append_script`; arguments it has nothing for).
/// ARGV: response id, lease token, checkpoint ('' keeps the last; '=' then
/// the whole one, '+' then a patch of the last: -2, and nothing written,
/// when there is none to patch), then what follows: done (0/1) and a letter
/// for each argument that follows, in this order: `t` tenant, `r` response
/// ('@' then a length: the stored response's, the bytes after
/// `{"response":` in it), `o` origin, `s` stored response; then sequence
/// number and event, pairs.
const APPEND: &str = r"
local base = PREFIX .. '{' .. ARGV[1] .. '}:'
local K = {base .. 'bg', base .. 'events', base .. 'checkpoint', base .. 'lease',
           PREFIX .. 'running', base .. 'cancel', base .. 'origin', base .. 'stored'}
local done = string.sub(ARGV[4], 1, 1)
local given = {}
local i = 5
for what in string.gmatch(string.sub(ARGV[4], 2), '.') do
  given[what] = ARGV[i]
  i = i + 1
end
local holder = redis.call('GET', K[4])
if holder and holder ~= ARGV[2] then return -1 end
if not holder and redis.call('HGET', K[1], 'done') == '1' then return -1 end
local patching = string.sub(ARGV[3], 1, 1) == '+'
if patching and redis.call('TYPE', K[3])['ok'] ~= 'list' then return -2 end
local last = 0
local top = redis.call('XREVRANGE', K[2], '+', '-', 'COUNT', 1)
if #top > 0 then last = tonumber(string.match(top[1][1], '%-(%d+)$')) end
for j = i, #ARGV, 2 do
  local n = tonumber(ARGV[j]) + 1
  if n > last then
    redis.call('XADD', K[2], '0-' .. n, 'e', ARGV[j + 1])
    last = n
  end
end
if given.s then redis.call('SET', K[8], given.s, 'EX', TTL) end
if given.t then redis.call('HSET', K[1], 'tenant', given.t) end
redis.call('HSET', K[1], 'done', done)
local response = given.r
if response and string.sub(response, 1, 1) == '@' then
  response = string.sub(given.s or '', 13, 12 + tonumber(string.sub(response, 2)))
end
if response then redis.call('HSET', K[1], 'response', response) end
redis.call('EXPIRE', K[1], TTL)
if last > 0 then redis.call('EXPIRE', K[2], TTL) end
if ARGV[3] ~= '' then
  if not patching then redis.call('DEL', K[3]) end
  redis.call('RPUSH', K[3], string.sub(ARGV[3], 2))
  redis.call('EXPIRE', K[3], TTL)
end
if given.o then redis.call('SET', K[7], given.o, 'EX', TTL) end
if done == '1' then
  redis.call('DEL', K[4])
  redis.call('ZREM', K[5], ARGV[1])
else
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('SET', K[4], ARGV[2], 'PX', LEASE_MS)
  redis.call('ZADD', K[5], now + LEASE_MS, ARGV[1])
end
return redis.call('EXISTS', K[6])
";

/// `APPEND` for a store of these settings: its key prefix (each byte
/// escaped, whatever it is), TTL and lease as constants of its own.
fn append_script(settings: &RedisSettings) -> String {
    let prefix: String = settings.prefix.bytes().map(|b| format!("\\{b}")).collect();
    let lease_ms = u64::try_from(settings.lease.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    format!(
        "local PREFIX = '{prefix}'\nlocal TTL = {}\nlocal LEASE_MS = {lease_ms}\n{APPEND}",
        settings.ttl.as_secs().max(1)
    )
}

/// Claims running responses whose lease expired (their replica is gone): for
/// each, a lease of the claimer's, set only where none is (one winner); never
/// one of the claimer's own (its writer goes on when the store is back).
/// An id that cannot be a response's (`valid_response_id`: forged in the
/// running set) names no key: it is dropped from the set, never claimed.
/// KEYS: running set. ARGV: token, lease ms, key prefix, most to claim, then
/// the ids to leave alone. Returns the ids won.
const CLAIM: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local own = {}
for i = 5, #ARGV do own[ARGV[i]] = true end
local most = tonumber(ARGV[4])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, most + #ARGV - 4)
local won = {}
for _, id in ipairs(due) do
  if #won >= most then break end
  local lease = ARGV[3] .. '{' .. id .. '}:lease'
  if #id > 128 or not string.match(id, '^[%w_%-]+$') then
    redis.call('ZREM', KEYS[1], id)
  elseif not own[id] and redis.call('SET', lease, ARGV[1], 'NX', 'PX', ARGV[2]) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
    table.insert(won, id)
  end
end
return won
";

/// Lets a lease go (its holder stops): the response is due at once.
/// KEYS: lease, running set. ARGV: token, response id.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('ZADD', KEYS[2], 0, ARGV[2])
end
return 1
";

/// Renews a lease still held by its token (a replica taking a response over,
/// before it starts the generation): 1, or 0 when another holds it or none.
/// KEYS: lease, running set. ARGV: token, lease ms, response id.
const RENEW_LEASE: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
return 1
";

/// Reads a checkpoint as written (a list: whole, then patches; a string:
/// whole, as a replica before patches wrote it). KEYS: checkpoint.
const READ_CHECKPOINT: &str = r"
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'list' then return redis.call('LRANGE', KEYS[1], 0, -1) end
if kind == 'string' then return {redis.call('GET', KEYS[1])} end
return {}
";

/// Renews the TTL of every key of running responses (`from`..`to` by rank
/// in the running set): a response lives as long as it runs, whatever its
/// keys' last write (`:origin` is written once, at the start).
/// KEYS: running set. ARGV: key prefix, ttl seconds, from, to (ranks).
/// Returns how many responses were renewed.
const RENEW: &str = r"
local ids = redis.call('ZRANGE', KEYS[1], ARGV[3], ARGV[4])
for _, id in ipairs(ids) do
  for _, what in ipairs({'bg', 'events', 'checkpoint', 'origin', 'cancel'}) do
    redis.call('EXPIRE', ARGV[1] .. '{' .. id .. '}:' .. what, ARGV[2])
  end
end
return #ids
";

/// Running responses one renewal call covers.
const RENEW_BATCH: usize = 256;

/// A new lease token: a replica's own claim on a generation, sent with
/// every write (ten times a second), so short: 64 bits of a random UUID,
/// which no other replica's token shares.
pub fn lease_token() -> String {
    format!("{:016x}", uuid::Uuid::new_v4().as_u128() as u64)
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

/// What a replica that takes a background response over starts from.
#[derive(Debug)]
pub struct Taken {
    pub state: LogState,
    /// What the generating replica wrote once, at the start (`publish`).
    pub origin: Value,
    /// The last checkpoint (with the last events written).
    pub checkpoint: Option<Value>,
    pub events: Vec<Event>,
}

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

/// Most events one read returns.
const READ_COUNT: usize = 512;

pub struct RedisStore {
    client: redis::Client,
    claim: redis::Script,
    release: redis::Script,
    renew_lease: redis::Script,
    read_checkpoint: redis::Script,
    renew: redis::Script,
    /// Connected on first use (a router starts while Redis is down) and
    /// reconnecting by itself after: appends, leases, claims and cancels
    /// (small calls that fence the generation, which a large read must not
    /// hold up past the store's timeout).
    manager: tokio::sync::Mutex<Option<ConnectionManager>>,
    /// The same, for what reads and removes whole responses: stored
    /// responses, states, event logs (every cross-replica reader of this
    /// replica polls on it: their connections are this one, not one each),
    /// deletes.
    bulk: tokio::sync::Mutex<Option<ConnectionManager>>,
    settings: RedisSettings,
    append: redis::Script,
    /// What was stored while Redis could not be reached.
    fallback: MemoryStore,
    /// Whether the last call reached Redis.
    up: AtomicBool,
    /// Whether Redis refused the last write for want of memory (logged once
    /// per time it fills).
    full: AtomicBool,
    /// When connecting last failed: calls fail at once for a while after
    /// (each would otherwise wait its timeout, one after the other, on the
    /// connection lock).
    connect_failed: std::sync::Mutex<Option<tokio::time::Instant>>,
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
            fallback: MemoryStore::new(settings.fallback_count, settings.max_bytes),
            append: redis::Script::new(&append_script(&settings)),
            claim: redis::Script::new(CLAIM),
            release: redis::Script::new(RELEASE),
            renew_lease: redis::Script::new(RENEW_LEASE),
            read_checkpoint: redis::Script::new(READ_CHECKPOINT),
            renew: redis::Script::new(RENEW),
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

    fn key(&self, id: &str, what: &str) -> String {
        format!("{}{{{id}}}:{what}", self.settings.prefix)
    }

    fn manager_config(&self) -> ConnectionManagerConfig {
        ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.settings.timeout))
            .set_response_timeout(Some(self.settings.timeout))
            .set_number_of_retries(1)
    }

    /// The shared connection, connecting it first if need be.
    async fn conn(&self) -> StoreResult<ConnectionManager> {
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
        let scripts = [
            &self.append,
            &self.claim,
            &self.release,
            &self.read_checkpoint,
            &self.renew,
        ];
        for script in scripts {
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
    async fn call<T, F>(&self, op: &'static str, call: F) -> StoreResult<T>
    where
        F: AsyncFnOnce(&mut ConnectionManager) -> redis::RedisResult<T>,
    {
        let mut conn = self.conn().await?;
        self.bounded(op, self.settings.timeout, call(&mut conn))
            .await
    }

    /// Runs `call` on the bulk connection within the store's timeout.
    async fn call_bulk<T, F>(&self, op: &'static str, call: F) -> StoreResult<T>
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

    fn ttl_s(&self) -> u64 {
        self.settings.ttl.as_secs().max(1)
    }

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

    /// Most bytes one response may hold in the store.
    pub fn max_response_bytes(&self) -> usize {
        self.settings.max_response_bytes
    }

    pub fn lease(&self) -> Duration {
        self.settings.lease
    }

    fn running_key(&self) -> String {
        format!("{}running", self.settings.prefix)
    }

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
        events: &[Event],
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
        events: &[Event],
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
        let mut invocation = self.append.prepare_invoke();
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

    fn lease_ms(&self) -> u64 {
        u64::try_from(self.settings.lease.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Claims up to `most` running responses whose lease expired, for
    /// `token`, leaving `own` alone (the claimer's own generations); returns
    /// the ids won (no other replica wins them).
    pub async fn claim_expired(
        &self,
        token: &str,
        most: usize,
        own: &[String],
    ) -> StoreResult<Vec<String>> {
        let mut invocation = self.claim.prepare_invoke();
        invocation
            .key(self.running_key())
            .arg(token)
            .arg(self.lease_ms())
            .arg(&self.settings.prefix)
            .arg(most);
        for id in own {
            invocation.arg(id);
        }
        let won: Vec<String> = self
            .call("claim", async |conn| invocation.invoke_async(conn).await)
            .await?;
        // Read back from the store: held to what a client's id is held to
        // before it names a key (the script drops such ids already; this
        // holds whatever answered as Redis to the same).
        Ok(won
            .into_iter()
            .filter(|id| {
                let valid = super::valid_response_id(id);
                if !valid {
                    tracing::warn!(
                        bytes = id.len(),
                        "an id that cannot be a response's among the running ones; ignored"
                    );
                }
                valid
            })
            .collect())
    }

    /// Whether `stored` (response `id`) is within
    /// `--response-store-max-response-bytes`; one past it is counted and
    /// logged, and not stored.
    fn storable(&self, id: &str, stored: &Stored) -> bool {
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

    /// Lets the lease `token` holds on `id` go, for another replica to claim.
    pub async fn release_lease(&self, id: &str, token: &str) -> StoreResult<()> {
        let mut invocation = self.release.prepare_invoke();
        invocation
            .key(self.key(id, "lease"))
            .key(self.running_key())
            .arg(token)
            .arg(id);
        self.call("release", async |conn| {
            invocation.invoke_async::<i64>(conn).await.map(|_| ())
        })
        .await
    }

    /// Renews the lease `token` holds on `id`; false when it holds it no
    /// longer (another replica claimed it, or it ran out).
    pub async fn renew_lease(&self, id: &str, token: &str) -> StoreResult<bool> {
        let mut invocation = self.renew_lease.prepare_invoke();
        invocation
            .key(self.key(id, "lease"))
            .key(self.running_key())
            .arg(token)
            .arg(self.lease_ms())
            .arg(id);
        let renewed: i64 = self
            .call("lease", async |conn| invocation.invoke_async(conn).await)
            .await?;
        Ok(renewed == 1)
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

    /// Renews the TTL of every key of every running response (those any
    /// replica generates), in batches; returns how many there were.
    pub async fn renew_running(&self) -> StoreResult<usize> {
        let mut renewed = 0;
        loop {
            let mut invocation = self.renew.prepare_invoke();
            invocation
                .key(self.running_key())
                .arg(&self.settings.prefix)
                .arg(self.ttl_s())
                .arg(renewed)
                .arg(renewed + RENEW_BATCH - 1);
            let batch: usize = self
                .call_bulk("renew", async |conn| invocation.invoke_async(conn).await)
                .await?;
            renewed += batch;
            if batch < RENEW_BATCH {
                return Ok(renewed);
            }
        }
    }

    /// How often the running responses' TTLs are renewed: several times per
    /// TTL, so that none lapses between renewals.
    pub fn renew_every(&self) -> Duration {
        (self.settings.ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60))
    }

    /// Removes `id` from the running responses (its keys are gone).
    pub async fn forget_running(&self, id: &str) -> StoreResult<()> {
        let (running, lease) = (self.running_key(), self.key(id, "lease"));
        self.call("forget", async |conn| {
            redis::pipe()
                .zrem(running, id)
                .del(lease)
                .query_async::<()>(conn)
                .await
        })
        .await
    }

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
        let mut events: Vec<Event> = Vec::new();
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
            let after = events.last().and_then(Event::sequence);
            let more = self.read_events(id, after).await?;
            bytes += more.iter().map(|e| e.json().len()).sum::<usize>();
            if more.is_empty() {
                break;
            }
            // Each read goes on past the last (`stored_event`: numbers are
            // places), so the log is read in at most its length of reads.
            let forward = more
                .first()
                .and_then(Event::sequence)
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
    async fn read_checkpoint(&self, id: &str) -> StoreResult<Option<Value>> {
        let mut invocation = self.read_checkpoint.prepare_invoke();
        invocation.key(self.key(id, "checkpoint"));
        let parts: Vec<String> = self
            .call_bulk("taken", async |conn| invocation.invoke_async(conn).await)
            .await?;
        checkpoint_of(&parts)
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
    pub async fn read_events(&self, id: &str, after: Option<u64>) -> StoreResult<Vec<Event>> {
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
fn stored_event(entry: &redis::streams::StreamId) -> StoreResult<Event> {
    let malformed = |why: String| StoreError::Malformed(format!("event {}: {why}", entry.id));
    let Some(redis::Value::BulkString(bytes)) = entry.map.get("e") else {
        return Err(malformed("no event".into()));
    };
    let event = Event::parse(bytes).map_err(|err| malformed(err.to_string()))?;
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
        super::patch::apply(&mut checkpoint, &patch).map_err(|err| malformed(err.to_string()))?;
    }
    Ok(Some(checkpoint))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let response = crate::protocols::event::json_of(&serde_json::json!({"id": "b"}));
        let stored = Stored::new(response, &[], "t".into());
        tokio::time::sleep(RECONNECT_BACKOFF).await;
        assert!(matches!(store.put("b", stored).await, Ok(true)));
        assert!(matches!(store.get("b").await, Ok(Some(_))));
        held.abort();
    }
}
