//! Where registered instances may live: the router fetches every registered URL
//! (requests, `/health` probes) and connects to every `ctrl` address, so a
//! registration names places the router will reach from inside the cluster.
//! A URL must be a bare origin (scheme, host, port: nothing the router's own
//! paths could be appended to in surprising ways), and every address it names
//! must be inside `--allowed-upstreams`, outside the link-local and cloud
//! metadata ranges, and not one of the router's own listeners.
//!
//! The check holds at every connect, not only at registration: a name is
//! resolved again for each new connection (engine requests, probes, hold
//! calls), every address it resolves to is checked again, and the connection
//! goes to exactly the addresses checked. A registrant that re-points its
//! name at 169.254.169.254 or at the router's own listeners after registering
//! (DNS rebinding) gets refused connects, not a request to that address.

use ipnet::IpNet;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use url::Url;

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

/// Why an upstream address is refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("`{0}` is not host:port")]
    NotHostPort(String),
    #[error("`{host}` did not resolve within {after:?}")]
    ResolveTimeout { host: String, after: Duration },
    #[error("`{host}` does not resolve: {source}")]
    Unresolved {
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{0}` does not resolve")]
    NoAddress(String),
    #[error("{0} is link-local, a metadata address or unspecified")]
    Denied(IpAddr),
    #[error("{0} is outside --allowed-upstreams")]
    OutsideAllowed(IpAddr),
    #[error("{0} is one of the router's own listeners")]
    OwnListener(SocketAddr),
}

impl From<Refused> for std::io::Error {
    fn from(refused: Refused) -> Self {
        let kind = match refused {
            Refused::ResolveTimeout { .. } => std::io::ErrorKind::TimedOut,
            _ => std::io::ErrorKind::PermissionDenied,
        };
        std::io::Error::new(kind, refused)
    }
}

type Lookup<'a> = Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send + 'a>>;

/// Resolves host names: the system's resolver, or one a test controls.
/// Registration and every later connect use the same one.
pub trait NameResolver: Send + Sync + std::fmt::Debug {
    fn lookup<'a>(&'a self, host: &'a str, port: u16) -> Lookup<'a>;
}

/// The system's resolver (`getaddrinfo`, on a blocking thread).
#[derive(Debug)]
struct SystemResolver;

impl NameResolver for SystemResolver {
    fn lookup<'a>(&'a self, host: &'a str, port: u16) -> Lookup<'a> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, port)).await?.collect()) })
    }
}

/// The policy registered addresses are checked against.
#[derive(Debug, Clone)]
pub struct UpstreamPolicy {
    /// `None`: everything not denied.
    allowed: Option<Vec<IpNet>>,
    denied: Vec<IpNet>,
    /// The router's own listeners.
    own: Vec<SocketAddr>,
    resolver: Arc<dyn NameResolver>,
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
            resolver: Arc::new(SystemResolver),
        })
    }

    /// Refuses the router's own listeners too.
    pub fn with_own_listeners(mut self, own: &[SocketAddr]) -> Self {
        self.own.extend_from_slice(own);
        self
    }

    /// Resolves names with `resolver` instead of the system's.
    #[cfg(test)]
    pub fn with_resolver(mut self, resolver: Arc<dyn NameResolver>) -> Self {
        self.resolver = resolver;
        self
    }

    /// Checks a registered `url`; returns it as a bare origin (no trailing `/`).
    pub async fn check_url(&self, url: &str) -> Result<String, String> {
        let parsed = Url::parse(url).map_err(|err| format!("`{url}` is not a URL: {err}"))?;
        // Engines are called over plain HTTP/1.1 (`engines::http`): an https
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
        self.resolve(&host, port)
            .await
            .map_err(|err| err.to_string())?;
        Ok(parsed.origin().ascii_serialization())
    }

    /// Checks a registered hold control address (`host:port`).
    pub async fn check_ctrl(&self, ctrl: &str) -> Result<(), String> {
        self.resolve_authority(ctrl)
            .await
            .map(drop)
            .map_err(|err| err.to_string())
    }

    /// The addresses of `authority` (`host:port`, `[v6]:port`, no more), all
    /// of them allowed; what every connect to an upstream goes to.
    pub async fn resolve_authority(&self, authority: &str) -> Result<Vec<SocketAddr>, Refused> {
        let not_host_port = || Refused::NotHostPort(authority.to_string());
        let parsed = Url::parse(&format!("tcp://{authority}")).map_err(|_| not_host_port())?;
        let (Some(host), Some(port)) = (parsed.host_str(), parsed.port()) else {
            return Err(not_host_port());
        };
        if parsed.path() != "/" && !parsed.path().is_empty()
            || parsed.query().is_some()
            || parsed.fragment().is_some()
            || !parsed.username().is_empty()
        {
            return Err(not_host_port());
        }
        self.resolve(host, port).await
    }

    /// The addresses of `host` at `port`, resolved now, each of them allowed
    /// (one refused address refuses the name: which one a connect would try
    /// first is not ours to know).
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, Refused> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::time::timeout(RESOLVE_TIMEOUT, self.resolver.lookup(host, port))
                .await
                .map_err(|_| Refused::ResolveTimeout {
                    host: host.to_string(),
                    after: RESOLVE_TIMEOUT,
                })?
                .map_err(|source| Refused::Unresolved {
                    host: host.to_string(),
                    source,
                })?,
        };
        if addrs.is_empty() {
            return Err(Refused::NoAddress(host.to_string()));
        }
        for addr in &addrs {
            self.check_addr(*addr)?;
        }
        Ok(addrs)
    }

    fn check_addr(&self, addr: SocketAddr) -> Result<(), Refused> {
        let ip = addr.ip().to_canonical();
        if self.denied.iter().any(|net| net.contains(&ip)) {
            return Err(Refused::Denied(ip));
        }
        if let Some(allowed) = &self.allowed {
            if !allowed.iter().any(|net| net.contains(&ip)) {
                return Err(Refused::OutsideAllowed(ip));
            }
        }
        let own = self.own.iter().any(|own| {
            own.port() == addr.port()
                && (own.ip() == ip
                    || (own.ip().is_loopback() && ip.is_loopback())
                    || (own.ip().is_unspecified() && is_this_hosts(ip)))
        });
        if own {
            return Err(Refused::OwnListener(addr));
        }
        Ok(())
    }
}

/// Whether `ip` is one of this host's addresses (what a listener on the
/// unspecified address serves): loopback, or an address a socket can bind
/// here. Any engine elsewhere on the router's port is not the router: with
/// the router on `0.0.0.0:8000` (a pod), vLLM pods on their own IPs and port
/// 8000 were refused as the router itself.
fn is_this_hosts(ip: IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The hold control client's resolver: a holder's address resolved and
/// checked against the policy at each new connection.
pub struct CtrlResolver(pub Arc<UpstreamPolicy>);

impl connex_transfer::Resolve for CtrlResolver {
    fn resolve<'a>(&'a self, addr: &'a str) -> Lookup<'a> {
        Box::pin(async move { Ok(self.0.resolve_authority(addr).await?) })
    }
}

/// Idle connections kept per engine, for reuse by the next calls.
pub const ENGINE_POOL_IDLE_PER_HOST: usize = 1024;

/// A registrant that controls its DNS names, for the DNS-rebinding tests here
/// and in `engines::http`.
#[cfg(test)]
pub(crate) mod testing {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A resolver whose answers a test changes: a registrant that controls
    /// its DNS names.
    #[derive(Debug, Default)]
    pub(crate) struct Rebinder(std::sync::Mutex<std::collections::HashMap<String, IpAddr>>);

    impl Rebinder {
        pub(crate) fn point(&self, host: &str, ip: &str) {
            self.0
                .lock()
                .unwrap()
                .insert(host.into(), ip.parse().unwrap());
        }
    }

    impl NameResolver for Rebinder {
        fn lookup<'a>(&'a self, host: &'a str, port: u16) -> Lookup<'a> {
            let ip = self.0.lock().unwrap().get(host).copied();
            Box::pin(async move {
                let ip = ip.ok_or_else(|| std::io::Error::other("unknown name"))?;
                Ok(vec![SocketAddr::new(ip, port)])
            })
        }
    }

    /// Two listeners on one port: the engine at 127.0.0.2, inside
    /// `--allowed-upstreams`, and at 127.0.0.1 what stands for a metadata
    /// service (outside it). Both answer HTTP 200 and close; each counts the
    /// connections it accepted and keeps the request heads.
    pub(crate) struct Places {
        pub(crate) port: u16,
        pub(crate) engine: Arc<std::sync::Mutex<Vec<String>>>,
        pub(crate) forbidden: Arc<std::sync::Mutex<Vec<String>>>,
    }

    pub(crate) async fn places() -> Places {
        let forbidden_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = forbidden_listener.local_addr().unwrap().port();
        let engine_listener = tokio::net::TcpListener::bind(("127.0.0.2", port))
            .await
            .unwrap();
        let serve = |listener: tokio::net::TcpListener| {
            let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
            let record = seen.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                while let Ok((mut stream, _)) = listener.accept().await {
                    let mut head = vec![0u8; 4096];
                    let n = stream.read(&mut head).await.unwrap_or(0);
                    record
                        .lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(&head[..n]).into_owned());
                    let _ = stream
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                }
            });
            seen
        };
        Places {
            port,
            forbidden: serve(forbidden_listener),
            engine: serve(engine_listener),
        }
    }

    pub(crate) fn rebindable() -> (Arc<UpstreamPolicy>, Arc<Rebinder>) {
        let names = Arc::new(Rebinder::default());
        let policy = UpstreamPolicy::parse(Some("127.0.0.2/32"))
            .unwrap()
            .with_resolver(names.clone());
        (Arc::new(policy), names)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::testing::rebindable;
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

    #[tokio::test]
    async fn a_router_on_every_address_refuses_only_this_hosts_addresses() {
        let p = policy(None).with_own_listeners(&["0.0.0.0:8000".parse().unwrap()]);
        assert!(p.check_url("http://127.0.0.1:8000").await.is_err());
        // An engine on another host, on the router's port, is an engine.
        assert!(p.check_url("http://10.255.0.7:8000").await.is_ok());
        assert!(p.check_url("http://127.0.0.1:8100").await.is_ok());
        // This host's own (non-loopback) address, if it has one, is refused.
        let local = std::net::UdpSocket::bind("0.0.0.0:0")
            .and_then(|s| s.connect("10.255.0.7:9").map(|()| s))
            .and_then(|s| s.local_addr())
            .map(|a| a.ip())
            .ok();
        if let Some(ip) = local.filter(|ip| !ip.is_unspecified() && !ip.is_loopback()) {
            assert!(
                p.check_url(&format!("http://{ip}:8000")).await.is_err(),
                "{ip}"
            );
        }
    }

    #[tokio::test]
    async fn a_name_re_pointed_after_registration_is_refused_at_connect() {
        let (policy, names) = rebindable();
        let p = policy
            .as_ref()
            .clone()
            .with_own_listeners(&["127.0.0.2:8001".parse().unwrap()]);
        names.point("engine.test", "127.0.0.2");
        assert!(p.check_url("http://engine.test:8100").await.is_ok());
        names.point("engine.test", "169.254.169.254");
        assert!(matches!(
            p.resolve("engine.test", 8100).await,
            Err(Refused::Denied(_))
        ));
        names.point("engine.test", "127.0.0.2");
        assert!(matches!(
            p.resolve("engine.test", 8001).await,
            Err(Refused::OwnListener(_))
        ));
    }
}
