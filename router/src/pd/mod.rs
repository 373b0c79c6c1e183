//! The prefill -> decode flow, as named phases: `prefill` (get the KV hold and the
//! prompt ids), `decode` (open the decoder's stream), `relay` (journal every token
//! and pass it to the client, or collect it for a non-stream client).
//!
//! The journal entry opened here carries what request resume needs; the resume
//! loop slots in between `decode` and `relay`.

pub mod decode;
pub mod prefill;
pub mod relay;
pub mod request;

use crate::error::ApiError;
use crate::state::AppState;
use axum::http::HeaderValue;
use axum::response::Response;
use request::RequestInfo;
use serde_json::Value;
use std::sync::Arc;

/// Runs one validated request through P/D and returns the client's response.
pub async fn run(
    state: Arc<AppState>,
    info: RequestInfo,
    body: Value,
) -> Result<Response, ApiError> {
    if !state.registry.knows_model(&info.model) {
        return Err(ApiError::ModelNotFound(info.model.clone()));
    }
    let journal = state.journal.open(
        &info.request_id,
        info.route.path(),
        &info.model,
        info.stream,
    );
    let prefilled = prefill::run(&state, &info, &body).await?;
    journal.update(|e| {
        e.phase = "decode";
        e.prefill = Some(prefilled.instance.clone());
        e.kv_transfer_params = Some(prefilled.kv_transfer_params.clone());
        e.prompt_token_ids = prefilled.prompt_token_ids.clone();
    });
    let opened = decode::open(&state, &info, &body, &prefilled).await?;
    journal.update(|e| {
        e.decoder = Some(opened.guard.instance().id.clone());
        e.attempt += 1;
    });
    let decoder = opened.guard.instance().id.clone();
    let relay = relay::Relay::new(info, prefilled.prompt_token_ids, opened, journal);
    let mut response = if relay.info().stream {
        relay.into_sse_response()
    } else {
        relay.collect().await?
    };
    // Which instances served the request, for operators and the demo.
    let headers = response.headers_mut();
    for (name, id) in [
        (PREFILL_HEADER, &prefilled.instance),
        (DECODER_HEADER, &decoder),
    ] {
        if let Ok(value) = HeaderValue::from_str(id) {
            headers.insert(name, value);
        }
    }
    Ok(response)
}

/// Response header naming the prefill instance that served a request.
pub const PREFILL_HEADER: &str = "x-connex-prefill";
/// Response header naming the (first) decode instance that served a request.
pub const DECODER_HEADER: &str = "x-connex-decoder";
