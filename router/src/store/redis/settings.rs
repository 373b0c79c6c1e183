//! How to reach the store, and why it could not be set up.

use std::path::PathBuf;
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
