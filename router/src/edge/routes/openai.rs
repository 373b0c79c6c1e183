//! OpenAI routes: completions and chat completions (the model list is
//! `models.rs`).

use super::body::{read_budgeted, BodyLimits};
use crate::error::ApiError;
use crate::pd::record::{engine_request_id, request_id, RequestRecord};
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::{validate, Route};
use crate::state::AppState;
use crate::tenants::engine_fields::set_engine_fields;
use crate::tenants::Caller;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use axum::Extension;
use std::sync::Arc;
use tracing::Instrument;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    generate(
        state,
        Route::Completions,
        caller.map(|c| c.0),
        headers,
        body,
    )
    .await
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    generate(state, Route::Chat, caller.map(|c| c.0), headers, body).await
}

async fn generate(
    state: Arc<AppState>,
    route: Route,
    caller: Option<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    // Records the request (span, metrics, access line) when it ends, however
    // it ends (a client that disconnects included).
    let mut record = RequestRecord::new(route.path(), request_id(&headers));
    let engine_fields = caller.clone();
    if let Some(caller) = caller {
        record.set_caller(caller);
    }
    crate::observe::traces::continue_trace(record.span(), &headers);
    let span = record.span().clone();
    let client_id = HeaderValue::from_str(record.request_id()).ok();
    let answered = async move {
        let checked = async {
            let limits = BodyLimits::client(&state.flow.requests);
            let read = read_budgeted(&headers, body, limits, &state.body_budget).await?;
            record.hold_body_share(read.permit);
            if let Some(caller) = &engine_fields {
                caller.charge_body(read.bytes.len())?;
            }
            let mut value = ClientBody::parse(&read.bytes)
                .map_err(|err| ApiError::bad_request(err.to_string(), None))?;
            if let Some(caller) = &engine_fields {
                set_engine_fields(caller, &mut value)?;
            }
            // The body is kept as parsed: its large fields are slices of
            // this buffer (kept once, shared by every engine call), nothing
            // else of it is.
            drop(read.bytes);
            let info = validate(
                route,
                &value,
                engine_request_id(record.request_id()),
                state.flow.requests.max_tokens_limit,
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
    .await;
    // The flow names the request by the engines' id; the client gets its own.
    answered.map(|mut response| {
        if let Some(id) = client_id {
            response.headers_mut().insert("x-request-id", id);
        }
        response
    })
}
