//! What an instance is as it registers: its role, its lifecycle, its
//! registration (the plain values the stores write and the view reads),
//! and the credential that proves a registrant holds its id.

use serde::{Deserialize, Serialize};

/// Which half of P/D an instance serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    /// Whether an instance of this role can serve `phase`.
    pub fn serves(self, pick: Pick) -> bool {
        matches!(
            (self, pick),
            (Role::Both, _) | (Role::Prefill, Pick::Prefill) | (Role::Decode, Pick::Decode)
        )
    }
}

/// What an instance is picked for: the step of a request it will serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// Lifecycle of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lifecycle {
    Ready,
    /// No new requests; in-flight ones finish.
    Draining,
    /// Draining, and its live decode streams are moved to other decoders now
    /// (`drain?migrate=true`).
    Migrating,
    /// Heartbeats stopped for longer than the TTL.
    Dead,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Ready => "ready",
            Lifecycle::Draining => "draining",
            Lifecycle::Migrating => "migrating",
            Lifecycle::Dead => "dead",
        }
    }
}

/// What an instance sends to register.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    pub role: Role,
    pub url: String,
    pub model: String,
    #[serde(default)]
    pub ctrl: Option<String>,
    #[serde(default)]
    pub id: Option<String>,
    /// A static instance (an engine without the agent, `--prefill`/`--decode`
    /// or the admin API): it sends no heartbeats, so it never expires; it is
    /// kept until removed, out of rotation while its health probes fail.
    #[serde(default)]
    pub persistent: bool,
    /// The instance's credential: issued by the registry, never read from a
    /// registrant's body.
    #[serde(skip)]
    pub credential: Option<String>,
}

/// Whether `id` may name an instance: it goes into URL paths (heartbeat,
/// drain) and etcd keys unescaped. Registrations through the API and records
/// read from etcd are held to it alike.
pub fn valid_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
}

impl Registration {
    /// The id the instance asked for, or a new one.
    pub fn id_or_new(&self) -> String {
        self.id
            .clone()
            .unwrap_or_else(|| format!("inst-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]))
    }
}

/// Whether `given` is the credential `expected` (constant time; an empty
/// `expected` matches nothing).
pub(crate) fn credential_matches(expected: &str, given: Option<&str>) -> bool {
    use subtle::ConstantTimeEq;
    match given {
        Some(given) if !expected.is_empty() => {
            bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
        }
        _ => false,
    }
}

/// A new instance credential: 128 bits from the OS CSPRNG (rand's thread
/// RNG is a CSPRNG reseeded from it), hex.
pub(crate) fn new_credential() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
