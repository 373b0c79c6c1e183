//! Where registered instances may live: the router fetches every registered URL
//! (requests, `/health` probes) and connects to every `ctrl` address, so a
//! registration names places the router will reach from inside the cluster.
//! A URL must be a bare origin (scheme, host, port: nothing the router's own
//! paths could be appended to in surprising ways), and every address it names
//! must be inside `--allowed-upstreams`, outside the link-local and cloud
//! metadata ranges, and not one of the router's own listeners.

use ipnet::IpNet;
use reqwest::Url;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Ranges refused by default: link-local (where cloud metadata services live,
/// 169.254.169.254, fd00:ec2::254) and Alibaba's metadata address.
const DENIED_BY_DEFAULT: &[&str] = &[
    "169.254.0.0/16",
    "fe80::/10",
    "fd00:ec2::254/128",
    "100.100.100.200/32",
    "0.0.0.0/32",
    "::/128",
];

/// How long a registration may wait for its host name to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// `--allowed-upstreams` could not be read.
#[derive(Debug, thiserror::Error)]
#[error("--allowed-upstreams: `{0}` is not a CIDR (e.g. 10.0.0.0/8)")]
pub struct BadCidr(String);

/// The policy registered addresses are checked against.
#[derive(Debug, Clone)]
pub struct UpstreamPolicy {
    /// `None`: everything not denied.
    allowed: Option<Vec<IpNet>>,
    denied: Vec<IpNet>,
    /// The router's own listeners.
    own: Vec<SocketAddr>,
}

impl UpstreamPolicy {
    /// The policy of `--allowed-upstreams` (comma-separated CIDRs; a bare
    /// address means just that address).
    pub fn parse(allowed: Option<&str>) -> Result<Self, BadCidr> {
        let allowed = allowed
            .map(|list| {
                list.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(|s| {
                        s.parse::<IpNet>()
                            .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                            .map_err(|_| BadCidr(s.to_string()))
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        let denied = DENIED_BY_DEFAULT
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        Ok(Self {
            allowed,
            denied,
            own: Vec::new(),
        })
    }

    /// Refuses the router's own listeners too.
    pub fn with_own_listeners(mut self, own: &[SocketAddr]) -> Self {
        self.own.extend_from_slice(own);
        self
    }

    /// Checks a registered `url`; returns it as a bare origin (no trailing `/`).
    pub async fn check_url(&self, url: &str) -> Result<String, String> {
        let parsed = Url::parse(url).map_err(|err| format!("`{url}` is not a URL: {err}"))?;
        // Engines are called over plain HTTP/1.1 (`engine_http`): an https
        // engine would fail every request after registering.
        if parsed.scheme() != "http" {
            return Err("must be an http:// URL (engines are called over plain HTTP; TLS to an engine belongs to a sidecar or mesh)".into());
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err("must not carry user information".into());
        }
        if parsed.path() != "/" || parsed.query().is_some() || parsed.fragment().is_some() {
            return Err(
                "must be a bare origin (scheme://host:port): no path, query or fragment".into(),
            );
        }
        let host = parsed.host_str().ok_or("must name a host")?.to_string();
        let port = parsed.port_or_known_default().ok_or("must name a port")?;
        self.check_host(&host, port).await?;
        Ok(parsed.origin().ascii_serialization())
    }

    /// Checks a registered hold control address (`host:port`).
    pub async fn check_ctrl(&self, ctrl: &str) -> Result<(), String> {
        let parsed = Url::parse(&format!("tcp://{ctrl}"))
            .map_err(|_| format!("`{ctrl}` is not host:port"))?;
        let (Some(host), Some(port)) = (parsed.host_str(), parsed.port()) else {
            return Err(format!("`{ctrl}` is not host:port"));
        };
        if parsed.path() != "/" && !parsed.path().is_empty()
            || parsed.query().is_some()
            || parsed.fragment().is_some()
            || !parsed.username().is_empty()
        {
            return Err(format!("`{ctrl}` is not host:port"));
        }
        self.check_host(host, port).await
    }

    async fn check_host(&self, host: &str, port: u16) -> Result<(), String> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port)))
                .await
                .map_err(|_| format!("`{host}` did not resolve within {RESOLVE_TIMEOUT:?}"))?
                .map_err(|err| format!("`{host}` does not resolve: {err}"))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(format!("`{host}` does not resolve"));
        }
        for addr in addrs {
            self.check_addr(addr)?;
        }
        Ok(())
    }

    fn check_addr(&self, addr: SocketAddr) -> Result<(), String> {
        let ip = addr.ip().to_canonical();
        if self.denied.iter().any(|net| net.contains(&ip)) {
            return Err(format!(
                "{ip} is link-local, a metadata address or unspecified"
            ));
        }
        if let Some(allowed) = &self.allowed {
            if !allowed.iter().any(|net| net.contains(&ip)) {
                return Err(format!("{ip} is outside --allowed-upstreams"));
            }
        }
        let own = self.own.iter().any(|own| {
            own.port() == addr.port()
                && (own.ip() == ip
                    || own.ip().is_unspecified()
                    || (own.ip().is_loopback() && ip.is_loopback()))
        });
        if own {
            return Err(format!("{addr} is one of the router's own listeners"));
        }
        Ok(())
    }
}

/// Idle connections kept per engine, for reuse by the next calls.
pub const ENGINE_POOL_IDLE_PER_HOST: usize = 1024;

/// The client for engines' probes and admin calls: registered URLs are
/// fetched as they are, so it follows no redirect (a registered engine must
/// not send the router, its requests or its probes elsewhere; hyper's client of
/// `pd::upstream` follows none either).
pub fn client(config: &crate::config::RouterConfig) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
        .redirect(reqwest::redirect::Policy::none())
        .tcp_nodelay(true)
        .pool_max_idle_per_host(ENGINE_POOL_IDLE_PER_HOST)
        .build()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn policy(allowed: Option<&str>) -> UpstreamPolicy {
        UpstreamPolicy::parse(allowed)
            .unwrap()
            .with_own_listeners(&["127.0.0.1:8000".parse().unwrap()])
    }

    #[tokio::test]
    async fn only_bare_origins_pass() {
        let p = policy(None);
        assert_eq!(
            p.check_url("http://10.0.0.5:8100/").await.unwrap(),
            "http://10.0.0.5:8100"
        );
        for bad in [
            "http://10.0.0.5:8100/v1",
            "http://10.0.0.5:8100?",
            "http://10.0.0.5:8100#",
            "http://10.0.0.5:8100/?x=1",
            "http://user:pw@10.0.0.5:8100",
            "ftp://10.0.0.5:8100",
            "https://10.0.0.5:8100",
            "10.0.0.5:8100",
        ] {
            assert!(p.check_url(bad).await.is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn metadata_own_listeners_and_outside_ranges_are_refused() {
        let p = policy(None);
        assert!(p.check_url("http://169.254.169.254:80").await.is_err());
        assert!(p.check_url("http://[fe80::1]:80").await.is_err());
        assert!(p
            .check_url("http://[::ffff:169.254.169.254]:80")
            .await
            .is_err());
        assert!(p.check_url("http://127.0.0.1:8000").await.is_err());
        assert!(p.check_url("http://127.0.0.2:8000").await.is_err());
        assert!(p.check_url("http://127.0.0.1:8100").await.is_ok());
        assert!(p.check_ctrl("169.254.169.254:14600").await.is_err());
        assert!(p.check_ctrl("10.1.2.3:14600").await.is_ok());
        assert!(p.check_ctrl("10.1.2.3").await.is_err());
        let narrow = policy(Some("10.0.0.0/8, 127.0.0.1"));
        assert!(narrow.check_url("http://10.9.8.7:1").await.is_ok());
        assert!(narrow.check_url("http://127.0.0.1:9").await.is_ok());
        assert!(narrow.check_url("http://192.168.1.1:1").await.is_err());
        assert!(narrow.check_ctrl("192.168.1.1:5").await.is_err());
        assert!(UpstreamPolicy::parse(Some("10.0.0.0/33")).is_err());
    }
}
