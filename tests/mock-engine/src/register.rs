//! Self-registration with a Connex router, then heartbeats until shutdown.

use crate::api::EngineState;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Header carrying the credential the router issued for our id.
const CREDENTIAL_HEADER: &str = "x-connex-credential";

/// Registers (at the router's internal listener), heartbeats every third of
/// the lease TTL (re-registering when the router forgot us) and deregisters on
/// shutdown, presenting the credential of the first registration each time.
/// Owned by [`crate::MockEngine`].
pub async fn run(router: String, state: Arc<EngineState>, shutdown: CancellationToken) {
    let client = reqwest::Client::new();
    let router = router.trim_end_matches('/').to_string();
    // A credential kept by an earlier run under the same id, if any.
    let saved = state.config.credential_file.clone();
    let mut credential: Option<String> = saved
        .as_ref()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty());
    let auth = |req: reqwest::RequestBuilder, credential: &Option<String>| {
        let req = match &state.config.register_token {
            Some(token) => req.bearer_auth(token),
            None => req,
        };
        match credential {
            Some(credential) => req.header(CREDENTIAL_HEADER, credential),
            None => req,
        }
    };
    let mut registered: Option<(String, u64)> = None;
    let mut next_heartbeat = Instant::now();
    loop {
        let wait = match &registered {
            None => {
                let body = json!({"role":state.config.role,"url":state.url(),"model":state.config.model,"id":state.config.id,"ctrl":state.kv.ctrl_addr()});
                match auth(
                    client.post(format!("{router}/v1/instances")).json(&body),
                    &credential,
                )
                .send()
                .await
                {
                    Ok(resp) if resp.status().is_success() => {
                        let reply: Value = resp.json().await.unwrap_or_default();
                        let id = reply
                            .get("id")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string();
                        let ttl = reply
                            .get("lease_ttl_s")
                            .and_then(Value::as_u64)
                            .unwrap_or(10)
                            .max(1);
                        if let Some(issued) = reply.get("credential").and_then(Value::as_str) {
                            credential = Some(issued.to_string());
                            if let Some(path) = &saved {
                                if let Err(err) = std::fs::write(path, issued) {
                                    tracing::warn!(%err, "cannot keep the credential");
                                }
                            }
                        }
                        tracing::info!(%id, ttl, "registered with router");
                        // The router starts this id's prefix index afresh.
                        if let Some(prefix) = &state.prefix {
                            prefix.lock().unwrap_or_else(|e| e.into_inner()).clear();
                        }
                        registered = Some((id, ttl));
                        next_heartbeat = Instant::now() + Duration::from_millis(ttl * 1000 / 3);
                        Duration::from_millis(ttl * 1000 / 3)
                    }
                    Ok(resp) => {
                        tracing::warn!(status = %resp.status(), "registration refused");
                        Duration::from_millis(500)
                    }
                    Err(err) => {
                        tracing::debug!(%err, "router unreachable");
                        Duration::from_millis(200)
                    }
                }
            }
            Some((id, ttl)) => {
                let (id, ttl) = (id.clone(), *ttl);
                if !forward_events(&client, &router, &id, &state, |r| auth(r, &credential)).await {
                    registered = None;
                    continue;
                }
                if Instant::now() >= next_heartbeat {
                    // The load stats a vLLM agent reports (running, waiting, KV usage).
                    let body = json!({
                        "running": state.inflight.load(Ordering::Relaxed),
                        "waiting": state.config.report_waiting,
                        "kv_usage": state.kv_usage(),
                    });
                    let url = format!("{router}/v1/instances/{id}/heartbeat");
                    next_heartbeat = Instant::now() + Duration::from_millis(ttl * 1000 / 3);
                    match auth(client.post(url).json(&body), &credential).send().await {
                        Ok(resp) if resp.status() == reqwest::StatusCode::NOT_FOUND => {
                            registered = None
                        }
                        Ok(_) => {}
                        Err(err) => tracing::debug!(%err, "heartbeat failed"),
                    }
                }
                next_heartbeat.saturating_duration_since(Instant::now())
            }
        };
        let events = async {
            if registered.is_some() && state.prefix.is_some() && state.config.kv_events {
                state.events_ready.notified().await
            } else {
                std::future::pending().await
            }
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
            _ = events => {}
        }
    }
    if let Some((id, _)) = registered {
        let _ = auth(
            client.delete(format!("{router}/v1/instances/{id}")),
            &credential,
        )
        .send()
        .await;
    }
}

/// Forwards the prefix cache's pending KV events to the router, as vLLM's
/// agent does. `false` when the router forgot the instance (register again);
/// events that could not be sent are kept for the next round.
async fn forward_events(
    client: &reqwest::Client,
    router: &str,
    id: &str,
    state: &EngineState,
    auth: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
) -> bool {
    let Some(prefix) = &state.prefix else {
        return true;
    };
    if !state.config.kv_events {
        // Kept bounded, never sent.
        prefix
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take_events();
        return true;
    }
    let events = prefix
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take_events();
    if events.is_empty() {
        return true;
    }
    let url = format!("{router}/v1/instances/{id}/kv-events");
    let mut body = json!({ "events": events });
    match auth(client.post(url).json(&body)).send().await {
        Ok(resp) if resp.status() == reqwest::StatusCode::NOT_FOUND => false,
        Ok(resp) if resp.status().is_success() => true,
        Ok(resp) => {
            tracing::warn!(status = %resp.status(), "KV events refused");
            true
        }
        Err(err) => {
            tracing::debug!(%err, "KV events not forwarded; kept");
            if let Value::Array(events) = body["events"].take() {
                prefix
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .put_back(events);
            }
            true
        }
    }
}
