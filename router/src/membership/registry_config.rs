//! What the membership is built from (from the router's flags, in one
//! place): the heartbeat TTL, its bounds, and the etcd backend's settings.

use std::time::Duration;

/// What the membership needs to know (built from the router's flags in one place).
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// Heartbeat TTL: an instance silent for this long gets no traffic, and
    /// its id is free again.
    pub ttl: Duration,
    /// Most instances held; registrations of new ids past it are refused.
    pub max_instances: usize,
    /// How long an expired instance stays listed before it is evicted (memory).
    pub dead_grace: Duration,
    /// The shared etcd store, if any.
    pub etcd: Option<EtcdConfig>,
}

impl RegistryConfig {
    /// The in-memory membership with defaults, for tests and tools.
    #[cfg(test)]
    pub fn memory(ttl: Duration) -> Self {
        Self {
            ttl,
            max_instances: 1024,
            dead_grace: Duration::from_secs(60),
            etcd: None,
        }
    }
}

/// How to reach etcd (`--etcd*`).
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "etcd"), allow(dead_code))] // etcd's only
pub struct EtcdConfig {
    /// Comma-separated endpoint URLs (`https://` with TLS).
    pub endpoints: String,
    pub prefix: String,
    pub timeout: Duration,
    /// CA certificate (PEM) that the server's certificate must chain to.
    pub ca_file: Option<std::path::PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS.
    pub identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// User and password for etcd's own authentication.
    pub user: Option<(String, String)>,
    /// Where instances may live: a record in etcd that names another place is
    /// refused, as its registration through the API would have been.
    pub upstreams: crate::engines::addresses::UpstreamPolicy,
}
