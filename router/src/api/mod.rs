//! The router's whole HTTP surface, assembled in one place.
//!
//! The route table is data ([`endpoints`]) so that it can be listed: the test
//! that holds `openapi/openapi.yaml` to the code compares against it.

pub mod admin;
pub mod body;
pub mod instances;
pub mod openai;
pub mod probes;

use crate::state::AppState;
use axum::handler::Handler;
use axum::http::Method;
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::Router;
use std::sync::Arc;

/// One route: method, path (`{param}` syntax, as in OpenAPI) and its handler.
pub struct Endpoint {
    pub method: Method,
    pub path: &'static str,
    handler: MethodRouter<Arc<AppState>>,
}

/// The HTTP methods the router uses.
#[derive(Clone, Copy)]
enum Verb {
    Get,
    Post,
    Delete,
}

fn at<H, T>(verb: Verb, path: &'static str, handler: H) -> Endpoint
where
    H: Handler<T, Arc<AppState>>,
    T: 'static,
{
    let (method, filter) = match verb {
        Verb::Get => (Method::GET, MethodFilter::GET),
        Verb::Post => (Method::POST, MethodFilter::POST),
        Verb::Delete => (Method::DELETE, MethodFilter::DELETE),
    };
    Endpoint {
        method,
        path,
        handler: on(filter, handler),
    }
}

/// Every route of the router.
pub fn endpoints() -> Vec<Endpoint> {
    use Verb::{Delete, Get, Post};
    vec![
        at(Post, "/v1/completions", openai::completions),
        at(Post, "/v1/chat/completions", openai::chat_completions),
        at(Get, "/v1/models", openai::models),
        at(Post, "/v1/instances", instances::register),
        at(Delete, "/v1/instances/{id}", instances::deregister),
        at(Post, "/v1/instances/{id}/heartbeat", instances::heartbeat),
        at(Get, "/admin/instances", admin::list_instances),
        at(Post, "/admin/instances", admin::add_instance),
        at(Delete, "/admin/instances/{id}", admin::remove_instance),
        at(Post, "/admin/instances/{id}/drain", admin::drain),
        at(Post, "/admin/instances/{id}/activate", admin::activate),
        at(Get, "/admin/requests", admin::requests),
        at(Get, "/health", probes::health),
        at(Get, "/ready", probes::ready),
        at(Get, "/metrics", probes::metrics),
    ]
}

/// (method, path) of every route.
pub fn route_list() -> Vec<(Method, &'static str)> {
    endpoints()
        .into_iter()
        .map(|e| (e.method, e.path))
        .collect()
}

/// The router's axum app.
pub fn routes(state: Arc<AppState>) -> Router {
    endpoints()
        .into_iter()
        // Routes on one path with different methods merge into one.
        .fold(Router::new(), |router, e| router.route(e.path, e.handler))
        .fallback(probes::not_found)
        .with_state(state)
}
