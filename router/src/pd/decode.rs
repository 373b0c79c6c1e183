//! Phase 2: decode. The client's body goes to a decode instance with the
//! prefill's `kv_transfer_params`, always streaming toward the engine so that the
//! router journals every token as it comes. A connect error or 5xx before the
//! first byte moves the request to another decoder once.

use super::prefill::Prefilled;
use super::request::RequestInfo;
use crate::error::ApiError;
use crate::registry::{LoadGuard, Phase};
use crate::state::AppState;
use serde_json::{json, Value};

/// A decoder's open stream, with the load guard that counts it.
pub struct Opened {
    pub response: reqwest::Response,
    pub guard: LoadGuard,
}

/// The body sent to a decode instance.
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

/// Opens the decode stream.
pub async fn open(
    state: &AppState,
    info: &RequestInfo,
    body: &Value,
    prefilled: &Prefilled,
) -> Result<Opened, ApiError> {
    let payload = bytes::Bytes::from(decode_body(body, &prefilled.kv_transfer_params).to_string());
    let mut tried: Vec<String> = Vec::new();
    let mut last_error = None;
    for _ in 0..2 {
        let candidates = state.registry.eligible(&info.model, Phase::Decode);
        let Some(instance) = state.decode.select(&candidates, &tried) else {
            break;
        };
        tried.push(instance.id.clone());
        let guard = LoadGuard::new(instance.clone());
        crate::metrics::upstream_request(&instance.id, "decode");
        let sent = state
            .client
            .post(format!("{}{}", instance.url, info.route.path()))
            .header("content-type", "application/json")
            .header("x-request-id", &info.request_id)
            .body(payload.clone())
            .send()
            .await;
        match sent {
            Ok(response) if response.status().is_success() => {
                return Ok(Opened { response, guard })
            }
            Ok(response) if response.status().is_server_error() => {
                crate::metrics::upstream_error(&instance.id, "decode", "5xx");
                last_error = Some(ApiError::BadGateway {
                    instance: instance.id.clone(),
                    message: format!("HTTP {}", response.status()),
                });
            }
            Ok(response) => {
                crate::metrics::upstream_error(&instance.id, "decode", "4xx");
                let status = axum::http::StatusCode::from_u16(response.status().as_u16())
                    .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
                let body = response.bytes().await.unwrap_or_default();
                return Err(ApiError::Upstream { status, body });
            }
            Err(err) => {
                crate::metrics::upstream_error(&instance.id, "decode", "connect");
                last_error = Some(ApiError::BadGateway {
                    instance: instance.id.clone(),
                    message: err.to_string(),
                });
            }
        }
    }
    Err(last_error.unwrap_or_else(|| {
        ApiError::Unavailable(format!(
            "no decode instance is ready for model `{}`",
            info.model
        ))
    }))
}
