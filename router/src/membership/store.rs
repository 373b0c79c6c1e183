//! The `Store` every membership backend implements (memory, etcd), where
//! writes go, and what the backends share: errors, what a registration may
//! replace, credentials, their periodic sweeps.

use super::instance::Instance;
use super::registration::{credential_matches, Lifecycle, Registration};
use super::status::StoreStatus;
use futures_util::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Errors of membership writes.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The shared membership store (etcd) cannot be reached now: the write was
    /// not made. Routing goes on from the last view.
    #[error("membership store unreachable: {0}")]
    Unavailable(String),
    /// A record in the store that this router cannot read.
    #[error("invalid membership record for `{id}`: {message}")]
    Corrupt { id: String, message: String },
    #[error("invalid membership configuration: {0}")]
    Config(String),
    /// The id is held by a live instance whose credential was not presented.
    #[error("instance id `{0}` is taken by a live instance; present its credential or wait for its registration to expire")]
    Taken(String),
    /// A heartbeat or deregistration without the instance's credential.
    #[error("the credential presented is not that of instance `{0}`")]
    WrongCredential(String),
    /// `--max-instances` reached.
    #[error("the registry holds its maximum of {0} instances")]
    Full(usize),
}

/// Where membership writes go; reads always come from the local view.
pub trait Store: Send + Sync {
    /// Adds (or re-registers) an instance; it is `Ready` afterwards. What it
    /// may replace is checked in the same step as the write ([`Replace`]), so
    /// that two registrations of one id cannot both win; `reg.credential` is
    /// the fresh credential a vacant id gets.
    fn register(
        &self,
        reg: Registration,
        replace: Replace,
    ) -> BoxFuture<'_, Result<Arc<Instance>, RegistryError>>;
    /// Refreshes an instance's liveness. `false` when it is unknown (or its lease
    /// has expired): the instance should register again.
    /// The caller checked `credential` against the local view; a backend that
    /// looks the instance up elsewhere (etcd) checks it against what it finds.
    fn heartbeat<'a>(
        &'a self,
        id: &'a str,
        credential: &'a str,
    ) -> BoxFuture<'a, Result<bool, RegistryError>>;
    /// Drain, migrate, activate. `false` when unknown.
    fn set_lifecycle<'a>(
        &'a self,
        id: &'a str,
        state: Lifecycle,
    ) -> BoxFuture<'a, Result<bool, RegistryError>>;
    /// Forgets an instance. `false` when unknown.
    fn remove<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, RegistryError>>;
    /// Starts the tasks that keep the local view current (reaper, watch); they
    /// stop when `shutdown` is cancelled.
    fn spawn(&self, tasks: &mut JoinSet<()>, shutdown: CancellationToken);
    /// Backend name and connectivity, for `/ready` and the metrics.
    fn status(&self) -> StoreStatus;
}

/// Who asks to (re-)register or remove an id.
#[derive(Debug, Clone, Copy)]
pub enum Claim<'a> {
    /// The admin API: may replace a live instance.
    Admin,
    /// A registrant, with the credential it was given, if any.
    Registrant(Option<&'a str>),
}

/// What a registration may replace under its id. The store decides in the
/// same step as its write (a lock for memory, an etcd transaction), because a
/// check followed by a write lets two first registrations of one id both
/// succeed, the later silently replacing the earlier.
#[derive(Debug, Clone)]
pub enum Replace {
    /// A vacant or expired id only (a registrant without a credential).
    Vacant,
    /// A vacant or expired id, or a live one holding this credential.
    Holder(String),
    /// Anything (the admin API); the instance gets a new credential.
    Anything,
}

impl Replace {
    /// The credential the registration writes, given the credential of the
    /// live record under its id (`None`: vacant or expired): the holder keeps
    /// its own, a vacant id gets `fresh`. `None` when it may not replace.
    pub(crate) fn resolve(&self, held: Option<&str>, fresh: &str) -> Option<String> {
        match (self, held) {
            (Replace::Anything, _) | (_, None) => Some(fresh.to_string()),
            (Replace::Holder(given), Some(held)) if credential_matches(held, Some(given)) => {
                Some(held.to_string())
            }
            _ => None,
        }
    }
}

impl From<RegistryError> for crate::error::ApiError {
    fn from(err: RegistryError) -> Self {
        use crate::error::ApiError;
        match err {
            RegistryError::Taken(_) => ApiError::Conflict(err.to_string()),
            RegistryError::WrongCredential(_) => ApiError::Forbidden(err.to_string()),
            _ => ApiError::Unavailable(err.to_string()),
        }
    }
}

/// Runs `work` every `period` on `tasks` until `shutdown` (the sweeps both
/// stores run over their view: reaping missed heartbeats, reviving marks).
pub(crate) fn every(
    tasks: &mut JoinSet<()>,
    shutdown: CancellationToken,
    period: Duration,
    mut work: impl FnMut() + Send + 'static,
) {
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => work(),
            }
        }
    });
}

/// How often a store sweeps its view: a quarter of the heartbeat TTL.
pub(crate) fn sweep_period(ttl: Duration) -> Duration {
    (ttl / 4).max(Duration::from_millis(100))
}
