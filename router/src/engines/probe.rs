//! `ProbeClient`: the `GET`s of health probes and model lists, over the one
//! engine client (`http/`), so that they are held to the address policy
//! (`addresses.rs`) at every connect like every other call to an engine.

use super::http::{ClientError, EngineClient, Response};
use std::time::Duration;

/// The probes' and model-list calls' `GET`s of registered URLs, over the one
/// engine client (`engines::http`): each connect goes to an address the
/// policy allows, resolved just before, with the registered authority in
/// `Host`, and no redirect is ever followed (a registered engine must not
/// send the router, its requests or its probes elsewhere).
#[derive(Clone)]
pub struct ProbeClient {
    engines: EngineClient,
}

/// Why a probe or model-list call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("`{0}` is not an http://host:port URL")]
    NotUrl(String),
    #[error(transparent)]
    Engine(#[from] ClientError),
    #[error("no answer in {0:?}")]
    Timeout(Duration),
}

impl ProbeClient {
    pub fn new(engines: EngineClient) -> Self {
        Self { engines }
    }

    /// `GET url` (a registered origin and a path), its head within `timeout`.
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<Response, ProbeError> {
        let not_url = || ProbeError::NotUrl(url.to_string());
        let rest = url.strip_prefix("http://").ok_or_else(not_url)?;
        let at = rest.find('/').ok_or_else(not_url)?;
        let origin = &url[..("http://".len() + at)];
        tokio::time::timeout(timeout, self.engines.get(origin, &rest[at..]))
            .await
            .map_err(|_| ProbeError::Timeout(timeout))?
            .map_err(ProbeError::Engine)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::engines::addresses::testing::{places, rebindable};
    use crate::engines::addresses::CtrlResolver;
    use std::sync::Arc;

    /// N6: an engine registers `http://engine.test:<port>` while its name
    /// points inside the allowed range, then re-points the name. The
    /// router's probes and model-list calls (ProbeClient) and hold calls (the
    /// control client) must not reach the new address (its requests:
    /// `engines::http`'s tests). Before, each connect resolved the name again
    /// with no check.
    #[tokio::test]
    async fn probes_and_hold_calls_do_not_follow_a_rebound_name() {
        let places = places().await;
        let (policy, names) = rebindable();
        names.point("engine.test", "127.0.0.2");
        let url = format!("http://engine.test:{}", places.port);
        assert_eq!(policy.check_url(&url).await.unwrap(), url);
        let probes = ProbeClient::new(EngineClient::guarded(
            Duration::from_secs(1),
            8,
            Duration::from_secs(4),
            policy.clone(),
        ));
        let holds = connex_transfer::CtrlClient::with_config(connex_transfer::ClientConfig {
            resolver: Some(connex_transfer::Resolver(Arc::new(CtrlResolver(
                policy.clone(),
            )))),
            secret: None,
            connect_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_millis(200),
            ..Default::default()
        });
        let ctrl = format!("engine.test:{}", places.port);

        // While the name points at the engine, everything reaches it.
        let health = format!("{url}/health");
        let probe = probes.get(&health, Duration::from_secs(1)).await.unwrap();
        assert_eq!(probe.status, 200);
        let _ = holds.stat(&ctrl, "t").await; // not a holder: any error, once connected
        let reached = places.engine.lock().unwrap().clone();
        assert_eq!(reached.len(), 2, "{reached:?}");
        assert!(
            reached[0]
                .to_ascii_lowercase()
                .contains(&format!("host: engine.test:{}", places.port)),
            "the probe names the registered host: {}",
            reached[0]
        );

        names.point("engine.test", "127.0.0.1");
        let Err(refused) = probes
            .get(&format!("{url}/health"), Duration::from_secs(1))
            .await
        else {
            panic!("the probe reached the rebound address");
        };
        assert!(
            refused.to_string().contains("outside --allowed-upstreams"),
            "{refused}"
        );
        let refused = holds.stat(&ctrl, "t").await.unwrap_err();
        assert!(
            refused.to_string().contains("outside --allowed-upstreams"),
            "{refused}"
        );
        assert!(
            places.forbidden.lock().unwrap().is_empty(),
            "the rebound address was reached"
        );
    }
}
