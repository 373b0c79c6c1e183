//! Static instances: engines without the connector's agent, named by the
//! operator (`--prefill URL[,CTRL]`, `--decode URL`, optionally
//! `--static-model`, or the same keys in the TOML file), as vllm-router's
//! `--prefill`/`--decode` do. They are registered as persistent instances: no
//! heartbeats, kept until removed, out of rotation while their health probes
//! fail. Their URLs are held to the same upstream policy as any registration.
//!
//! Without `--static-model` the router asks each engine which models it serves
//! (its `/v1/models`, as a client would) and registers it under each of them;
//! an engine that is not up yet is asked again until it answers, so the router
//! and its engines may start in any order.

use crate::config::MembershipArgs;
use crate::engines::addresses::UpstreamPolicy;
use crate::membership::model_list::{self, ModelListError};
use crate::membership::registration::{Registration, Role};
use crate::membership::registry::Registry;
use crate::membership::store::{Claim, RegistryError};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long one model-list call to a static engine may take.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Waits between discovery calls: doubling from the first to the last.
const FIRST_RETRY: Duration = Duration::from_millis(250);
const LAST_RETRY: Duration = Duration::from_secs(5);
/// While an engine does not answer, the log says so this often (not on every try).
const LOG_EVERY: Duration = Duration::from_secs(60);

/// A static instance the router cannot take.
#[derive(Debug, thiserror::Error)]
pub enum StaticError {
    #[error("static instance `{given}`: {why}")]
    Invalid { given: String, why: String },
}

/// A configured static instance, checked against the upstream policy.
#[derive(Debug, Clone)]
pub struct StaticInstance {
    pub role: Role,
    pub url: String,
    pub ctrl: Option<String>,
    /// `--static-model`, when given: then no discovery.
    pub model: Option<String>,
}

impl StaticInstance {
    /// Its registration under `model`. The engine's first (or only) model
    /// takes the plain id; any other model it serves is a separate instance
    /// of the same engine (the registry keys an instance by one model).
    pub fn registration(&self, model: &str, first: bool) -> Registration {
        let id = static_id(self.role, &self.url);
        Registration {
            id: Some(if first {
                id
            } else {
                // Ids are at most 128 characters (they go into URL paths).
                format!("{id}-{}", clean(model)).chars().take(128).collect()
            }),
            role: self.role,
            url: self.url.clone(),
            model: model.to_string(),
            ctrl: self.ctrl.clone(),
            persistent: true,
            credential: None,
        }
    }
}

/// The configured static instances (none without flags).
pub async fn instances(
    config: &MembershipArgs,
    upstreams: &UpstreamPolicy,
) -> Result<Vec<StaticInstance>, StaticError> {
    let listed = config
        .prefill
        .iter()
        .map(|e| (Role::Prefill, e))
        .chain(config.decode.iter().map(|e| (Role::Decode, e)));
    let mut out = Vec::new();
    for (role, given) in listed {
        let invalid = |why: String| StaticError::Invalid {
            given: given.clone(),
            why,
        };
        let (url, ctrl) = match given.split_once(',') {
            Some((url, ctrl)) if role == Role::Prefill => (url, Some(ctrl.trim().to_string())),
            Some(_) => return Err(invalid("a decode instance takes a URL only".into())),
            None => (given.as_str(), None),
        };
        let url = upstreams.check_url(url.trim()).await.map_err(&invalid)?;
        if let Some(ctrl) = &ctrl {
            upstreams.check_ctrl(ctrl).await.map_err(&invalid)?;
        }
        out.push(StaticInstance {
            role,
            url,
            ctrl,
            model: config.static_model.clone(),
        });
    }
    Ok(out)
}

/// Registers a static instance where its id is vacant: with etcd another
/// replica (or this one before a restart) may have registered it already, and
/// replacing it would make every replica see a new incarnation and cut the
/// streams on it.
pub async fn register(registry: &Registry, reg: Registration) -> Result<(), RegistryError> {
    match registry.register(reg, Claim::Registrant(None)).await {
        Ok((instance, _)) => {
            tracing::info!(id = %instance.id, url = %instance.url, model = %instance.model,
                "static instance added");
            Ok(())
        }
        Err(RegistryError::Taken(id)) => {
            tracing::info!(%id, "static instance already registered");
            Ok(())
        }
        Err(err) => Err(err),
    }
}

/// Asks a static engine for its models until it answers (or `stop`), then
/// registers it under each. Owned by the router's background tasks.
pub async fn discover(
    registry: &Registry,
    client: &crate::engines::probe::ProbeClient,
    instance: StaticInstance,
    stop: CancellationToken,
) {
    let mut wait = FIRST_RETRY;
    let mut logged: Option<Instant> = None;
    let models = loop {
        let failure = match model_list::fetch(client, &instance.url, DISCOVERY_TIMEOUT).await {
            Ok(entries) => {
                let models: Vec<String> = entries
                    .iter()
                    .filter_map(|e| e.get("id")?.as_str().map(str::to_string))
                    .filter(|id| !id.is_empty())
                    .collect();
                if !models.is_empty() {
                    break models;
                }
                ModelListError::Invalid("no models listed".into())
            }
            Err(err) => err,
        };
        if logged.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
            tracing::warn!(url = %instance.url, error = %failure,
                "static instance: waiting for its model list (/v1/models) to register it");
            logged = Some(Instant::now());
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(LAST_RETRY);
    };
    tracing::info!(url = %instance.url, ?models, "static instance: models discovered");
    for (i, model) in models.iter().enumerate() {
        let reg = instance.registration(model, i == 0);
        // A registry that refuses (full, etcd unreachable) is asked again.
        let mut wait = FIRST_RETRY;
        while let Err(err) = register(registry, reg.clone()).await {
            tracing::warn!(url = %instance.url, %model, error = %err,
                "static instance: registration failed; trying again");
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(LAST_RETRY);
        }
    }
}

/// The id of a static instance: the same on every replica given the same
/// flags, so that (with etcd) they name one instance.
/// The prefix of the ids the router gives its static instances; registrants
/// may not take them (`edge/routes/instances.rs`).
pub const STATIC_ID_PREFIX: &str = "static-";

fn static_id(role: Role, url: &str) -> String {
    let role = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    };
    let address = url.split_once("://").map_or(url, |(_, rest)| rest);
    format!("{STATIC_ID_PREFIX}{role}-{}", clean(address))
}

/// `text` as an id piece: characters other than `[A-Za-z0-9._:-]` become `-`.
fn clean(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._:-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(100)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_valid() {
        assert_eq!(
            static_id(Role::Decode, "http://10.0.0.2:8200/v"),
            "static-decode-10.0.0.2:8200-v"
        );
        let instance = StaticInstance {
            role: Role::Decode,
            url: "http://10.0.0.2:8200".into(),
            ctrl: None,
            model: None,
        };
        assert_eq!(
            instance.registration("org/m", true).id.as_deref(),
            Some("static-decode-10.0.0.2:8200")
        );
        assert_eq!(
            instance.registration("org/m", false).id.as_deref(),
            Some("static-decode-10.0.0.2:8200-org-m")
        );
    }
}
