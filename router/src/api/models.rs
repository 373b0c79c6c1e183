//! `GET /v1/models`: the models served by at least one live instance, each as
//! an engine of it describes it (`max_model_len`, `owned_by`...).
//!
//! An engine's entry is cached per model for [`FRESH_FOR`] (a failed read for
//! [`RETRY_AFTER`]), so that clients polling the list do not reach the
//! engines: at most one engine call per model per period, whatever the
//! number of callers (concurrent callers of a stale model wait for the one
//! read, bounded by [`READ_TIMEOUT`]). Models no longer served leave the cache.

use crate::model_list::{self, Cached};
use crate::state::AppState;
use axum::extract::State;
use axum::Json;
use futures_util::future::join_all;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an engine's entry of a model is served without asking again.
pub const FRESH_FOR: Duration = Duration::from_secs(5);
/// How long a model whose engine did not answer waits before it is asked again.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long `/v1/models` waits for an engine's own entry of a model.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let served = state.registry.models();
    let entries = served.iter().map(|id| entry(&state, id, &served));
    let data: Vec<Value> = join_all(entries).await;
    Json(json!({"object": "list", "data": data}))
}

/// Model `id`'s entry: cached, else read from an instance of it (the last
/// entry read, or a plain one, when none answers in time).
async fn entry(state: &AppState, id: &str, served: &[String]) -> Value {
    let Some(slot) = state.models.slot(id, served) else {
        return plain(id);
    };
    let mut cached = slot.lock().await;
    if let Some(cached) = cached.as_ref().filter(|c| c.until > Instant::now()) {
        return cached.entry.clone();
    }
    let (entry, fresh_for) = match read(state, id).await {
        Some(entry) => (entry, FRESH_FOR),
        None => {
            let last = cached.take().map(|c| c.entry);
            (last.unwrap_or_else(|| plain(id)), RETRY_AFTER)
        }
    };
    *cached = Some(Cached {
        entry: entry.clone(),
        until: Instant::now() + fresh_for,
    });
    entry
}

/// The entry of `id` in the model list of an instance that serves it.
async fn read(state: &AppState, id: &str) -> Option<Value> {
    let instance = super::passthrough::choose(state, id, &[])?;
    let list = model_list::fetch(&state.client, &instance.url, READ_TIMEOUT)
        .await
        .inspect_err(|error| {
            tracing::debug!(instance = %instance.id, %error, "model list not read");
        })
        .ok()?;
    list.into_iter()
        .find(|entry| entry.get("id").and_then(Value::as_str) == Some(id))
        .map(Value::Object)
}

fn plain(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "connex"})
}
