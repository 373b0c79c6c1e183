//! Static instances: engines without the connector's agent, named by the
//! operator (`--prefill URL[,CTRL]`, `--decode URL`, `--static-model`, or the
//! same keys in the TOML file), as vllm-router's `--prefill`/`--decode` do.
//! They are registered at start as persistent instances: no heartbeats, kept
//! until removed, out of rotation while their health probes fail. Their URLs
//! are held to the same upstream policy as any registration.

use crate::config::RouterConfig;
use crate::registry::{Registration, Role};
use crate::upstreams::UpstreamPolicy;

/// A static instance the router cannot take.
#[derive(Debug, thiserror::Error)]
pub enum StaticError {
    #[error("static instances (--prefill/--decode) need the model they serve: --static-model")]
    NoModel,
    #[error("static instance `{given}`: {why}")]
    Invalid { given: String, why: String },
}

/// The registrations of the configured static instances (none without flags).
pub async fn registrations(
    config: &RouterConfig,
    upstreams: &UpstreamPolicy,
) -> Result<Vec<Registration>, StaticError> {
    let listed = config
        .prefill
        .iter()
        .map(|e| (Role::Prefill, e))
        .chain(config.decode.iter().map(|e| (Role::Decode, e)));
    let mut out = Vec::new();
    for (role, given) in listed {
        let model = config.static_model.clone().ok_or(StaticError::NoModel)?;
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
        out.push(Registration {
            id: Some(static_id(role, &url)),
            role,
            url,
            model,
            ctrl,
            persistent: true,
            credential: None,
        });
    }
    Ok(out)
}

/// The id of a static instance: the same on every replica given the same
/// flags, so that (with etcd) they name one instance.
fn static_id(role: Role, url: &str) -> String {
    let role = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "both",
    };
    let address = url.split_once("://").map_or(url, |(_, rest)| rest);
    let address: String = address
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._:-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(100)
        .collect();
    format!("static-{role}-{address}")
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
    }
}
