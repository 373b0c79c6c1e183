//! The admin API (bearer token): instances and the request journal.

use super::instances::{check_bearer, registration};
use crate::error::ApiError;
use crate::registry::Lifecycle;
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    match state.config.admin_token.as_deref() {
        None => Err(ApiError::Unauthorized(
            "the admin API is disabled: start the router with --admin-token",
        )),
        Some(token) => check_bearer(
            headers,
            Some(token),
            "a valid admin bearer token is required",
        ),
    }
}

pub async fn list_instances(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let data: Vec<Value> = state.registry.list().iter().map(|i| i.view()).collect();
    Ok(Json(json!({"data": data})))
}

pub async fn add_instance(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    authorize(&state, &headers)?;
    let reg = registration(&headers, body, 64 * 1024).await?;
    let instance = state.registry.register(reg).await?;
    Ok((StatusCode::CREATED, Json(instance.view())))
}

async fn set_state(
    state: &AppState,
    id: &str,
    lifecycle: Lifecycle,
) -> Result<Json<Value>, ApiError> {
    if !state.registry.set_lifecycle(id, lifecycle).await? {
        return Err(ApiError::NotFound(format!(
            "instance `{id}` is not registered"
        )));
    }
    let view = state
        .registry
        .get(id)
        .map(|i| i.view())
        .unwrap_or(Value::Null);
    Ok(Json(view))
}

/// `POST /admin/instances/{id}/drain[?migrate=true]`: no new requests; with
/// `migrate`, the instance's live decode streams move to other decoders now.
pub async fn drain(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let lifecycle = if flag(&query, "migrate")? {
        Lifecycle::Migrating
    } else {
        Lifecycle::Draining
    };
    set_state(&state, &id, lifecycle).await
}

/// A boolean query parameter: `true` or `1`, `false` or `0`, absent (false).
/// Anything else is refused rather than read as false: `migrate=yes` must not
/// quietly become a plain drain.
fn flag(query: &HashMap<String, String>, key: &'static str) -> Result<bool, ApiError> {
    match query.get(key).map(String::as_str) {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(_) => Err(ApiError::bad_request(
            format!("`{key}` must be true, false, 1 or 0"),
            Some(key),
        )),
    }
}

pub async fn activate(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    set_state(&state, &id, Lifecycle::Ready).await
}

pub async fn remove_instance(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    authorize(&state, &headers)?;
    if state.registry.remove(&id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!(
            "instance `{id}` is not registered"
        )))
    }
}

pub async fn requests(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    Ok(Json(
        json!({"data": state.journal.view(flag(&query, "verbose")?)}),
    ))
}
