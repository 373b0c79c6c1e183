//! Self-registration of engine instances: register, heartbeat, deregister.
//! Who may call them is the [`super::access::registrar`] layer's job; which
//! id a caller may act on is the credential's.

use super::access::{credential, require_json, Access};
use super::body::{read_json, read_optional_json, BodyLimits};
use crate::error::ApiError;
use crate::membership::load::EngineLoad;
use crate::membership::static_instances::STATIC_ID_PREFIX;
use crate::membership::{valid_id, Claim, Registration, Registry};
use crate::pd::deps::FlowDeps;
use crate::prefix::KvEventBatch;
use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use std::sync::Arc;

/// Time an engine has to send a registration, heartbeat or KV event body
/// (each at most a few MiB, from inside the cluster).
const INTERNAL_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Largest registration or heartbeat body.
const BODY_LIMIT: BodyLimits = BodyLimits {
    bytes: 64 * 1024,
    within: INTERNAL_BODY_TIMEOUT,
};

/// A registration body, parsed and checked against the router's [`Access`]
/// (from the routes' extension): what both the registration and the admin
/// API take.
pub struct CheckedRegistration(pub Registration);

impl<S: Send + Sync> FromRequest<S> for CheckedRegistration {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        let (mut parts, body) = request.into_parts();
        let Extension(access) = Extension::<Arc<Access>>::from_request_parts(&mut parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        registration(&access, &parts.headers, body)
            .await
            .map(Self)
            .map_err(IntoResponse::into_response)
    }
}

/// Parses and checks a registration body (JSON only; URL and ctrl within the
/// upstream policy).
async fn registration(
    access: &Access,
    headers: &HeaderMap,
    body: Body,
) -> Result<Registration, ApiError> {
    require_json(headers)?;
    let value = read_json(headers, body, BODY_LIMIT).await?;
    let mut reg: Registration = serde_json::from_value(value)
        .map_err(|err| ApiError::bad_request(format!("invalid registration: {err}"), None))?;
    reg.url = access
        .upstreams
        .check_url(&reg.url)
        .await
        .map_err(|why| ApiError::bad_request(format!("`url` {why}"), Some("url")))?;
    if let Some(ctrl) = &reg.ctrl {
        access
            .upstreams
            .check_ctrl(ctrl)
            .await
            .map_err(|why| ApiError::bad_request(format!("`ctrl`: {why}"), Some("ctrl")))?;
    }
    if reg.model.is_empty() {
        return Err(ApiError::bad_request(
            "`model` must be non-empty",
            Some("model"),
        ));
    }
    if reg.id.as_deref().is_some_and(|id| !valid_id(id)) {
        return Err(ApiError::bad_request(
            "`id` must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
            Some("id"),
        ));
    }
    Ok(reg)
}

pub async fn register(
    State(registry): State<Arc<Registry>>,
    headers: HeaderMap,
    CheckedRegistration(reg): CheckedRegistration,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    if reg.persistent {
        // A persistent instance never expires: only an operator adds one.
        return Err(ApiError::bad_request(
            "`persistent` instances are added by the admin API (POST /admin/instances) or the router's --prefill/--decode flags",
            Some("persistent"),
        ));
    }
    if reg
        .id
        .as_deref()
        .is_some_and(|id| id.starts_with(STATIC_ID_PREFIX))
    {
        // The router names the instances of its --prefill/--decode flags so:
        // a registrant that took such an id first would receive their
        // traffic once discovery added them.
        return Err(ApiError::bad_request(
            "ids starting with `static-` are the router's own (its --prefill/--decode instances)",
            Some("id"),
        ));
    }
    let claim = Claim::Registrant(credential(&headers));
    let (instance, credential) = registry.register(reg, claim).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "id": instance.id,
            "lease_ttl_s": registry.ttl().as_secs(),
            "credential": credential,
        })),
    ))
}

pub async fn heartbeat(
    State(registry): State<Arc<Registry>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let stats = read_optional_json(&headers, body, BODY_LIMIT).await?;
    if !stats.is_null() {
        require_json(&headers)?;
    }
    let load = EngineLoad::from_heartbeat(&stats)
        .map_err(|bad| ApiError::bad_request(bad.to_string(), Some(bad.field)))?;
    if registry.heartbeat(&id, credential(&headers), load).await? {
        Ok(Json(
            json!({"id": id, "lease_ttl_s": registry.ttl().as_secs()}),
        ))
    } else {
        Err(not_registered(&id))
    }
}

/// Largest KV event batch.
const EVENTS_BODY_LIMIT: BodyLimits = BodyLimits {
    bytes: 4 * 1024 * 1024,
    within: INTERNAL_BODY_TIMEOUT,
};

/// KV cache events of an instance (forwarded by its agent), into its prefix
/// index: same caller and credential as its heartbeats.
pub async fn kv_events(
    State(deps): State<Arc<FlowDeps>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    require_json(&headers)?;
    // The credential first: a caller without it must not have the router read
    // and parse a batch of up to 4 MiB before its 403.
    if deps
        .registry
        .registrant(&id, credential(&headers))?
        .is_none()
    {
        return Err(not_registered(&id));
    }
    let value = read_json(&headers, body, EVENTS_BODY_LIMIT).await?;
    let batch: KvEventBatch = serde_json::from_value(value).map_err(|err| {
        ApiError::bad_request(format!("invalid KV events: {err}"), Some("events"))
    })?;
    batch
        .check()
        .map_err(|bad| ApiError::bad_request(bad.to_string(), Some("events")))?;
    let cap = deps.routing.prefix_index_blocks;
    let found = deps
        .registry
        .kv_events(&id, credential(&headers), &batch, cap)?;
    no_content_if_registered(found, &id)
}

pub async fn deregister(
    State(registry): State<Arc<Registry>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    let claim = Claim::Registrant(credential(&headers));
    no_content_if_registered(registry.remove(&id, claim).await?, &id)
}

/// 204 when instance `id` was there to act on, else 404.
pub fn no_content_if_registered(registered: bool, id: &str) -> Result<StatusCode, ApiError> {
    if registered {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(not_registered(id))
    }
}

/// The 404 of a call on an instance the registry does not have.
pub fn not_registered(id: &str) -> ApiError {
    ApiError::NotFound(format!("instance `{id}` is not registered"))
}
