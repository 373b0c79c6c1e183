//! What an instance's key under the etcd prefix holds, as JSON.

use crate::membership::registration::{Lifecycle, Registration, Role};
use serde::{Deserialize, Serialize};

/// The stored state. `removed` is written just before a deliberate removal so
/// that every replica can tell it from a lease expiry (which means death).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Ready,
    Draining,
    Migrating,
    Removed,
}

impl State {
    pub fn lifecycle(self) -> Option<Lifecycle> {
        match self {
            State::Ready => Some(Lifecycle::Ready),
            State::Draining => Some(Lifecycle::Draining),
            State::Migrating => Some(Lifecycle::Migrating),
            State::Removed => None,
        }
    }

    /// The stored form of a lifecycle; `Dead` is never stored (a dead instance's
    /// key is gone with its lease).
    pub fn of(lifecycle: Lifecycle) -> Option<State> {
        match lifecycle {
            Lifecycle::Ready => Some(State::Ready),
            Lifecycle::Draining => Some(State::Draining),
            Lifecycle::Migrating => Some(State::Migrating),
            Lifecycle::Dead => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub role: Role,
    pub url: String,
    pub model: String,
    #[serde(default)]
    pub ctrl: Option<String>,
    /// The instance's credential, so that any replica can check it. etcd
    /// access must be guarded accordingly (TLS and auth, docs/security.md).
    #[serde(default)]
    pub credential: Option<String>,
    pub state: State,
    /// A static instance: its key has no lease (it never expires).
    #[serde(default)]
    pub persistent: bool,
}

impl Record {
    pub fn new(id: String, reg: &Registration, state: State) -> Self {
        Self {
            id,
            role: reg.role,
            url: reg.url.trim_end_matches('/').to_string(),
            model: reg.model.clone(),
            ctrl: reg.ctrl.clone(),
            credential: reg.credential.clone(),
            state,
            persistent: reg.persistent,
        }
    }

    pub fn registration(&self) -> Registration {
        Registration {
            role: self.role,
            url: self.url.clone(),
            model: self.model.clone(),
            ctrl: self.ctrl.clone(),
            id: Some(self.id.clone()),
            persistent: self.persistent,
            credential: self.credential.clone(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}
