//! Who calls the client routes, and how they share the router.
//!
//! - **Keys** (`keys`): with `--api-key` or a tenants file, every client route
//!   but the probes takes a key (`Authorization: Bearer`, or `x-api-key`);
//!   401 without a known one. Without any key configured the endpoint is
//!   open, and every caller is the tenant `default`.
//! - **Tenants** (`file`): each key belongs to a tenant with optional limits,
//!   applied on admission: `max_concurrent` (429 at once past it) and
//!   `tokens_per_minute` (`bucket`: charged an estimate on admission, the
//!   rest of the body's bytes once they are read, settled from the request's
//!   usage when it ends).
//! - **Engine fields** (`Caller`): a client's own vLLM `priority` bounded by
//!   its tenant's, and the tenant's `cache_salt` (its KV cache isolation).
//!   `tokens_per_minute` (`bucket`: charged an estimate on admission,
//!   settled from the request's usage when it ends). Its Responses data
//!   (`max_stored_*`, `max_background_*`) goes with its `Caller` to the
//!   stores, which hold it to them (`crate::protocols::responses`).
//! - **Fair admission** (`queue`): past `--max-concurrent-requests`, requests
//!   wait in per-tenant queues served by priority, then weight; bounded in
//!   length and wait, then 429 with `Retry-After`.
//! - **Reload** (`reload`): the file is read again on SIGHUP and when it
//!   changes; a bad file keeps the tenants the router has. A tenant's
//!   counters and balance survive a reload (by name), so nothing in flight is
//!   touched.

mod bucket;
pub mod engine_fields;
pub mod file;
mod keys;
pub mod queue;
pub mod reload;

use crate::config::TenantArgs;
use crate::error::ApiError;
use axum::http::HeaderMap;
use bucket::TokenBucket;
use file::{TenantSpec, TenantsError};
use keys::KeyRing;
use queue::{FairQueue, Refusal, Share};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

/// The tenant of `--api-key`, and of every caller when no key is configured.
pub const DEFAULT_TENANT: &str = "default";
/// Bytes of request body taken for one token in a request's estimate.
const BYTES_PER_TOKEN_ESTIMATE: u64 = 4;

/// A tenant as the current file says, with its counters.
#[derive(Debug)]
pub struct Tenant {
    pub name: Arc<str>,
    spec: TenantSpec,
    /// Its `cache_salt`, when its KV cache is its own.
    cache_salt: Option<Arc<str>>,
    counters: Arc<Counters>,
}

/// What a tenant carries across reloads.
#[derive(Debug)]
struct Counters {
    /// Requests admitted or queued.
    active: AtomicUsize,
    bucket: Mutex<Option<TokenBucket>>,
}

/// The tenants of one reading of the configuration.
#[derive(Debug)]
struct Directory {
    keys: KeyRing,
    tenants: Vec<Arc<Tenant>>,
}

/// Everything the client routes' admission needs.
#[derive(Debug)]
pub struct Tenants {
    /// Its group of flags: the API key, the tenants file, the queue's bounds.
    config: TenantArgs,
    directory: RwLock<Arc<Directory>>,
    counters: Mutex<HashMap<String, Arc<Counters>>>,
    queue: Arc<FairQueue>,
}

/// What an admitted request's handlers learn of its caller (a request
/// extension): the tenant's name for logs and traces, its priority and KV
/// salt for the engines, and where the request's usage is written for the
/// settlement.
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: Arc<str>,
    pub priority: Option<i32>,
    /// The tenant's `cache_salt` (`None`: it shares the engines' caches).
    pub cache_salt: Option<Arc<str>>,
    /// The Responses data the router keeps for the tenant.
    pub kept: file::KeptLimits,
    pub usage: Arc<Usage>,
    /// The tenant's counters, for the charge of the body once it is read.
    counters: Arc<Counters>,
}

impl Caller {
    /// A caller of `tenant`, with a fresh usage.
    pub fn of(tenant: &Tenant) -> Self {
        Self {
            tenant: tenant.name.clone(),
            priority: tenant.spec.priority,
            cache_salt: tenant.cache_salt.clone(),
            kept: tenant.spec.kept_limits(),
            usage: Arc::new(Usage::default()),
            counters: tenant.counters.clone(),
        }
    }

    /// Charges the tenant's tokens per minute for a body of `bytes` read
    /// whole, beyond what its admission charged (its Content-Length, or one
    /// token for a body of unknown length): a chunked body costs what it
    /// holds. 429 when the tenant's balance is spent, before any engine
    /// works on it.
    pub fn charge_body(&self, bytes: usize) -> Result<(), ApiError> {
        let tokens = body_tokens(bytes as u64);
        let charged = self.usage.charged.load(Ordering::Relaxed);
        let Some(more) = tokens.checked_sub(charged).filter(|more| *more > 0) else {
            return Ok(());
        };
        let mut bucket = self.counters.lock_bucket();
        let Some(bucket) = bucket.as_mut() else {
            return Ok(());
        };
        if let Err(wait) = bucket.take(more, Instant::now()) {
            return Err(out_of_tokens(&self.tenant, wait));
        }
        self.usage.charged.fetch_add(more, Ordering::Relaxed);
        Ok(())
    }

    /// The `priority` the engines get for a request that asked for `asked`
    /// (lower is served first): the client's own only at or after its
    /// tenant's (a tenant without one is at vLLM's default, 0), so that no
    /// client jumps a tenant ranked before its own; the tenant's when the
    /// client asked none. `None`: nothing to send. 400 for a priority that
    /// is not an integer.
    pub fn priority_for(&self, asked: Option<&serde_json::Value>) -> Result<Option<i64>, ApiError> {
        bounded_priority(asked, self.priority)
    }

    /// The `cache_salt` the engines get for a request that asked for
    /// `asked` (see [`engine_cache_salt`]).
    pub fn cache_salt_for(
        &self,
        asked: Option<&serde_json::Value>,
    ) -> Result<Option<String>, ApiError> {
        engine_cache_salt(asked, self.cache_salt.as_deref())
    }
}

/// See [`Caller::priority_for`] (`tenant`: the tenant's priority).
pub fn bounded_priority(
    asked: Option<&serde_json::Value>,
    tenant: Option<i32>,
) -> Result<Option<i64>, ApiError> {
    let floor = i64::from(tenant.unwrap_or(0));
    match asked {
        None | Some(serde_json::Value::Null) => Ok(tenant.map(i64::from)),
        Some(value) => match (value.as_i64(), value.as_u64()) {
            (Some(asked), _) => Ok(Some(asked.max(floor))),
            // Past i64: after every tenant's.
            (None, Some(_)) => Ok(Some(i64::MAX)),
            (None, None) => Err(ApiError::bad_request(
                "`priority` must be an integer",
                Some("priority"),
            )),
        },
    }
}

/// Tokens a request used, written by its record when it ends.
#[derive(Debug, Default)]
pub struct Usage {
    prompt: AtomicU64,
    completion: AtomicU64,
    known: std::sync::atomic::AtomicBool,
    /// Tokens charged for it so far (the estimate on admission, then the
    /// rest of its body's once read): what the settlement gives back.
    charged: AtomicU64,
}

impl Usage {
    pub fn record(&self, prompt: u64, completion: u64) {
        self.prompt.store(prompt, Ordering::Relaxed);
        self.completion.store(completion, Ordering::Relaxed);
        self.known.store(true, Ordering::Release);
    }

    fn read(&self) -> Option<(u64, u64)> {
        self.known.load(Ordering::Acquire).then(|| {
            (
                self.prompt.load(Ordering::Relaxed),
                self.completion.load(Ordering::Relaxed),
            )
        })
    }
}

/// An admitted request: its slot, its place in its tenant's count and its
/// charge; all given back when it drops (the end of its response).
#[derive(Debug)]
pub struct Admission {
    _slot: queue::Slot,
    tenant: Arc<Tenant>,
    usage: Arc<Usage>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.tenant.counters.active.fetch_sub(1, Ordering::Relaxed);
        let used = self.usage.read();
        if let Some((prompt, completion)) = used {
            crate::observe::metrics::tenant_tokens(&self.tenant.name, prompt, completion);
        }
        if self.tenant.spec.tokens_per_minute.is_some() {
            let charged = self.usage.charged.load(Ordering::Relaxed);
            let used = used.map_or(charged, |(p, c)| p + c);
            let mut bucket = self.tenant.counters.lock_bucket();
            if let Some(bucket) = bucket.as_mut() {
                bucket.settle(charged, used, Instant::now());
            }
        }
    }
}

impl Counters {
    fn lock_bucket(&self) -> std::sync::MutexGuard<'_, Option<TokenBucket>> {
        self.bucket.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Gives back a tenant's count if admission stops before it succeeds.
struct Counted<'a>(&'a Counters);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Tenants {
    /// The tenants of `config` (its file read now: a bad one stops the start).
    pub fn new(config: TenantArgs) -> Result<Self, TenantsError> {
        let queue = Arc::new(FairQueue::new(
            config.max_concurrent_requests,
            config.max_queued_per_tenant,
            config.max_queue_wait,
        ));
        let tenants = Self {
            directory: RwLock::new(Arc::new(Directory {
                keys: KeyRing::default(),
                tenants: Vec::new(),
            })),
            counters: Mutex::new(HashMap::new()),
            queue,
            config,
        };
        tenants.reload()?;
        Ok(tenants)
    }

    /// Reads the configuration again; on error the current tenants stay.
    pub fn reload(&self) -> Result<usize, TenantsError> {
        let mut specs = match &self.config.tenants_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| TenantsError::Read {
                    path: path.clone(),
                    source,
                })?;
                file::parse(&text)?
            }
            None => Vec::new(),
        };
        if let Some(key) = &self.config.api_key {
            match specs.iter_mut().find(|t| t.name == DEFAULT_TENANT) {
                Some(tenant) => tenant.keys.push(key.clone()),
                None => specs.push(TenantSpec::unlimited(DEFAULT_TENANT, vec![key.clone()])),
            }
            file::check(&specs)?;
        }
        if specs.is_empty() {
            specs.push(TenantSpec::unlimited(DEFAULT_TENANT, Vec::new()));
        }
        let count = specs.len();
        let now = Instant::now();
        let mut counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let mut tenants = Vec::with_capacity(count);
        let mut keys = Vec::new();
        for (index, spec) in specs.into_iter().enumerate() {
            let shared = counters
                .entry(spec.name.clone())
                .or_insert_with(|| {
                    Arc::new(Counters {
                        active: AtomicUsize::new(0),
                        bucket: Mutex::new(None),
                    })
                })
                .clone();
            {
                let mut bucket = shared.lock_bucket();
                match (spec.tokens_per_minute, bucket.as_mut()) {
                    (None, _) => *bucket = None,
                    (Some(rate), Some(current)) => current.set_rate(rate, now),
                    (Some(rate), None) => *bucket = Some(TokenBucket::new(rate, now)),
                }
            }
            keys.extend(spec.keys.iter().map(|key| (key.clone(), index)));
            tenants.push(Arc::new(Tenant {
                name: spec.name.as_str().into(),
                cache_salt: match spec.kv_cache {
                    file::KvCache::Isolated => Some(tenant_salt(&spec.name).into()),
                    file::KvCache::Shared => None,
                },
                spec,
                counters: shared,
            }));
        }
        // Counters of tenants no longer named go once nothing holds them.
        counters.retain(|name, shared| {
            Arc::strong_count(shared) > 1 || tenants.iter().any(|t| &*t.name == name)
        });
        let directory = Arc::new(Directory {
            keys: KeyRing::new(keys),
            tenants,
        });
        *self.directory.write().unwrap_or_else(|e| e.into_inner()) = directory;
        Ok(count)
    }

    fn directory(&self) -> Arc<Directory> {
        self.directory
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A caller of tenant `name` as it is configured now (None: no such
    /// tenant): what a request of that tenant read back from the shared
    /// store (a background generation taken over) is held to.
    pub fn caller_of(&self, name: &str) -> Option<Caller> {
        self.directory()
            .tenants
            .iter()
            .find(|tenant| &*tenant.name == name)
            .map(|tenant| Caller::of(tenant))
    }

    /// Whether the client routes take a key.
    pub fn keyed(&self) -> bool {
        !self.directory().keys.is_empty()
    }

    /// The tenant whose key `headers` present (or `default` when no key is
    /// configured); 401 otherwise.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
        let directory = self.directory();
        if directory.keys.is_empty() {
            return directory
                .tenants
                .first()
                .cloned()
                .ok_or(ApiError::Unauthorized("no tenant is configured"));
        }
        let Some(given) = keys::presented(headers) else {
            return Err(ApiError::Unauthorized(
                "this endpoint takes an API key: `Authorization: Bearer <key>`",
            ));
        };
        directory
            .keys
            .find(given)
            .and_then(|index| directory.tenants.get(index).cloned())
            .ok_or(ApiError::Unauthorized("the API key is not valid"))
    }

    /// Authenticates and admits a request: the tenant's own limits first
    /// (429 at once), then a slot (at once, or after a fair wait).
    pub async fn admit(&self, headers: &HeaderMap) -> Result<(Admission, Caller), ApiError> {
        let tenant = self.authenticate(headers)?;
        let counters = &tenant.counters;
        let active = counters.active.fetch_add(1, Ordering::Relaxed) + 1;
        let counted = Counted(counters);
        if let Some(max) = tenant.spec.max_concurrent.filter(|max| active > *max) {
            crate::observe::metrics::tenant_rejected(&tenant.name, "max_concurrent");
            return Err(ApiError::RateLimited {
                message: format!(
                    "tenant `{}` has its limit of {max} requests in flight; retry later",
                    tenant.name
                ),
                retry_after_s: 1,
            });
        }
        let estimate = estimate(headers);
        if let Some(wait) = counters
            .lock_bucket()
            .as_mut()
            .and_then(|bucket| bucket.take(estimate, Instant::now()).err())
        {
            return Err(out_of_tokens(&tenant.name, wait));
        }
        let share = Share {
            tenant: tenant.name.clone(),
            weight: tenant.spec.weight,
            priority: tenant.spec.priority.unwrap_or(0),
        };
        let queued = Instant::now();
        let slot = self.queue.acquire(&share).await;
        let slot = match slot {
            Ok(slot) => slot,
            Err(refusal) => {
                // Nothing was used: the charge goes back.
                if let Some(bucket) = counters.lock_bucket().as_mut() {
                    bucket.settle(estimate, 0, Instant::now());
                }
                let reason = match refusal {
                    Refusal::QueueFull => "queue_full",
                    Refusal::Waited => "queue_wait",
                };
                crate::observe::metrics::tenant_rejected(&tenant.name, reason);
                return Err(ApiError::Overloaded {
                    limit: self.queue.limit(),
                    retry_after_s: 1,
                });
            }
        };
        std::mem::forget(counted);
        crate::observe::metrics::tenant_admitted(&tenant.name, queued.elapsed());
        let caller = Caller::of(&tenant);
        caller.usage.charged.store(estimate, Ordering::Relaxed);
        let usage = caller.usage.clone();
        Ok((
            Admission {
                _slot: slot,
                tenant,
                usage,
            },
            caller,
        ))
    }
}

/// A request's tokens before its body is read: its declared length at about
/// four bytes a token, one without a length (the rest is charged once the
/// body is read, [`Caller::charge_body`]; all settled from its usage when it
/// ends).
fn estimate(headers: &HeaderMap) -> u64 {
    headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(1, body_tokens)
}

/// Longest `cache_salt` vLLM takes (`validate_cache_salt`, vLLM 0.32).
const MAX_ENGINE_SALT: usize = 128;
/// Characters vLLM refuses in a `cache_salt` (400 from the engine).
const ENGINE_SALT_FORBIDDEN: &[char] = &['@', '/', '\\', '\0'];

/// The `cache_salt` of isolated tenant `name` (a tenant's name is 1 to 64 of
/// `[A-Za-z0-9._-]`, `file.rs`: no `|`, nothing vLLM refuses). Client salts
/// are put under another prefix ([`engine_cache_salt`]): no client can send
/// a tenant's salt, nor one tenant's client another's.
fn tenant_salt(name: &str) -> String {
    format!("tenant:{name}")
}

/// The `cache_salt` the engines get for a request whose client sent `asked`
/// (a non-empty string without what vLLM refuses in one, else 400), its
/// tenant's salt `tenant`: the tenant's, with the client's own after it
/// (`tenant:NAME|CLIENT`: a client may split its tenant's cache further,
/// never leave it; the name holds no `|`, so the first one ends it); a
/// shared tenant's client gets its own under `client|`. `None`: no salt.
/// 400 when the whole is longer than vLLM takes.
pub fn engine_cache_salt(
    asked: Option<&serde_json::Value>,
    tenant: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let refused = |message: String| ApiError::bad_request(message, Some("cache_salt"));
    let asked = match asked {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(salt)) if !salt.is_empty() => Some(salt.as_str()),
        Some(_) => return Err(refused("`cache_salt` must be a non-empty string".into())),
    };
    if asked.is_some_and(|salt| salt.contains(ENGINE_SALT_FORBIDDEN)) {
        return Err(refused(
            "`cache_salt` must not contain '@', '/', '\\' or NUL".into(),
        ));
    }
    let salt = match (tenant, asked) {
        (Some(tenant), None) => Some(tenant.to_string()),
        (Some(tenant), Some(asked)) => Some(format!("{tenant}|{asked}")),
        (None, Some(asked)) => Some(format!("client|{asked}")),
        (None, None) => None,
    };
    match salt {
        Some(salt) if salt.chars().count() > MAX_ENGINE_SALT => {
            let room =
                MAX_ENGINE_SALT + asked.map_or(0, |a| a.chars().count()) - salt.chars().count();
            Err(refused(format!(
                "`cache_salt` must be at most {room} characters for this caller"
            )))
        }
        salt => Ok(salt),
    }
}

/// Tokens charged for a body of `bytes`.
fn body_tokens(bytes: u64) -> u64 {
    (bytes / BYTES_PER_TOKEN_ESTIMATE).max(1)
}

/// The 429 of a tenant whose tokens per minute are spent until `wait` from
/// now (counted as such a refusal).
fn out_of_tokens(tenant: &str, wait: std::time::Duration) -> ApiError {
    crate::observe::metrics::tenant_rejected(tenant, "tokens_per_minute");
    ApiError::RateLimited {
        message: format!("tenant `{tenant}` has used its tokens per minute; retry later"),
        retry_after_s: wait.as_secs().max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_clients_priority_counts_only_at_or_after_its_tenants() {
        let ok = |asked: Option<serde_json::Value>, tenant| {
            bounded_priority(asked.as_ref(), tenant).unwrap_or_else(|e| panic!("{e}"))
        };
        assert_eq!(ok(Some(json!(i32::MIN)), None), Some(0));
        assert_eq!(ok(Some(json!(i64::MIN)), Some(-5)), Some(-5));
        assert_eq!(ok(Some(json!(3)), Some(-5)), Some(3));
        assert_eq!(ok(Some(json!(u64::MAX)), None), Some(i64::MAX));
        assert_eq!(ok(None, Some(2)), Some(2));
        assert_eq!(ok(Some(json!(null)), None), None);
        for bad in [json!(1.5), json!("0"), json!([1])] {
            assert!(bounded_priority(Some(&bad), None).is_err(), "{bad}");
        }
    }

    #[test]
    fn no_client_salt_is_a_tenants_salt() {
        let salt = |asked: Option<serde_json::Value>, tenant: Option<&str>| {
            engine_cache_salt(asked.as_ref(), tenant).unwrap_or_else(|e| panic!("{e}"))
        };
        let a = tenant_salt("a");
        assert_eq!(salt(None, Some(&a)).as_deref(), Some("tenant:a"));
        assert_eq!(
            salt(Some(json!("tenant:b")), Some(&a)).as_deref(),
            Some("tenant:a|tenant:b")
        );
        assert_eq!(
            salt(Some(json!("tenant:b")), None).as_deref(),
            Some("client|tenant:b")
        );
        assert_eq!(salt(None, None), None);
        // What vLLM would refuse (400 from the engine, mid-request) is
        // refused here: its forbidden characters, and past 128 in all.
        let longest = "x".repeat(128 - "tenant:a|".len());
        assert_eq!(
            salt(Some(json!(longest)), Some(&a)).map(|s| s.len()),
            Some(128)
        );
        for bad in [
            json!(""),
            json!(1),
            json!({"a": 1}),
            json!("a/b"),
            json!("a@b"),
            json!("a\\b"),
            json!("a\u{0}b"),
            json!(format!("{longest}x")),
        ] {
            assert!(engine_cache_salt(Some(&bad), Some(&a)).is_err(), "{bad}");
        }
    }
}
