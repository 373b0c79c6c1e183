//! Who may call the internal listener's routes, as tower layers: the admin
//! API takes the admin bearer token; registration takes the register token
//! or, when none is configured, only loopback peers (fail closed).

use crate::edge::secrets::bearer_matches;
use crate::engines::addresses::UpstreamPolicy;
use crate::error::ApiError;
use crate::tenants::Caller;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;
use std::net::SocketAddr;
use std::sync::Arc;

/// The credentials and policies of the internal listener.
#[derive(Debug)]
pub struct Access {
    pub admin_token: Option<String>,
    pub register_token: Option<String>,
    pub upstreams: UpstreamPolicy,
}

/// Header carrying an instance's credential (heartbeat, re-registration,
/// deregistration).
pub const CREDENTIAL_HEADER: &str = "x-connex-credential";

/// `route_layer` of the admin routes.
pub async fn admin(
    State(access): State<Arc<Access>>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let Some(token) = access.admin_token.as_deref() else {
        return Err(ApiError::Unauthorized(
            "the admin API is disabled: start the router with --admin-token",
        ));
    };
    let lacks = "a valid admin bearer token is required";
    bearer(token, lacks, request, next).await
}

/// `route_layer` of the registration routes.
pub async fn registrar(
    State(access): State<Arc<Access>>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    match access.register_token.as_deref() {
        Some(token) => {
            let lacks = "a valid registration token is required";
            bearer(token, lacks, request, next).await
        }
        None => {
            let peer = request
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map(|info| info.0.ip().to_canonical());
            if peer.is_some_and(|ip| ip.is_loopback()) {
                Ok(next.run(request).await)
            } else {
                Err(ApiError::Unauthorized(
                    "registration without --register-token is open to loopback peers only",
                ))
            }
        }
    }
}

/// Runs `request` when it carries `Authorization: Bearer <token>`; else a 401
/// saying what it `lacks`.
async fn bearer(
    token: &str,
    lacks: &'static str,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if !bearer_matches(request.headers(), token) {
        return Err(ApiError::Unauthorized(lacks));
    }
    Ok(next.run(request).await)
}

/// `route_layer` of the client routes that take a key but no slot: the
/// caller's tenant goes with the request (whose stored responses it may see).
pub async fn client_key(
    State(tenants): State<Arc<crate::tenants::Tenants>>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    match tenants.authenticate(request.headers()) {
        Ok(tenant) => {
            request.extensions_mut().insert(Caller::of(&tenant));
            Ok(next.run(request).await)
        }
        Err(error) => Ok(error.response_for(request.uri().path())),
    }
}

/// Registration and admin bodies must say they are JSON: a browser page can
/// send a cross-origin `text/plain` POST without a preflight, never a JSON one.
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if json {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType)
    }
}

/// The credential a registrant presented, if any.
pub fn credential(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(CREDENTIAL_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
}
