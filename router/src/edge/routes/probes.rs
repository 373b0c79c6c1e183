//! Probes and metrics: `/health`, `/ready`, `/metrics`, and the 404 fallback.

use crate::edge::server::Shutdown;
use crate::error::ApiError;
use crate::observe::metrics::InstanceSample;
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde_json::json;
use std::sync::Arc;

pub async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

pub async fn ready(
    State(state): State<Arc<AppState>>,
    Extension(shutdown): Extension<Shutdown>,
) -> impl IntoResponse {
    // A router shutting down says so at once, so that load balancers stop
    // sending it new requests while its streams finish.
    let shutting_down = shutdown.draining.is_cancelled();
    let ready = state.flow.registry.is_ready() && !shutting_down;
    // Where responses are stored: `memory` (this replica), `shared`
    // (--response-store), or `unavailable` (the store cannot be reached:
    // serving goes on, what is stored stays on this replica). Not a reason
    // to be unready: the replica still serves.
    let response_store = match &state.shared_responses {
        None => "memory",
        Some(store) if store.check().await => "shared",
        Some(_) => "unavailable",
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({
            "ready": ready,
            "shutting_down": shutting_down,
            "instances": state.flow.registry.list().len(),
            // With etcd: whether this replica's view is current (`stale` while
            // etcd is unreachable; routing goes on from the last view).
            "membership": state.flow.registry.status(),
            "response_store": response_store,
        })),
    )
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let models = state.flow.registry.models();
    crate::observe::metrics::declare_zero_series(models.iter().map(String::as_str));
    metrics::gauge!(crate::observe::metrics::BODY_BYTES_IN_FLIGHT)
        .set(state.body_budget.held() as f64);
    let mut text = state
        .metrics
        .as_ref()
        .map(|h| h.render())
        .unwrap_or_default();
    // The per-instance gauges, from the membership as it is now: a removed
    // instance has no series left.
    let instances = state.flow.registry.list();
    let samples: Vec<InstanceSample<'_>> = instances
        .iter()
        .map(|i| InstanceSample {
            id: &i.id,
            role: i.role.as_str(),
            model: &i.model,
            state: if i.is_unhealthy() {
                "unhealthy"
            } else {
                i.lifecycle().as_str()
            },
            inflight: i.inflight(),
        })
        .collect();
    text.push_str(&crate::observe::metrics::render_instances(&samples));
    ([("content-type", "text/plain; version=0.0.4")], text)
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {}", uri.path()))
}
