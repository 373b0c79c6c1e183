//! OpenAI routes: completions and chat completions (the model list is
//! `models.rs`).

use super::body::{read_json, BodyLimits};
use crate::error::ApiError;
use crate::pd::record::RequestRecord;
use crate::pd::request::{validate, Route};
use crate::state::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use std::sync::Arc;
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
            let value = read_json(&headers, body, BodyLimits::client(&state.config)).await?;
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
            Ok((info, value)) => crate::pd::run(state.flow.clone(), info, value, record).await,
            Err(error) => {
                record.finish(error.status().as_u16());
                Err(error)
            }
        }
    }
    .instrument(span)
    .await
}
