//! `GET /v1/models`: the models served by at least one live instance, each as
//! an engine of it describes it (`max_model_len`, `owned_by`...).
//!
//! An engine's entry is cached per model for [`FRESH_FOR`] (a failed read for
//! [`RETRY_AFTER`]), so that clients polling the list do not reach the
//! engines: at most one engine call per model per period, whatever the
//! number of callers (concurrent callers of a stale model wait for the one
//! read, bounded by [`READ_TIMEOUT`]). Models no longer served leave the cache.

use crate::membership::model_list::{self, Cached, ModelLists};
use axum::extract::State;
use axum::http::HeaderMap;
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
pub async fn models(State(lists): State<Arc<ModelLists>>, headers: HeaderMap) -> Json<Value> {
    let served = lists.registry.models();
    let entries = served.iter().map(|id| entry(&lists, id, &served));
    let data: Vec<Value> = join_all(entries).await;
    if headers.contains_key("anthropic-version") {
        return Json(anthropic_list(data));
    }
    Json(json!({"object": "list", "data": data}))
}

/// The list as Anthropic's SDK reads it (every Anthropic client sends
/// `anthropic-version`): each entry a `model` with its `display_name` and
/// `created_at` (RFC 3339), one page.
fn anthropic_list(data: Vec<Value>) -> Value {
    let data: Vec<Value> = data
        .into_iter()
        .map(|entry| {
            let id = entry.get("id").cloned().unwrap_or(Value::Null);
            let created = entry.get("created").and_then(Value::as_u64).unwrap_or(0);
            json!({"type": "model", "id": id, "display_name": id, "created_at": rfc3339(created)})
        })
        .collect();
    let first = data.first().map(|e| e["id"].clone());
    let last = data.last().map(|e| e["id"].clone());
    json!({"data": data, "has_more": false, "first_id": first, "last_id": last})
}

/// Unix seconds as an RFC 3339 UTC time (days to a civil date: Howard
/// Hinnant's algorithm, exact for every u64 second before year 292277026596).
fn rfc3339(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rest = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// Model `id`'s entry: cached, else read from an instance of it (the last
/// entry read, or a plain one, when none answers in time).
async fn entry(lists: &ModelLists, id: &str, served: &[String]) -> Value {
    let Some(slot) = lists.cache.slot(id, served) else {
        return plain(id);
    };
    let mut cached = slot.lock().await;
    if let Some(cached) = cached.as_ref().filter(|c| c.until > Instant::now()) {
        return cached.entry.clone();
    }
    let (entry, fresh_for) = match read(lists, id).await {
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
async fn read(lists: &ModelLists, id: &str) -> Option<Value> {
    let instance = super::passthrough::choose(&lists.registry, id, &[])?;
    let list = model_list::fetch(&lists.client, &instance.url, READ_TIMEOUT)
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

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn unix_seconds_read_as_utc_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_508_319), "2026-12-05T22:05:19Z");
    }
}
