//! Phase 2: decode. Opens a decoder's stream for a request: the client's body with
//! the prefill's `kv_transfer_params` (or, on a resume, the completions body that
//! continues it), always streaming toward the engine so that the router journals
//! every token as it comes.

use super::attempt::{Attempt, Cause, Failure};
use super::output::Source;
use crate::error::ApiError;
use crate::registry::{Instance, LoadGuard, Phase};
use crate::state::AppState;
use bytes::Bytes;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// The body sent to a decode instance for the client's own route.
pub fn decode_body(body: &Value, kv_transfer_params: &Value) -> Value {
    let mut body = body.clone();
    if let Some(map) = body.as_object_mut() {
        map.insert("stream".into(), Value::Bool(true));
        map.insert("return_token_ids".into(), Value::Bool(true));
        map.insert("stream_options".into(), json!({"include_usage": false}));
        map.insert("kv_transfer_params".into(), kv_transfer_params.clone());
    }
    body
}

/// Why no stream could be opened on a decoder.
#[derive(Debug)]
pub enum OpenError {
    /// The decoder failed (connect error, 5xx): another one may succeed.
    Failed(Failure),
    /// The decoder refused the request (4xx): its answer goes to the client.
    Rejected(ApiError),
}

/// Chooses a decoder for `model`: one that has not failed this request when there
/// is one, else any eligible one (a decoder that failed may have come back).
pub fn choose(state: &AppState, model: &str, failed: &[String]) -> Option<Arc<Instance>> {
    let candidates = state.registry.eligible(model, Phase::Decode);
    state
        .decode
        .select(&candidates, failed)
        .or_else(|| state.decode.select(&candidates, &[]))
}

/// Sends `payload` to `decoder` and returns its open stream.
pub async fn open(
    state: &AppState,
    decoder: Arc<Instance>,
    path: &str,
    request_id: &str,
    payload: Bytes,
    source: Source,
) -> Result<Attempt, OpenError> {
    let guard = LoadGuard::new(decoder.clone());
    crate::metrics::upstream_request(&decoder.id, "decode");
    let failed = |cause, message: String| {
        OpenError::Failed(Failure {
            decoder: decoder.id.clone(),
            cause,
            message,
        })
    };
    let sent = state
        .client
        .post(format!("{}{}", decoder.url, path))
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .body(payload)
        .send()
        .await;
    let stall = Duration::from_millis(state.config.stall_timeout_ms);
    match sent {
        Ok(response) if response.status().is_success() => {
            Ok(Attempt::new(response, guard, source, stall))
        }
        Ok(response) if response.status().is_server_error() => {
            crate::metrics::upstream_error(&decoder.id, "decode", "5xx");
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            Err(failed(
                Cause::ServerError,
                format!("decoder {} answered {status}: {body}", decoder.id),
            ))
        }
        Ok(response) => {
            crate::metrics::upstream_error(&decoder.id, "decode", "4xx");
            let status = axum::http::StatusCode::from_u16(response.status().as_u16())
                .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
            let body = response.bytes().await.unwrap_or_default();
            Err(OpenError::Rejected(ApiError::Upstream { status, body }))
        }
        Err(err) => {
            crate::metrics::upstream_error(&decoder.id, "decode", "connect");
            if err.is_connect() {
                // Nothing listens there: the process is gone. Skip it until its
                // next heartbeat says otherwise.
                state.registry.mark_dead(&decoder.id);
            }
            Err(failed(
                Cause::Connect,
                format!("decoder {} unreachable: {err}", decoder.id),
            ))
        }
    }
}
