//! The prefill -> decode flow, as named phases: `prefill` (get the KV hold and the
//! prompt ids), `decode` (open a decoder's stream), the `session` that relays its
//! tokens through the client's `output` and journals them, and `resume` (continue
//! the request on another decoder when one fails).

pub mod attempt;
pub mod chunk;
pub mod decode;
pub mod output;
pub mod prefill;
pub mod request;
pub mod resume;
pub mod session;

use crate::error::ApiError;
use crate::state::AppState;
use axum::http::HeaderValue;
use axum::response::Response;
use request::RequestInfo;
use serde_json::Value;
use session::Session;
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
    let prefill_instance = prefilled.instance.clone();
    let session = Session::start(state, info, body, prefilled, journal).await?;
    let decoder = session.first_decoder().to_string();
    let request_id = session.info().request_id.clone();
    let mut response = if session.info().stream {
        session.into_sse_response()
    } else {
        session.collect().await?
    };
    // Which instances served the request, for operators and the demo.
    let headers = response.headers_mut();
    for (name, value) in [
        ("x-request-id", &request_id),
        (PREFILL_HEADER, &prefill_instance),
        (DECODER_HEADER, &decoder),
    ] {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    }
    Ok(response)
}

/// Response header naming the prefill instance that served a request.
pub const PREFILL_HEADER: &str = "x-connex-prefill";
/// Response header naming the (first) decode instance that served a request.
pub const DECODER_HEADER: &str = "x-connex-decoder";
