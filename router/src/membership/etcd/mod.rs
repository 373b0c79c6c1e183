//! The etcd backend: membership shared by router replicas.
//!
//! Each instance is the key `<prefix>/instances/<id>` (JSON [`record::Record`])
//! bound to an etcd lease whose TTL is the heartbeat TTL. Any replica can take
//! a heartbeat (it refreshes the lease), a drain or a removal (it rewrites or
//! deletes the key); every replica's [`watch`] task applies what changed to its
//! local view, which is all the routing path reads. A write made here is also
//! applied to the local view at once, at the revision etcd gave it, so that the
//! replica that took it routes by it without waiting for its own watch.

mod hedge;
pub mod record;
#[cfg(test)]
mod tests;
pub mod watch;

use super::etcd_config::EtcdConfig;
use super::instance::Instance;
use super::registration::{credential_matches, Lifecycle, Registration};
use super::status::{Connectivity, StoreStatus};
use super::store::{every, sweep_period, RegistryError, Replace, Store};
use super::view::View;
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, KeyValue, PutOptions, Txn, TxnOp};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use record::{Record, State};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How often a conditional write is retried when the key changed under it.
const CAS_ATTEMPTS: usize = 5;

pub struct EtcdStore {
    client: Client,
    /// `<prefix>/instances/`
    keys: String,
    ttl: Duration,
    timeout: Duration,
    view: Arc<View>,
    connectivity: Arc<Connectivity>,
    /// What the watch holds every record to (a registration's checks).
    checks: watch::RecordChecks,
}

impl EtcdStore {
    /// A client for `endpoints` (comma-separated URLs). Connects lazily: a router
    /// may start while etcd is down, and reports its membership stale until the
    /// watch has listed it.
    pub async fn connect(
        config: &EtcdConfig,
        ttl: Duration,
        max_instances: usize,
        view: Arc<View>,
    ) -> Result<Self, RegistryError> {
        let (prefix, timeout) = (config.prefix.as_str(), config.timeout);
        let endpoints: Vec<&str> = config
            .endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Err(RegistryError::Config("--etcd names no endpoint".into()));
        }
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            // A dead or hung etcd is noticed by the HTTP/2 keep-alive, so that the
            // watch breaks (and the view is reported stale) within seconds.
            .with_keep_alive(Duration::from_secs(2), timeout)
            .with_keep_alive_while_idle(true)
            .with_require_leader(true);
        let options = secure(options, config)?;
        let client = Client::connect(&endpoints, Some(options))
            .await
            .map_err(|err| RegistryError::Config(format!("etcd endpoints {endpoints:?}: {err}")))?;
        tracing::info!(?endpoints, %prefix, "membership in etcd");
        Ok(Self {
            client,
            keys: format!("{}/instances/", prefix.trim_end_matches('/')),
            ttl,
            timeout,
            view,
            connectivity: Arc::new(Connectivity::new("etcd", false)),
            checks: watch::RecordChecks {
                upstreams: config.upstreams.clone(),
                max_instances,
            },
        })
    }

    fn key(&self, id: &str) -> String {
        format!("{}{id}", self.keys)
    }

    /// One etcd call, bounded by the timeout; every failure means "unreachable".
    async fn call<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, RegistryError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => Err(RegistryError::Unavailable(format!("etcd {what}: {err}"))),
            Err(_) => Err(RegistryError::Unavailable(format!(
                "etcd {what}: no answer within {:?}",
                self.timeout
            ))),
        }
    }

    async fn fetch(&self, id: &str) -> Result<Option<(KeyValue, Record)>, RegistryError> {
        let mut client = self.client.clone();
        let key = self.key(id);
        let reply = self.call("get", client.get(key, None)).await?;
        let Some(kv) = reply.kvs().first() else {
            return Ok(None);
        };
        let record: Record =
            serde_json::from_slice(kv.value()).map_err(|err| RegistryError::Corrupt {
                id: id.to_string(),
                message: err.to_string(),
            })?;
        if record.state == State::Removed {
            return Ok(None);
        }
        Ok(Some((kv.clone(), record)))
    }

    /// Rewrites an instance's record if nobody changed it since it was read,
    /// keeping its lease. Returns the record written, its lease and revision.
    async fn rewrite(
        &self,
        id: &str,
        state: State,
    ) -> Result<Option<(Record, i64, i64)>, RegistryError> {
        for _ in 0..CAS_ATTEMPTS {
            let Some((kv, mut record)) = self.fetch(id).await? else {
                return Ok(None);
            };
            record.state = state;
            let key = self.key(id);
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    key.clone(),
                    CompareOp::Equal,
                    kv.mod_revision(),
                )])
                .and_then([TxnOp::put(
                    key,
                    record.to_json(),
                    Some(PutOptions::new().with_ignore_lease()),
                )]);
            let mut client = self.client.clone();
            let reply = self.call("txn", client.txn(txn)).await?;
            if reply.succeeded() {
                let revision = reply.header().map_or(0, |h| h.revision());
                return Ok(Some((record, kv.lease(), revision)));
            }
        }
        Err(RegistryError::Unavailable(format!(
            "instance `{id}` kept changing; try again"
        )))
    }

    async fn do_register(
        &self,
        mut reg: Registration,
        replace: Replace,
    ) -> Result<Arc<Instance>, RegistryError> {
        let id = reg.id_or_new();
        let key = self.key(&id);
        let fresh = reg.credential.clone().unwrap_or_default();
        let ttl = i64::try_from(self.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let mut client = self.client.clone();
        // "Taken" is decided before a lease is granted: a refused registration
        // (a flood of them, say) costs etcd one read, not a lease grant and
        // its revoke. The loop below decides again on what it reads.
        let reply = self.call("get", client.get(key.clone(), None)).await?;
        if replace
            .resolve(held_credential(reply.kvs().first()).as_deref(), &fresh)
            .is_none()
        {
            return Err(RegistryError::Taken(id));
        }
        // A static instance sends no heartbeats: its key has no lease.
        let lease = if reg.persistent {
            0
        } else {
            self.call("lease grant", client.lease_grant(ttl, None))
                .await?
                .id()
        };
        for _ in 0..CAS_ATTEMPTS {
            // What is under the id now decides what may be written; the write
            // happens only if it is still what was read (any replica may be
            // registering the same id at the same moment).
            let reply = self.call("get", client.get(key.clone(), None)).await?;
            let current = reply.kvs().first().cloned();
            let held = held_credential(current.as_ref());
            let Some(credential) = replace.resolve(held.as_deref(), &fresh) else {
                self.revoke_unused(lease).await;
                return Err(RegistryError::Taken(id));
            };
            reg.credential = Some(credential);
            let record = Record::new(id.clone(), &reg, State::Ready);
            let unchanged = match &current {
                Some(kv) => Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision()),
                None => Compare::version(key.clone(), CompareOp::Equal, 0),
            };
            let txn = Txn::new().when([unchanged]).and_then([TxnOp::put(
                key.clone(),
                record.to_json(),
                Some(if lease == 0 {
                    PutOptions::new()
                } else {
                    PutOptions::new().with_lease(lease)
                }),
            )]);
            let reply = self.call("txn", client.txn(txn)).await?;
            if !reply.succeeded() {
                continue;
            }
            let revision = reply.header().map_or(0, |h| h.revision());
            // A re-registration leaves the previous lease with no key: let it
            // go now rather than at its expiry.
            if let Some(old) = current.map(|kv| kv.lease()) {
                if old != 0 && old != lease {
                    let _ = self.call("lease revoke", client.lease_revoke(old)).await;
                }
            }
            return Ok(self
                .view
                .put(id, record.registration(), Lifecycle::Ready, lease, revision));
        }
        self.revoke_unused(lease).await;
        Err(RegistryError::Unavailable(format!(
            "instance `{id}` kept changing; try again"
        )))
    }

    /// Lets go of a lease granted for a registration that did not happen.
    async fn revoke_unused(&self, lease: i64) {
        if lease != 0 {
            let mut client = self.client.clone();
            let _ = self.call("lease revoke", client.lease_revoke(lease)).await;
        }
    }

    /// Refreshes a lease; `false` when it has expired (its key is gone).
    /// Hedged: a keep-alive that hangs on a member that just died is sent
    /// again to another one before the lease can lapse.
    async fn keep_alive(&self, lease: i64) -> Result<bool, RegistryError> {
        hedge::hedged(hedge::hedge_after(self.timeout), || {
            let mut client = self.client.clone();
            let timeout = self.timeout;
            async move {
                // The client reads the first keep-alive answer itself and fails
                // with `LeaseKeepAliveError` when its TTL says the lease is gone.
                match tokio::time::timeout(timeout, client.lease_keep_alive(lease)).await {
                    Ok(Ok(_)) => Ok(true),
                    Ok(Err(etcd_client::Error::LeaseKeepAliveError(_))) => Ok(false),
                    Ok(Err(err)) => Err(RegistryError::Unavailable(format!(
                        "etcd lease keep-alive: {err}"
                    ))),
                    Err(_) => Err(RegistryError::Unavailable(format!(
                        "etcd lease keep-alive: no answer within {timeout:?}"
                    ))),
                }
            }
        })
        .await
    }

    async fn do_heartbeat(&self, id: &str, credential: &str) -> Result<bool, RegistryError> {
        let known = self.view.get(id).map(|i| i.lease()).filter(|l| *l != 0);
        if let Some(lease) = known {
            if self.keep_alive(lease).await? {
                self.view.heartbeat(id);
                return Ok(true);
            }
        }
        // Not in this replica's view yet, or re-registered under a new lease
        // that the watch has not brought here: ask etcd.
        let Some((kv, record)) = self.fetch(id).await? else {
            return Ok(false);
        };
        if !credential_matches(
            record.credential.as_deref().unwrap_or_default(),
            Some(credential),
        ) {
            return Err(RegistryError::WrongCredential(id.to_string()));
        }
        if kv.lease() == 0 || Some(kv.lease()) == known {
            return Ok(false);
        }
        let alive = self.keep_alive(kv.lease()).await?;
        if alive {
            self.view.heartbeat(id);
        }
        Ok(alive)
    }

    async fn do_set_lifecycle(&self, id: &str, state: Lifecycle) -> Result<bool, RegistryError> {
        let Some(stored) = State::of(state) else {
            // Death is never written: it is a lease expiring. A local judgement
            // (e.g. health checks) applies to this replica's view only.
            let revision = self.view.get(id).map_or(0, |i| i.revision());
            return Ok(self.view.set_lifecycle(id, state, revision));
        };
        let Some((record, lease, revision)) = self.rewrite(id, stored).await? else {
            return Ok(false);
        };
        self.view.put(
            id.to_string(),
            record.registration(),
            state,
            lease,
            revision,
        );
        Ok(true)
    }

    async fn do_remove(&self, id: &str) -> Result<bool, RegistryError> {
        // The tombstone tells every replica that this is a removal, not a death.
        let Some((_, lease, _)) = self.rewrite(id, State::Removed).await? else {
            return Ok(false);
        };
        let mut client = self.client.clone();
        if lease != 0 {
            self.call("lease revoke", client.lease_revoke(lease))
                .await?;
        } else {
            self.call("delete", client.delete(self.key(id), None))
                .await?;
        }
        self.view.remove(id, None, false);
        Ok(true)
    }
}

/// Adds TLS (`--etcd-ca-file`, `--etcd-cert-file`, `--etcd-key-file`) and
/// etcd authentication (`--etcd-user`, password) to the connect options.
fn secure(
    mut options: ConnectOptions,
    config: &EtcdConfig,
) -> Result<ConnectOptions, RegistryError> {
    let read = |path: &std::path::Path| {
        std::fs::read(path)
            .map_err(|err| RegistryError::Config(format!("cannot read {}: {err}", path.display())))
    };
    if config.ca_file.is_some() || config.identity.is_some() {
        let mut tls = etcd_client::TlsOptions::new();
        if let Some(ca) = &config.ca_file {
            tls = tls.ca_certificate(etcd_client::Certificate::from_pem(read(ca)?));
        }
        if let Some((cert, key)) = &config.identity {
            tls = tls.identity(etcd_client::Identity::from_pem(read(cert)?, read(key)?));
        }
        options = options.with_tls(tls);
    }
    if let Some((user, password)) = &config.user {
        options = options.with_user(user.clone(), password.clone());
    }
    Ok(options)
}

impl Store for EtcdStore {
    fn register(
        &self,
        reg: Registration,
        replace: Replace,
    ) -> BoxFuture<'_, Result<Arc<Instance>, RegistryError>> {
        self.do_register(reg, replace).boxed()
    }

    fn heartbeat<'a>(
        &'a self,
        id: &'a str,
        credential: &'a str,
    ) -> BoxFuture<'a, Result<bool, RegistryError>> {
        self.do_heartbeat(id, credential).boxed()
    }

    fn set_lifecycle<'a>(
        &'a self,
        id: &'a str,
        state: Lifecycle,
    ) -> BoxFuture<'a, Result<bool, RegistryError>> {
        self.do_set_lifecycle(id, state).boxed()
    }

    fn remove<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, RegistryError>> {
        self.do_remove(id).boxed()
    }

    fn spawn(&self, tasks: &mut JoinSet<()>, shutdown: CancellationToken) {
        let watcher = watch::Watcher {
            client: self.client.clone(),
            keys: self.keys.clone(),
            timeout: self.timeout,
            view: self.view.clone(),
            connectivity: self.connectivity.clone(),
            checks: self.checks.clone(),
        };
        tasks.spawn(watcher.run(shutdown.clone()));
        // Instances this replica marked dead on its own come back if their lease
        // outlives the mark (heartbeats kept arriving, at this or another replica).
        let view = self.view.clone();
        let after = self.ttl + Duration::from_secs(2);
        every(tasks, shutdown, sweep_period(self.ttl), move || {
            view.revive(after)
        });
    }

    fn status(&self) -> StoreStatus {
        self.connectivity.status(true)
    }
}

/// The credential of the live registration stored in `kv`, if one is (a
/// removed record holds its id no more).
fn held_credential(kv: Option<&KeyValue>) -> Option<String> {
    kv.and_then(|kv| serde_json::from_slice::<Record>(kv.value()).ok())
        .filter(|record| record.state != State::Removed)
        .map(|record| record.credential.unwrap_or_default())
}
