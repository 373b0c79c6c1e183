//! The watch task: keeps one replica's local view equal to etcd's membership.
//!
//! It lists the prefix once (the view's starting point and revision), then
//! watches from the next revision, applying every put and delete in order.
//! When the watch breaks (etcd down, network) the view stays as it was (routing
//! goes on from it, reported stale) and the task reconnects with backoff,
//! resuming from the last revision it applied, so no change is missed. If etcd
//! compacted that revision away, it lists everything again instead.
//!
//! Every record is held to what its registration through the API would have
//! been ([`RecordChecks`]): etcd's own access control decides who may write, this
//! decides what a write can make the router do.

use super::record::{Record, State};
use crate::engines::addresses::UpstreamPolicy;
use crate::membership::registration::valid_id;
use crate::membership::status::Connectivity;
use crate::membership::view::View;
use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

pub struct Watcher {
    pub client: Client,
    /// `<prefix>/instances/`
    pub keys: String,
    pub timeout: Duration,
    pub view: Arc<View>,
    pub connectivity: Arc<Connectivity>,
    pub checks: RecordChecks,
}

/// The checks a record must pass to enter the view: those of a registration
/// (`api::instances`). Without them, anyone who can write under the prefix (a
/// leaked etcd credential, a replica started with other flags) could add an
/// instance the API refuses: a URL outside `--allowed-upstreams` that then
/// receives users' prompts, an id no URL path can name, or more instances
/// than `--max-instances`.
#[derive(Debug, Clone)]
pub struct RecordChecks {
    pub upstreams: UpstreamPolicy,
    pub max_instances: usize,
}

/// Why a record was refused: `reason` labels the refusal counter.
struct RecordRefusal {
    reason: &'static str,
    why: String,
}

impl RecordRefusal {
    fn new(reason: &'static str, why: impl Into<String>) -> Self {
        Self {
            reason,
            why: why.into(),
        }
    }
}

impl RecordChecks {
    /// Checks a record (its URL comes back as the bare origin a registration
    /// stores). `known`: its id is in the view already; `held`: how many are.
    async fn check(
        &self,
        record: &mut Record,
        known: bool,
        held: usize,
    ) -> Result<(), RecordRefusal> {
        if !valid_id(&record.id) {
            return Err(RecordRefusal::new(
                "id",
                "`id` must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
            ));
        }
        if record.model.is_empty() {
            return Err(RecordRefusal::new("model", "`model` must be non-empty"));
        }
        record.url = self
            .upstreams
            .check_url(&record.url)
            .await
            .map_err(|why| RecordRefusal::new("url", format!("`url` {why}")))?;
        if let Some(ctrl) = &record.ctrl {
            self.upstreams
                .check_ctrl(ctrl)
                .await
                .map_err(|why| RecordRefusal::new("ctrl", format!("`ctrl`: {why}")))?;
        }
        if !known && held >= self.max_instances {
            return Err(RecordRefusal::new(
                "full",
                format!("the registry holds --max-instances {}", self.max_instances),
            ));
        }
        Ok(())
    }
}

/// Why a watch session ended.
#[derive(Debug, thiserror::Error)]
enum SessionEnd {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    #[error("revision {0} was compacted")]
    Compacted(i64),
    #[error("watch canceled by etcd: {0}")]
    Canceled(String),
    #[error("watch stream closed")]
    Closed,
}

impl Watcher {
    /// Runs until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        // The last revision applied; `None` means a full list is needed.
        let mut revision: Option<i64> = None;
        let mut backoff = MIN_BACKOFF;
        loop {
            let end = tokio::select! {
                _ = shutdown.cancelled() => return,
                end = self.session(&mut revision, &mut backoff) => end,
            };
            match end {
                SessionEnd::Compacted(at) => {
                    tracing::warn!(
                        compacted = at,
                        "membership watch fell behind a compaction; listing again"
                    );
                    revision = None;
                    continue;
                }
                end => {
                    if self.connectivity.is_connected() {
                        tracing::warn!(reason = %end, "membership watch broke; reconnecting");
                        self.connectivity.set_connected(false);
                    } else {
                        tracing::debug!(reason = %end, "etcd still unreachable");
                    }
                    self.connectivity.reconnecting();
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, SessionEnd> {
        Ok(tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| SessionEnd::Timeout(self.timeout))??)
    }

    /// Lists if needed, then applies watch events until the watch ends.
    async fn session(&mut self, revision: &mut Option<i64>, backoff: &mut Duration) -> SessionEnd {
        match self.try_session(revision, backoff).await {
            Ok(never) => match never {},
            Err(end) => end,
        }
    }

    async fn try_session(
        &mut self,
        revision: &mut Option<i64>,
        backoff: &mut Duration,
    ) -> Result<std::convert::Infallible, SessionEnd> {
        let from = match *revision {
            Some(rev) => rev,
            None => {
                let rev = self.relist().await?;
                *revision = Some(rev);
                rev
            }
        };
        let mut client = self.client.clone();
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(from + 1);
        let mut stream = self
            .bounded(client.watch(self.keys.clone(), Some(options)))
            .await?;
        loop {
            let reply = stream.message().await?.ok_or(SessionEnd::Closed)?;
            if reply.compact_revision() > 0 {
                return Err(SessionEnd::Compacted(reply.compact_revision()));
            }
            if reply.canceled() {
                return Err(SessionEnd::Canceled(reply.cancel_reason().to_string()));
            }
            if reply.created() {
                self.connectivity.set_connected(true);
                *backoff = MIN_BACKOFF;
            }
            let events = reply.events();
            for event in events {
                let Some(kv) = event.kv() else {
                    continue;
                };
                match event.event_type() {
                    EventType::Put => {
                        self.apply_put(kv, None).await;
                    }
                    EventType::Delete => {
                        if let Some(id) = self.id_of(kv) {
                            self.view.remove(&id, Some(kv.mod_revision()), true);
                        }
                    }
                }
                *revision = Some(revision.unwrap_or(0).max(kv.mod_revision()));
                self.connectivity.set_revision(kv.mod_revision());
            }
            if !events.is_empty() {
                self.connectivity.applied(events.len());
            }
        }
    }

    /// Replaces the view's content with etcd's; returns the list's revision.
    async fn relist(&mut self) -> Result<i64, SessionEnd> {
        let mut client = self.client.clone();
        let listed = self
            .bounded(client.get(self.keys.clone(), Some(GetOptions::new().with_prefix())))
            .await?;
        let revision = listed.header().map_or(0, |h| h.revision());
        let mut ids = HashSet::new();
        for kv in listed.kvs() {
            if let Some(id) = self.apply_put(kv, Some(&ids)).await {
                ids.insert(id);
            }
        }
        self.view.retain_listed(&ids, revision);
        self.connectivity.set_revision(revision);
        self.connectivity.relisted();
        self.connectivity.set_connected(true);
        tracing::info!(
            instances = ids.len(),
            revision,
            "membership listed from etcd"
        );
        Ok(revision)
    }

    fn id_of(&self, kv: &KeyValue) -> Option<String> {
        kv.key_str()
            .ok()
            .and_then(|key| key.strip_prefix(&self.keys))
            .map(str::to_string)
    }

    /// Applies one stored record; returns its id when the instance is live.
    /// `listed`: the ids a re-list has applied so far (they are the whole view
    /// once it ends); `None` for a watch event, checked against the view.
    async fn apply_put(&self, kv: &KeyValue, listed: Option<&HashSet<String>>) -> Option<String> {
        let mut record: Record = match serde_json::from_slice(kv.value()) {
            Ok(record) => record,
            Err(err) => {
                tracing::warn!(key = ?kv.key_str(), %err, "ignoring an unreadable membership record");
                return None;
            }
        };
        // The key names the instance: a record claiming another id (written by
        // hand or by a compromised writer) would shadow that instance, or leave
        // a ghost that no deregistration of its key removes.
        if self.id_of(kv).as_deref() != Some(record.id.as_str()) {
            tracing::warn!(key = ?kv.key_str(), id = %record.id, "ignoring a membership record whose id disagrees with its key");
            self.connectivity.mismatched();
            return None;
        }
        let Some(lifecycle) = record.state.lifecycle() else {
            debug_assert_eq!(record.state, State::Removed);
            self.view.remove(&record.id, Some(kv.mod_revision()), false);
            return None;
        };
        let (known, held) = match listed {
            Some(ids) => (ids.contains(&record.id), ids.len()),
            None => (self.view.get(&record.id).is_some(), self.view.len()),
        };
        if let Err(refusal) = self.checks.check(&mut record, known, held).await {
            tracing::warn!(
                key = ?kv.key_str(),
                reason = refusal.reason,
                why = %refusal.why,
                "refusing a membership record that would fail a registration"
            );
            self.connectivity.refused(refusal.reason);
            // What the key held before is not the instance any more.
            self.view.remove(&record.id, Some(kv.mod_revision()), true);
            return None;
        }
        let id = record.id.clone();
        self.view.put(
            id.clone(),
            record.registration(),
            lifecycle,
            kv.lease(),
            kv.mod_revision(),
        );
        Some(id)
    }
}
