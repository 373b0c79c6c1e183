//! Phase 1: prefill. The prompt runs on a prefill instance with `max_tokens: 1`
//! and `do_remote_decode`; its answer carries the hold (`kv_transfer_params`) and
//! the prompt token ids. A connect error or 5xx is retried once elsewhere.

use super::request::{RequestInfo, Route};
use crate::error::ApiError;
use crate::registry::Phase;
use crate::state::AppState;
use serde_json::{json, Value};
use std::time::Duration;

/// What a successful prefill hands to decode.
#[derive(Debug, Clone)]
pub struct Prefilled {
    pub instance: String,
    pub kv_transfer_params: Value,
    pub prompt_token_ids: Vec<u32>,
}

/// The body sent to a prefill instance.
pub fn prefill_body(route: Route, body: &Value) -> Value {
    let mut body = body.clone();
    if let Some(map) = body.as_object_mut() {
        map.insert("stream".into(), Value::Bool(false));
        map.insert("max_tokens".into(), json!(1));
        if route == Route::Chat || map.contains_key("max_completion_tokens") {
            map.insert("max_completion_tokens".into(), json!(1));
        }
        map.insert("return_token_ids".into(), Value::Bool(true));
        map.insert("n".into(), json!(1));
        for key in ["stream_options", "min_tokens", "min_completion_tokens"] {
            map.remove(key);
        }
        map.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false}),
        );
    }
    body
}

/// Runs prefill, retrying once on another instance after a connect error or 5xx.
pub async fn run(
    state: &AppState,
    info: &RequestInfo,
    body: &Value,
) -> Result<Prefilled, ApiError> {
    let payload = bytes::Bytes::from(prefill_body(info.route, body).to_string());
    let mut tried: Vec<String> = Vec::new();
    let mut last_error = None;
    for attempt in 0..2 {
        let candidates = state.registry.eligible(&info.model, Phase::Prefill);
        let Some(instance) = state.prefill.select(&candidates, &tried) else {
            break;
        };
        if attempt > 0 {
            crate::metrics::prefill_retry();
            tracing::warn!(request_id = %info.request_id, instance = %instance.id, "retrying prefill on another instance");
        }
        tried.push(instance.id.clone());
        let _load = crate::registry::LoadGuard::new(instance.clone());
        crate::metrics::upstream_request(&instance.id, "prefill");
        let sent = state
            .client
            .post(format!("{}{}", instance.url, info.route.path()))
            .header("content-type", "application/json")
            .header("x-request-id", &info.request_id)
            .timeout(Duration::from_millis(state.config.prefill_timeout_ms))
            .body(payload.clone())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(err) => {
                crate::metrics::upstream_error(&instance.id, "prefill", "connect");
                last_error = Some(ApiError::BadGateway {
                    instance: instance.id.clone(),
                    message: err.to_string(),
                });
                continue;
            }
        };
        let status = response.status();
        let bytes = match response.bytes().await {
            Ok(bytes) => bytes,
            Err(err) => {
                crate::metrics::upstream_error(&instance.id, "prefill", "body");
                last_error = Some(ApiError::BadGateway {
                    instance: instance.id.clone(),
                    message: err.to_string(),
                });
                continue;
            }
        };
        if status.is_server_error() {
            crate::metrics::upstream_error(&instance.id, "prefill", "5xx");
            last_error = Some(ApiError::BadGateway {
                instance: instance.id.clone(),
                message: format!("HTTP {status}"),
            });
            continue;
        }
        if !status.is_success() {
            crate::metrics::upstream_error(&instance.id, "prefill", "4xx");
            let status = axum::http::StatusCode::from_u16(status.as_u16())
                .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
            return Err(ApiError::Upstream {
                status,
                body: bytes,
            });
        }
        return parse_answer(info.route, &instance.id, &bytes);
    }
    Err(last_error.unwrap_or_else(|| {
        ApiError::Unavailable(format!(
            "no prefill instance is ready for model `{}`",
            info.model
        ))
    }))
}

/// The part of a prefill answer the router reads.
#[derive(serde::Deserialize)]
struct Answer<'a> {
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a serde_json::value::RawValue>,
    /// Chat puts the prompt ids at the top level...
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    /// ...completions in the choice.
    #[serde(default)]
    choices: Vec<AnswerChoice>,
}

#[derive(serde::Deserialize)]
struct AnswerChoice {
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
}

/// Reads the hold and the prompt ids out of a prefill answer.
fn parse_answer(route: Route, instance: &str, bytes: &[u8]) -> Result<Prefilled, ApiError> {
    let bad = |message: &str| ApiError::BadGateway {
        instance: instance.to_string(),
        message: message.to_string(),
    };
    let answer: Answer =
        serde_json::from_slice(bytes).map_err(|_| bad("prefill answered invalid JSON"))?;
    let kv_transfer_params = answer
        .kv_transfer_params
        .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok())
        .filter(Value::is_object)
        .ok_or_else(|| {
            bad("prefill answered without kv_transfer_params (is its KV connector configured?)")
        })?;
    let prompt_token_ids = match route {
        Route::Completions => answer
            .choices
            .into_iter()
            .next()
            .and_then(|c| c.prompt_token_ids),
        Route::Chat => answer.prompt_token_ids,
    }
    .ok_or_else(|| bad("prefill answered without prompt_token_ids"))?;
    Ok(Prefilled {
        instance: instance.to_string(),
        kv_transfer_params,
        prompt_token_ids,
    })
}
