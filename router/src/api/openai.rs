//! OpenAI routes: completions, chat completions and the model list.

use super::body::read_json;
use crate::error::ApiError;
use crate::pd::record::RequestRecord;
use crate::pd::request::{validate, Route};
use crate::pd::upstream::read_capped;
use crate::state::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Json;
use futures_util::future::join_all;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    generate(state, Route::Completions, headers, body).await
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    generate(state, Route::Chat, headers, body).await
}

/// The `X-Request-Id` the client sent, or a new one.
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|id| !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string())
}

async fn generate(
    state: Arc<AppState>,
    route: Route,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    // Records the request (span, metrics, access line) when it ends, however
    // it ends (a client that disconnects included).
    let mut record = RequestRecord::new(route.path(), request_id(&headers));
    crate::traces::continue_trace(record.span(), &headers);
    let span = record.span().clone();
    async move {
        let checked = async {
            let value = read_json(&headers, body, state.config.max_body_bytes).await?;
            let info = validate(
                route,
                &value,
                record.request_id().to_string(),
                state.config.max_tokens_limit,
            )?;
            Ok::<_, ApiError>((info, value))
        }
        .await;
        match checked {
            // The model label is set once the model is known to be served
            // (pd::start): a client's made-up names must not become series.
            Ok((info, value)) => crate::pd::run(state, info, value, record).await,
            Err(error) => {
                record.finish(error.status().as_u16());
                Err(error)
            }
        }
    }
    .instrument(span)
    .await
}

/// How long `/v1/models` waits for an engine's own entry of a model.
const MODEL_INFO_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest engine model list read.
const MAX_MODEL_LIST: usize = 256 * 1024;

/// Models served by at least one live instance, each as an instance of it
/// describes it (`max_model_len`, `owned_by`...), or a plain entry when none
/// answers in time.
pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let entries = state
        .registry
        .models()
        .into_iter()
        .map(|id| model_entry(&state, id));
    let data: Vec<Value> = join_all(entries).await;
    Json(json!({"object": "list", "data": data}))
}

async fn model_entry(state: &AppState, id: String) -> Value {
    let fetch = async {
        let instance = super::passthrough::choose(state, &id, &[])?;
        let url = format!("{}/v1/models", instance.url);
        let response = state.client.get(url).send().await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body = read_capped(reqwest::Body::from(response), MAX_MODEL_LIST, true)
            .await
            .ok()?;
        let list: Value = serde_json::from_slice(&body).ok()?;
        list.get("data")?
            .as_array()?
            .iter()
            .find(|m| m.is_object() && m["id"] == id.as_str())
            .cloned()
    };
    tokio::time::timeout(MODEL_INFO_TIMEOUT, fetch)
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| json!({"id": id, "object": "model", "created": 0, "owned_by": "connex"}))
}
