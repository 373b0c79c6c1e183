//! Probes and metrics: `/health`, `/ready`, `/metrics`, and the 404 fallback.

use crate::edge::app::Scrape;
use crate::edge::server::Shutdown;
use crate::error::ApiError;
use crate::membership::Registry;
use crate::observe::metrics::InstanceSample;
use crate::store::ResponseStores;
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
    State(registry): State<Arc<Registry>>,
    State(responses): State<Arc<ResponseStores>>,
    Extension(shutdown): Extension<Shutdown>,
) -> impl IntoResponse {
    // A router shutting down says so at once, so that load balancers stop
    // sending it new requests while its streams finish.
    let shutting_down = shutdown.draining.is_cancelled();
    let ready = registry.is_ready() && !shutting_down;
    // Where responses are stored: `memory` (this replica), `shared`
    // (--response-store), or `unavailable` (the store cannot be reached:
    // serving goes on, what is stored stays on this replica). Not a reason
    // to be unready: the replica still serves.
    let response_store = match &responses.shared {
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
            "instances": registry.list().len(),
            // With etcd: whether this replica's view is current (`stale` while
            // etcd is unreachable; routing goes on from the last view).
            "membership": registry.status(),
            "response_store": response_store,
        })),
    )
}

pub async fn metrics(
    State(registry): State<Arc<Registry>>,
    State(scrape): State<Scrape>,
) -> impl IntoResponse {
    let models = registry.models();
    crate::observe::metrics::declare_zero_series(models.iter().map(String::as_str));
    metrics::gauge!(crate::observe::metrics::BODY_BYTES_IN_FLIGHT)
        .set(scrape.body_budget.held() as f64);
    let mut text = scrape
        .recorder
        .as_ref()
        .map(|h| h.render())
        .unwrap_or_default();
    // The per-instance gauges, from the membership as it is now: a removed
    // instance has no series left.
    let instances = registry.list();
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

pub async fn not_found(uri: axum::http::Uri) -> axum::response::Response {
    ApiError::NotFound(format!("no route for {}", uri.path())).response_for(uri.path())
}
