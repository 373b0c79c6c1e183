//! Self-registration of engine instances: register, heartbeat, deregister.

use super::body::{read_json, read_optional_json};
use crate::error::ApiError;
use crate::registry::Registration;
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

/// Checks `Authorization: Bearer <expected>` when a token is configured.
pub fn check_bearer(
    headers: &HeaderMap,
    expected: Option<&str>,
    what: &'static str,
) -> Result<(), ApiError> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(expected) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized(what))
    }
}

/// Parses a registration body.
pub async fn registration(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Registration, ApiError> {
    let value = read_json(headers, body, limit).await?;
    let reg: Registration = serde_json::from_value(value)
        .map_err(|err| ApiError::bad_request(format!("invalid registration: {err}"), None))?;
    if !(reg.url.starts_with("http://") || reg.url.starts_with("https://")) {
        return Err(ApiError::bad_request(
            "`url` must be an http(s) URL",
            Some("url"),
        ));
    }
    if reg.model.is_empty() {
        return Err(ApiError::bad_request(
            "`model` must be non-empty",
            Some("model"),
        ));
    }
    // The id goes into URL paths (heartbeat, drain) and etcd keys unescaped.
    let valid_id = |id: &str| {
        (1..=128).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b))
    };
    if reg.id.as_deref().is_some_and(|id| !valid_id(id)) {
        return Err(ApiError::bad_request(
            "`id` must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
            Some("id"),
        ));
    }
    Ok(reg)
}

pub async fn register(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    check_bearer(
        &headers,
        state.config.register_token.as_deref(),
        "a valid registration token is required",
    )?;
    let reg = registration(&headers, body, 64 * 1024).await?;
    let instance = state.registry.register(reg).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"id": instance.id, "lease_ttl_s": state.config.heartbeat_ttl_s})),
    ))
}

pub async fn heartbeat(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    check_bearer(
        &headers,
        state.config.register_token.as_deref(),
        "a valid registration token is required",
    )?;
    let _stats = read_optional_json(&headers, body, 64 * 1024).await?;
    if state.registry.heartbeat(&id).await? {
        Ok(Json(
            json!({"id": id, "lease_ttl_s": state.config.heartbeat_ttl_s}),
        ))
    } else {
        Err(ApiError::NotFound(format!(
            "instance `{id}` is not registered"
        )))
    }
}

pub async fn deregister(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    check_bearer(
        &headers,
        state.config.register_token.as_deref(),
        "a valid registration token is required",
    )?;
    if state.registry.remove(&id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!(
            "instance `{id}` is not registered"
        )))
    }
}
