//! The tenants file (`--tenants-file`, TOML): who may call the client routes,
//! with which keys, and within which limits.
//!
//! ```toml
//! [[tenant]]
//! name = "search"
//! keys = ["sk-search-1", "sk-search-2"]
//! max_concurrent = 64          # requests in flight (queued ones count too)
//! tokens_per_minute = 200000   # prompt + completion
//! weight = 3                   # share of the router under contention
//! priority = 0                 # vLLM's `priority` (lower first), and admission order
//! kv_cache = "isolated"         # or "shared": whether its prompts share the engines' KV caches
//! max_stored_responses = 1000  # stored Responses kept (past it, its own oldest go)
//! max_stored_bytes = 67108864  # bytes of them (objects and conversations)
//! max_background_responses = 64        # background Responses' event logs kept
//! max_background_bytes = 67108864      # bytes of the finished ones
//! ```

use serde::Deserialize;
use std::collections::HashSet;

/// Most tenants one file may name: each is a label value of the per-tenant
/// metrics, so the file bounds their series.
pub const MAX_TENANTS: usize = 1000;
/// Heaviest weight a tenant may have (weights are shares, not counts).
pub const MAX_WEIGHT: u32 = 1000;
/// Shortest key accepted: a short key is a guessable one.
pub const MIN_KEY_LEN: usize = 8;

/// Why a tenants file was refused (the router keeps the tenants it had).
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    #[error("cannot read the tenants file {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the tenants file is not valid: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("tenant {index}: {message}")]
    Invalid { index: usize, message: String },
    #[error("the tenants file names more than {MAX_TENANTS} tenants")]
    TooMany,
    #[error("two tenants are named `{0}`")]
    DuplicateName(String),
    #[error("a key is given to more than one tenant (`{0}` and another)")]
    DuplicateKey(String),
}

/// One `[[tenant]]` of the file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub name: String,
    pub keys: Vec<String>,
    /// Requests in flight (admitted or queued) past which the tenant's next
    /// one gets 429 at once.
    #[serde(default)]
    pub max_concurrent: Option<usize>,
    /// Prompt plus completion tokens per minute.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Share of the router's slots while requests wait for them.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Sent to vLLM as the request's `priority` (lower is served first; the
    /// engines need `--scheduling-policy priority`), and admission order:
    /// queued requests of a lower value are admitted first.
    #[serde(default)]
    pub priority: Option<i32>,
    /// Stored Responses kept for the tenant (`--max-stored-responses-per-tenant`
    /// without it); past it, the tenant's own oldest go.
    #[serde(default)]
    pub max_stored_responses: Option<usize>,
    /// Bytes of them (`--max-stored-response-bytes-per-tenant` without it).
    #[serde(default)]
    pub max_stored_bytes: Option<usize>,
    /// Background Responses whose event logs are kept, in progress or
    /// finished (`--max-background-responses-per-tenant` without it): past
    /// it, the tenant's own finished ones are forgotten, and with all in
    /// progress its next one gets 429.
    #[serde(default)]
    pub max_background_responses: Option<usize>,
    /// Bytes of its finished background Responses' event logs
    /// (`--max-background-response-bytes-per-tenant` without it).
    #[serde(default)]
    pub max_background_bytes: Option<usize>,
    /// Whether the tenant's prompts share the engines' KV caches with other
    /// tenants' (`shared`) or not (`isolated`, the default): an isolated
    /// tenant's requests carry its own vLLM `cache_salt`, so that no other
    /// tenant can hit (and time) its cached prefixes, nor it theirs.
    #[serde(default)]
    pub kv_cache: KvCache,
}

/// A tenant's place in the engines' KV caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCache {
    /// Its own: its requests carry the tenant's `cache_salt`.
    #[default]
    Isolated,
    /// Shared with every other shared tenant (on purpose: one prompt
    /// prefix served to several tenants is computed once).
    Shared,
}

/// What a tenant's file entry says of the Responses data the router keeps
/// for it (None: the router's default, from its flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptLimits {
    pub stored_responses: Option<usize>,
    pub stored_bytes: Option<usize>,
    pub background_responses: Option<usize>,
    pub background_bytes: Option<usize>,
}

fn default_weight() -> u32 {
    1
}

impl TenantSpec {
    /// A tenant with no limits (the `--api-key` tenant, and the one everyone
    /// is when no key is configured).
    pub fn unlimited(name: &str, keys: Vec<String>) -> Self {
        Self {
            name: name.to_string(),
            keys,
            max_concurrent: None,
            tokens_per_minute: None,
            weight: default_weight(),
            priority: None,
            // It is the only tenant, or sits beside a file's whose own
            // setting isolates them.
            kv_cache: KvCache::Shared,
            max_stored_responses: None,
            max_stored_bytes: None,
            max_background_responses: None,
            max_background_bytes: None,
        }
    }

    pub fn kept_limits(&self) -> KeptLimits {
        KeptLimits {
            stored_responses: self.max_stored_responses,
            stored_bytes: self.max_stored_bytes,
            background_responses: self.max_background_responses,
            background_bytes: self.max_background_bytes,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsDoc {
    #[serde(default)]
    tenant: Vec<TenantSpec>,
}

/// The tenants of a file's text, checked.
pub fn parse(text: &str) -> Result<Vec<TenantSpec>, TenantsError> {
    let doc: TenantsDoc = toml::from_str(text)?;
    check(&doc.tenant)?;
    Ok(doc.tenant)
}

/// Names unique and printable (they become metric labels and log fields),
/// keys unique and long enough, limits positive.
pub fn check(tenants: &[TenantSpec]) -> Result<(), TenantsError> {
    if tenants.len() > MAX_TENANTS {
        return Err(TenantsError::TooMany);
    }
    let mut names = HashSet::new();
    let mut keys = HashSet::new();
    for (index, tenant) in tenants.iter().enumerate() {
        let invalid = |message: &str| TenantsError::Invalid {
            index,
            message: format!("{message} (tenant `{}`)", tenant.name),
        };
        let name_ok = !tenant.name.is_empty()
            && tenant.name.len() <= 64
            && tenant
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !name_ok {
            return Err(TenantsError::Invalid {
                index,
                message: "`name` must be 1 to 64 of [A-Za-z0-9._-]".into(),
            });
        }
        if !names.insert(tenant.name.as_str()) {
            return Err(TenantsError::DuplicateName(tenant.name.clone()));
        }
        if tenant.keys.is_empty() {
            return Err(invalid("`keys` must list at least one key"));
        }
        for key in &tenant.keys {
            if key.len() < MIN_KEY_LEN || key.chars().any(char::is_whitespace) {
                return Err(invalid(&format!(
                    "a key must be at least {MIN_KEY_LEN} characters, without whitespace"
                )));
            }
            if !keys.insert(key.as_str()) {
                return Err(TenantsError::DuplicateKey(tenant.name.clone()));
            }
        }
        if tenant.max_concurrent == Some(0) {
            return Err(invalid("`max_concurrent` must be at least 1"));
        }
        if tenant.tokens_per_minute == Some(0) {
            return Err(invalid("`tokens_per_minute` must be at least 1"));
        }
        for (key, value) in [
            ("max_stored_responses", tenant.max_stored_responses),
            ("max_stored_bytes", tenant.max_stored_bytes),
            ("max_background_responses", tenant.max_background_responses),
            ("max_background_bytes", tenant.max_background_bytes),
        ] {
            if value == Some(0) {
                return Err(invalid(&format!("`{key}` must be at least 1")));
            }
        }
        if !(1..=MAX_WEIGHT).contains(&tenant.weight) {
            return Err(invalid(&format!("`weight` must be 1 to {MAX_WEIGHT}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_with_limits_parses() {
        let tenants = parse(
            r#"
            [[tenant]]
            name = "search"
            keys = ["sk-search-0001"]
            max_concurrent = 4
            tokens_per_minute = 1000
            weight = 3
            priority = -1
            kv_cache = "shared"

            [[tenant]]
            name = "batch"
            keys = ["sk-batch-00001", "sk-batch-00002"]
            "#,
        )
        .unwrap_or_default();
        assert_eq!(tenants.len(), 2);
        assert_eq!(tenants[0].weight, 3);
        assert_eq!(tenants[0].priority, Some(-1));
        assert_eq!(tenants[1].weight, 1);
        assert_eq!(tenants[1].max_concurrent, None);
        assert_eq!(tenants[0].kv_cache, KvCache::Shared);
        assert_eq!(
            tenants[1].kv_cache,
            KvCache::Isolated,
            "isolated unless said"
        );
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let cases = [
            ("[[tenant]]\nname = \"a\"\nkeys = [\"short\"]\n", "at least 8"),
            ("[[tenant]]\nname = \"a b\"\nkeys = [\"sk-0000000\"]\n", "`name`"),
            ("[[tenant]]\nname = \"a\"\nkeys = []\n", "at least one key"),
            ("[[tenant]]\nname = \"a\"\nkeys = [\"sk-0000000\"]\nweight = 0\n", "`weight`"),
            ("[[tenant]]\nname = \"a\"\nkeys = [\"sk-0000000\"]\nmax_concurrent = 0\n", "max_concurrent"),
            ("[[tenant]]\nname = \"a\"\nkeys = [\"sk-0000000\"]\nburst = 3\n", "unknown field"),
            ("[[tenant]]\nname = \"a\"\nkeys = [\"sk-0000000\"]\nkv_cache = \"open\"\n", "unknown variant"),
            (
                "[[tenant]]\nname = \"a\"\nkeys = [\"sk-0000000\"]\n[[tenant]]\nname = \"a\"\nkeys = [\"sk-1111111\"]\n",
                "two tenants",
            ),
            (
                "[[tenant]]\nname = \"a\"\nkeys = [\"sk-0000000\"]\n[[tenant]]\nname = \"b\"\nkeys = [\"sk-0000000\"]\n",
                "more than one tenant",
            ),
        ];
        for (text, why) in cases {
            let err = parse(text).map(|_| ()).expect_err(why).to_string();
            assert!(err.contains(why), "{text}: {err}");
        }
    }
}
