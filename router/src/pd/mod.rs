//! The prefill -> decode flow, as named phases:
//!
//! 1. `prefill`: get the KV hold and the prompt ids from a prefill instance;
//! 2. `decode`: open a decoder's stream (an `attempt`);
//! 3. `relay`: check, journal and relay its tokens through the client's `output`;
//! 4. on a decoder failure, `resume::decide` picks the next step, `reprefill`
//!    replaces a lost hold, and the `session` (which drives 2-4) continues on
//!    another decoder.
//!
//! Engines are reached through the [`upstream::Upstream`] seam, so that every
//! phase is tested against scripted engines as well as real processes.

pub mod assemble;
pub mod attempt;
pub mod chunk;
pub mod decode;
pub mod flow;
pub mod merged;
pub mod output;
pub mod patch;
pub mod prefill;
pub mod record;
pub mod relay;
pub mod reprefill;
pub mod request;
pub mod resume;
pub mod session;
pub mod stops;
pub mod tokenizer;
pub mod tokens;
pub mod upstream;

use crate::error::ApiError;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use flow::Flow;
use record::RequestRecord;
use request::RequestInfo;
use serde_json::Value;
use session::Session;
use std::sync::Arc;

/// Runs one validated request through P/D and returns the client's response.
/// `record` records how the request ended, however it ends.
pub async fn run(
    state: Arc<Flow>,
    info: RequestInfo,
    body: Value,
    mut record: RequestRecord,
) -> Result<Response, ApiError> {
    let session = match start(state, info, body, &mut record).await {
        Ok(session) => session,
        Err(error) => {
            record.finish(error.status().as_u16());
            return Err(error);
        }
    };
    let mut session = session;
    session.set_record(record);
    let served = Served {
        request_id: session.info().request_id.clone(),
        prefill: session.prefill_instance(),
        decoder: session.first_decoder().to_string(),
    };
    let (mut response, resumes) = if session.info().stream {
        (session.into_sse_response(), None)
    } else {
        // The session records its own end (status) in its record.
        let (response, resumes) = session.collect().await?;
        (axum::Json(response).into_response(), Some(resumes))
    };
    served.add_headers(response.headers_mut(), resumes);
    Ok(response)
}

/// Prefill, then the first decoder.
async fn start(
    state: Arc<Flow>,
    info: RequestInfo,
    body: Value,
    record: &mut RequestRecord,
) -> Result<Session, ApiError> {
    if !state.registry.knows_model(&info.model) {
        return Err(ApiError::ModelNotFound(info.model.clone()));
    }
    record.set_model(&info.model);
    let journal = state.journal.open_at(
        &info.request_id,
        info.route.path(),
        &info.model,
        info.stream,
        usize::try_from(info.n).unwrap_or(1),
        record.started(),
    );
    record.set_entry(journal.reader());
    let payload = prefill::prefill_body(info.route, &body);
    let prompt = if state.prefill.wants_prompt() {
        let engines = state
            .registry
            .eligible(&info.model, crate::registry::Phase::Prefill);
        tokens::prompt_ids(&state, info.route, &body, &engines).await
    } else {
        None
    };
    let prefilled = prefill::run(&state, &info, info.route, payload, prompt.as_deref()).await?;
    Session::start(state, info, body, prefilled, journal).await
}

/// Who served a request.
struct Served {
    request_id: String,
    prefill: String,
    decoder: String,
}

impl Served {
    /// The response headers Connex adds, in one place: the request id, the
    /// instances that served it (for operators and the demo) and, for a
    /// non-stream response, the resumes it needed.
    fn add_headers(&self, headers: &mut HeaderMap, resumes: Option<u32>) {
        for (name, value) in [
            ("x-request-id", &self.request_id),
            (PREFILL_HEADER, &self.prefill),
            (DECODER_HEADER, &self.decoder),
        ] {
            if let Ok(value) = HeaderValue::from_str(value) {
                headers.insert(name, value);
            }
        }
        if let Some(resumes) = resumes {
            headers.insert(RESUMES_HEADER, resumes.into());
        }
    }
}

/// Response header naming the prefill instance that served a request.
pub const PREFILL_HEADER: &str = "x-connex-prefill";
/// Response header naming the (first) decode instance that served a request.
pub const DECODER_HEADER: &str = "x-connex-decoder";
/// Response header (non-stream) counting the resumes a request needed.
pub const RESUMES_HEADER: &str = "x-connex-resumes";
