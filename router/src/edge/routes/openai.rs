//! OpenAI routes: completions and chat completions, one handler for both
//! (the model list is `models.rs`).

use super::prologue::{self, Prologue};
use crate::edge::app::AppState;
use crate::error::ApiError;
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::Route;
use crate::tenants::Caller;
use axum::body::{Body, Bytes};
use axum::http::HeaderMap;
use axum::response::Response;
use std::sync::Arc;

/// Serves the generating OpenAI `route` (completions or chat completions):
/// the prologue, then the request through `pd::run`.
pub async fn generate(
    state: Arc<AppState>,
    route: Route,
    caller: Option<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    // The rest of the request, once its body is read.
    let run = async |mut prologue: Prologue, bytes: Bytes| {
        let parsed =
            ClientBody::parse(&bytes).map_err(|err| ApiError::bad_request(err.to_string(), None));
        // The body is kept as parsed: its large fields are slices of this
        // buffer (kept once, shared by every engine call), nothing else of it
        // is.
        drop(bytes);
        let mut value = parsed.map_err(|error| prologue.fail(error))?;
        let info = prologue.check(route, &mut value)?;
        // The model label is set once the model is known to be served
        // (pd::start): a client's made-up names must not become series.
        crate::pd::run(state.deps.clone(), info, value, prologue.record).await
    };
    prologue::generate(&state, route.path(), caller, &headers, body, run).await
}
