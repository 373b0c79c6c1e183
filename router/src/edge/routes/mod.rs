//! The router's whole HTTP surface, assembled in one place.
//!
//! Two listeners by audience: the client listener serves the OpenAI routes and
//! the probes; the internal listener serves registration (engines), the admin
//! API (operators) and `/metrics` (the scraper). The route table is data
//! ([`endpoints`]) so that it can be listed: the test that holds
//! `openapi/openapi.yaml` to the code compares against it.

pub mod access;
pub mod admin;
pub mod body;
pub mod instances;
pub mod messages;
pub mod models;
pub mod openai;
pub mod passthrough;
pub mod probes;
pub mod prologue;
pub mod responses;
pub mod translated;

use crate::edge::app::{AppState, HandlerState};
use crate::edge::gate::{self, ExposeInstances};
use crate::edge::server::Shutdown;
use crate::error::ApiError;
use crate::protocols::openai::request::Route;
use crate::tenants::{Caller, Tenants};
use access::Access;
use axum::body::Body;
use axum::extract::State;
use axum::handler::Handler;
use axum::http::HeaderMap;
use axum::http::Method;
use axum::middleware::from_fn_with_state;
use axum::response::Response;
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::{Extension, Router};
use std::future::Future;
use std::sync::Arc;

/// Which listener serves a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// `--listen`: clients.
    Client,
    /// `--internal-listen`: engines, operators, the metrics scraper.
    Internal,
}

impl Listener {
    pub fn as_str(self) -> &'static str {
        match self {
            Listener::Client => "client",
            Listener::Internal => "internal",
        }
    }
}

/// Who may call a route, beyond reaching its listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Guard {
    Open,
    /// A client key (when keys are configured), no slot.
    Keyed,
    /// The client gate: key and admission, instance headers, shutdown cut.
    Gated,
    /// The register token, or a loopback peer when none is set.
    Registrar,
    /// The admin bearer token.
    Admin,
}

/// One route: method, path (`{param}` syntax, as in OpenAPI) and its handler.
pub struct Endpoint {
    pub method: Method,
    pub path: &'static str,
    pub listener: Listener,
    guard: Guard,
    handler: MethodRouter<HandlerState>,
}

/// The HTTP methods the router uses.
#[derive(Clone, Copy)]
enum Verb {
    Get,
    Post,
    Delete,
}

impl Guard {
    /// The route `verb` `path` to `handler`, behind this guard.
    fn route<H, T>(self, verb: Verb, path: &'static str, handler: H) -> Endpoint
    where
        H: Handler<T, HandlerState>,
        T: 'static,
    {
        let (method, filter) = match verb {
            Verb::Get => (Method::GET, MethodFilter::GET),
            Verb::Post => (Method::POST, MethodFilter::POST),
            Verb::Delete => (Method::DELETE, MethodFilter::DELETE),
        };
        let listener = match (self, path) {
            (Guard::Open, "/metrics") | (Guard::Registrar | Guard::Admin, _) => Listener::Internal,
            (Guard::Open | Guard::Keyed | Guard::Gated, _) => Listener::Client,
        };
        Endpoint {
            method,
            path,
            listener,
            guard: self,
            handler: on(filter, handler),
        }
    }
}

/// A gated POST to `path` served by `serve`, told `route` (which of the
/// routes it serves this one is) and given the caller, headers and body.
fn gated_post<R, F, Fut>(path: &'static str, route: R, serve: F) -> Endpoint
where
    R: Copy + Send + Sync + 'static,
    F: Fn(Arc<AppState>, R, Option<Caller>, HeaderMap, Body) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response, ApiError>> + Send + 'static,
{
    let handler =
        move |State(state): State<Arc<AppState>>,
              caller: Option<Extension<Caller>>,
              headers: HeaderMap,
              body: Body| { serve(state, route, caller.map(|c| c.0), headers, body) };
    Guard::Gated.route(Verb::Post, path, handler)
}

/// A generating OpenAI route (completions, chat completions).
fn generating(route: Route) -> Endpoint {
    gated_post(route.path(), route, openai::generate)
}

/// A route of [`passthrough::PATHS`].
fn passthrough(path: &'static str) -> Endpoint {
    gated_post(path, path, passthrough::forward)
}

/// Every route of the router.
pub fn endpoints() -> Vec<Endpoint> {
    use Guard::{Admin, Gated, Keyed, Open, Registrar};
    use Verb::{Delete, Get, Post};
    let mut endpoints = vec![
        generating(Route::Completions),
        generating(Route::Chat),
        Gated.route(Post, "/v1/responses", responses::create),
        Gated.route(Post, "/v1/messages", messages::create),
        // Reads, deletes and cancels hold the router as requests do: an
        // admission slot and their tenant's limits.
        Gated.route(Get, "/v1/responses/{id}", responses::retrieve),
        Gated.route(Delete, "/v1/responses/{id}", responses::delete),
        Gated.route(Post, "/v1/responses/{id}/cancel", responses::cancel),
        Keyed.route(Get, "/v1/models", models::models),
        Open.route(Get, "/health", probes::health),
        Open.route(Get, "/ready", probes::ready),
        Registrar.route(Post, "/v1/instances", instances::register),
        Registrar.route(Delete, "/v1/instances/{id}", instances::deregister),
        Registrar.route(Post, "/v1/instances/{id}/heartbeat", instances::heartbeat),
        Registrar.route(Post, "/v1/instances/{id}/kv-events", instances::kv_events),
        Admin.route(Get, "/admin/instances", admin::list_instances),
        Admin.route(Post, "/admin/instances", admin::add_instance),
        Admin.route(Delete, "/admin/instances/{id}", admin::remove_instance),
        Admin.route(Post, "/admin/instances/{id}/drain", admin::drain),
        Admin.route(Post, "/admin/instances/{id}/activate", admin::activate),
        Admin.route(Get, "/admin/requests", admin::requests),
        Open.route(Get, "/metrics", probes::metrics),
    ];
    endpoints.extend(passthrough::PATHS.iter().map(|path| passthrough(path)));
    endpoints
}

/// (method, path) of every route.
pub fn route_list() -> Vec<(Method, &'static str)> {
    endpoints()
        .into_iter()
        .map(|e| (e.method, e.path))
        .collect()
}

/// (method, path, listener) of every route.
pub fn route_table() -> Vec<(Method, &'static str, Listener)> {
    endpoints()
        .into_iter()
        .map(|e| (e.method, e.path, e.listener))
        .collect()
}

/// What the layers of both listeners share.
#[derive(Clone)]
pub struct Edge {
    pub access: Arc<Access>,
    /// The callers and their admission.
    pub tenants: Arc<Tenants>,
    pub expose_instances: ExposeInstances,
    pub shutdown: Shutdown,
}

/// Routes of `listener` guarded by `guard`, with the guard's layer.
fn group(listener: Listener, guard: Guard, edge: &Edge) -> Router<HandlerState> {
    let routes: Vec<Endpoint> = endpoints()
        .into_iter()
        .filter(|e| e.listener == listener && e.guard == guard)
        .collect();
    if routes.is_empty() {
        return Router::new();
    }
    let router = routes
        .into_iter()
        // Routes on one path with different methods merge into one.
        .fold(Router::new(), |router, e| router.route(e.path, e.handler));
    match guard {
        Guard::Open => router,
        Guard::Keyed => {
            router.route_layer(from_fn_with_state(edge.tenants.clone(), access::client_key))
        }
        Guard::Gated => router
            .route_layer(from_fn_with_state(edge.tenants.clone(), gate::admit))
            .route_layer(from_fn_with_state(
                edge.expose_instances,
                gate::strip_instance_headers,
            ))
            .route_layer(from_fn_with_state(
                edge.shutdown.clone(),
                gate::cut_at_shutdown,
            )),
        Guard::Registrar => {
            router.route_layer(from_fn_with_state(edge.access.clone(), access::registrar))
        }
        Guard::Admin => router.route_layer(from_fn_with_state(edge.access.clone(), access::admin)),
    }
}

/// The app of `listener`.
pub fn routes(listener: Listener, state: Arc<AppState>, edge: &Edge) -> Router {
    [
        Guard::Open,
        Guard::Keyed,
        Guard::Gated,
        Guard::Registrar,
        Guard::Admin,
    ]
    .into_iter()
    .fold(Router::new(), |router, guard| {
        router.merge(group(listener, guard, edge))
    })
    .fallback(probes::not_found)
    .layer(Extension(edge.access.clone()))
    .layer(Extension(edge.shutdown.clone()))
    .with_state(HandlerState(state))
}
