//! The router's whole HTTP surface, assembled in one place.

pub mod admin;
pub mod body;
pub mod instances;
pub mod openai;
pub mod probes;

use crate::state::AppState;
use axum::routing::{delete, get, post};
use axum::Router;
use std::sync::Arc;

/// Every route of the router.
pub fn routes(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/instances", post(instances::register))
        .route("/v1/instances/{id}", delete(instances::deregister))
        .route("/v1/instances/{id}/heartbeat", post(instances::heartbeat))
        .route(
            "/admin/instances",
            get(admin::list_instances).post(admin::add_instance),
        )
        .route("/admin/instances/{id}", delete(admin::remove_instance))
        .route("/admin/instances/{id}/drain", post(admin::drain))
        .route("/admin/instances/{id}/activate", post(admin::activate))
        .route("/admin/requests", get(admin::requests))
        .route("/health", get(probes::health))
        .route("/ready", get(probes::ready))
        .route("/metrics", get(probes::metrics))
        .fallback(probes::not_found)
        .with_state(state)
}
