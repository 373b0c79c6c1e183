//! How a holder is set up: backend, lease length, release mode, byte budget.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

/// The transport that moves block bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Pure tokio TCP, always built: the holder streams requested ranges.
    Tcp,
    /// UCX one-sided gets (cargo feature `ucx`).
    Ucx,
    /// Mooncake Transfer Engine (cargo feature `mooncake`).
    Mooncake,
}

impl BackendKind {
    /// Name used in `kv_transfer_params.backend`, flags and the wire.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Ucx => "ucx",
            Self::Mooncake => "mooncake",
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Self::Tcp => 1,
            Self::Ucx => 2,
            Self::Mooncake => 3,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::Tcp),
            2 => Some(Self::Ucx),
            3 => Some(Self::Mooncake),
            _ => None,
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tcp" => Ok(Self::Tcp),
            "ucx" => Ok(Self::Ucx),
            "mooncake" => Ok(Self::Mooncake),
            other => Err(format!(
                "unknown backend {other:?} (expected tcp, ucx or mooncake)"
            )),
        }
    }
}

/// When a hold is freed besides expiry and eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReleaseMode {
    /// Only by an explicit release (decoder, router backstop or engine).
    #[default]
    OnRelease,
    /// Also after the first complete pull (the classic one-shot behaviour).
    AfterPull,
}

impl FromStr for ReleaseMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on_release" | "on_finish" => Ok(Self::OnRelease),
            "after_pull" => Ok(Self::AfterPull),
            other => Err(format!(
                "unknown release mode {other:?} (expected on_release or after_pull)"
            )),
        }
    }
}

/// Fault switches for tests: make a holder misbehave on purpose.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Stop serving block bytes after this many (the connection stays open):
    /// lets a test kill the holder while a reader is provably mid-pull. The
    /// TCP backend counts the bytes it wrote; a one-sided backend cannot count
    /// reads, so with any value set it stops progressing its transport as soon
    /// as a pull starts.
    pub stall_after_bytes: Option<u64>,
    /// Serve block bytes a trickle at a time: one byte per interval on TCP
    /// (each well inside any I/O timeout), one transport progress call per
    /// interval on UCX. Lets a test prove a pull is cut at its overall
    /// deadline, not kept alive by every byte.
    pub trickle: Option<std::time::Duration>,
}

/// The environment variable every holder and client reads its default
/// [`Secret`] from.
pub const SECRET_ENV: &str = "CONNEX_TRANSFER_SECRET";

/// A secret shared by the holders and their clients (readers, the router): a
/// holder given one answers nothing on a connection until the peer has proven
/// it knows the secret, and a client given one trusts no holder that cannot
/// prove the same (a challenge-response, see `auth`; the secret itself never
/// crosses the wire). So whoever reaches a control port cannot read prompt KV
/// or release holds, and a fake holder can neither learn the secret nor feed
/// a reader its bytes. Never shown by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// `None` for an empty string (no secret), as an unset variable.
    pub fn new(secret: impl Into<String>) -> Option<Self> {
        let secret = secret.into();
        (!secret.is_empty()).then_some(Self(secret))
    }

    /// The secret in [`SECRET_ENV`], if set and not empty.
    pub fn from_env() -> Option<Self> {
        std::env::var(SECRET_ENV).ok().and_then(Self::new)
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Configuration of a [`crate::Holder`].
#[derive(Debug, Clone)]
pub struct HolderConfig {
    /// Control listener address (also the TCP backend's data path).
    pub listen: SocketAddr,
    pub backend: BackendKind,
    /// Lease length; every pull and renew extends it by this much.
    pub retain: Duration,
    pub release: ReleaseMode,
    /// When set, the oldest holds are evicted to keep held bytes under it.
    pub budget_bytes: Option<u64>,
    /// Limit for each read or write of a connection once a frame started.
    pub io_timeout: Duration,
    pub faults: Faults,
    /// Proven by every connection before any op (default: [`SECRET_ENV`]).
    /// Without one the holder serves anyone who reaches it (a warning says so).
    pub secret: Option<Secret>,
    /// Highest resume epoch a hold accepts: no request is resumed more often
    /// than the router's resume bound, so a higher one is refused rather
    /// than let anyone lock a hold out at `u32::MAX`.
    pub max_epoch: u32,
    /// Most connections served at once. Past it the holder stops accepting:
    /// new connections wait in the listen backlog (a burst of pulls queues,
    /// each within its reader's deadline) rather than being closed.
    pub max_connections: usize,
    /// Most connections one peer address may hold open at once (of
    /// `max_connections`); more from it are closed on accept.
    pub max_connections_per_peer: usize,
}

/// Default of [`HolderConfig::max_epoch`].
pub const DEFAULT_MAX_EPOCH: u32 = 64;

impl Default for HolderConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            backend: BackendKind::Tcp,
            retain: Duration::from_secs(60),
            release: ReleaseMode::OnRelease,
            budget_bytes: None,
            io_timeout: Duration::from_secs(10),
            faults: Faults::default(),
            secret: Secret::from_env(),
            max_epoch: DEFAULT_MAX_EPOCH,
            max_connections: 1024,
            max_connections_per_peer: 512,
        }
    }
}
