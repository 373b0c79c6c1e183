//! How to reach etcd (`--etcd*`), built from its group of flags in one place.

use std::time::Duration;

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

impl EtcdConfig {
    /// How to reach etcd, from its group of flags (None: no `--etcd`): the
    /// certificate and its key, the user and its password, each a pair or
    /// nothing; and `upstreams`, which the records read from etcd are held to.
    pub fn new(
        args: &crate::config::EtcdArgs,
        upstreams: &crate::engines::addresses::UpstreamPolicy,
    ) -> Option<Self> {
        let endpoints = args.etcd.clone()?;
        Some(Self {
            endpoints,
            prefix: args.etcd_prefix.clone(),
            timeout: args.etcd_timeout,
            ca_file: args.etcd_ca_file.clone(),
            identity: args.etcd_cert_file.clone().zip(args.etcd_key_file.clone()),
            user: args.etcd_user.clone().zip(args.etcd_password.clone()),
            upstreams: upstreams.clone(),
        })
    }
}
