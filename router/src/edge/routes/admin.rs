//! The admin API: instances and the request journal. The bearer token is
//! checked once, by the [`super::access::admin`] layer on these routes.

use super::instances::{no_content_if_registered, not_registered, CheckedRegistration};
use crate::error::ApiError;
use crate::journal::Journal;
use crate::membership::{Claim, Lifecycle, Registry};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

pub async fn list_instances(
    State(registry): State<Arc<Registry>>,
) -> Result<Json<Value>, ApiError> {
    let data: Vec<Value> = registry.list().iter().map(|i| i.view()).collect();
    Ok(Json(json!({"data": data})))
}

/// Adds an instance, or replaces a live one under the same id (its old
/// credential stops working; the answer carries the new one).
pub async fn add_instance(
    State(registry): State<Arc<Registry>>,
    CheckedRegistration(reg): CheckedRegistration,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let (instance, credential) = registry.register(reg, Claim::Admin).await?;
    let mut view = instance.view();
    view["credential"] = json!(credential);
    Ok((StatusCode::CREATED, Json(view)))
}

async fn set_state(
    registry: &Registry,
    id: &str,
    lifecycle: Lifecycle,
) -> Result<Json<Value>, ApiError> {
    if !registry.set_lifecycle(id, lifecycle).await? {
        return Err(not_registered(id));
    }
    let view = registry.get(id).map(|i| i.view()).unwrap_or(Value::Null);
    Ok(Json(view))
}

/// `POST /admin/instances/{id}/drain[?migrate=true]`: no new requests; with
/// `migrate`, the instance's live decode streams move to other decoders now.
pub async fn drain(
    State(registry): State<Arc<Registry>>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let lifecycle = if flag(&query, "migrate")? {
        Lifecycle::Migrating
    } else {
        Lifecycle::Draining
    };
    set_state(&registry, &id, lifecycle).await
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
    State(registry): State<Arc<Registry>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    set_state(&registry, &id, Lifecycle::Ready).await
}

pub async fn remove_instance(
    State(registry): State<Arc<Registry>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    no_content_if_registered(registry.remove(&id, Claim::Admin).await?, &id)
}

pub async fn requests(
    State(journal): State<Arc<Journal>>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(
        json!({"data": journal.view(flag(&query, "verbose")?)}),
    ))
}
