//! The start every generating route shares (completions, chat completions,
//! Responses, Messages), written once: the request's record (span, metrics,
//! access line), the client's trace continued, the body read within the
//! router's budgets and charged to the caller, the chat checked, the request
//! finished (recorded with its status) on any error before the flow takes
//! it, and the answer given the client's `x-request-id` (the one place that
//! sets it: the flow names the request by the engines' id).

use super::body::{read_budgeted, BodyLimits};
use crate::edge::app::AppState;
use crate::error::ApiError;
use crate::pd::record::{engine_request_id, request_id, RequestRecord};
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::{validate, RequestInfo, Route};
use crate::tenants::engine_fields::set_engine_fields;
use crate::tenants::Caller;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use tracing::Instrument;

/// A generating request between its start and the flow: its record (the
/// flow takes it) and its caller.
pub struct Prologue {
    pub record: RequestRecord,
    caller: Option<Caller>,
    max_tokens_limit: u64,
}

impl Prologue {
    /// The caller's tenant name ("" without tenants).
    pub fn tenant(&self) -> String {
        self.caller
            .as_ref()
            .map(|c| c.tenant.to_string())
            .unwrap_or_default()
    }

    /// Finishes the request with `error` (its status recorded) and returns
    /// it, for an error before the flow takes the record.
    pub fn fail(&mut self, error: ApiError) -> ApiError {
        self.record.finish(error.status().as_u16());
        error
    }

    /// The chat `body` to run: the caller's tenant fields set (its priority
    /// and KV salt) and the chat checked; the request finished on an error.
    pub fn check(&mut self, route: Route, body: &mut ClientBody) -> Result<RequestInfo, ApiError> {
        let checked = self.checked(route, body);
        checked.map_err(|error| self.fail(error))
    }

    fn checked(&self, route: Route, body: &mut ClientBody) -> Result<RequestInfo, ApiError> {
        if let Some(caller) = &self.caller {
            set_engine_fields(caller, body)?;
        }
        validate(
            route,
            body,
            engine_request_id(self.record.request_id()),
            self.max_tokens_limit,
        )
    }
}

/// Runs generating request `path`: records it (when it ends, however it
/// ends: a client that disconnects included), continues the client's trace
/// on its span, reads its body, and runs `serve` with the body inside the
/// span; the answer gets the client's request id.
pub async fn generate(
    state: &AppState,
    path: &'static str,
    caller: Option<Caller>,
    headers: &HeaderMap,
    body: Body,
    serve: impl AsyncFnOnce(Prologue, Bytes) -> Result<Response, ApiError>,
) -> Result<Response, ApiError> {
    let mut record = RequestRecord::new(path, request_id(headers));
    if let Some(caller) = caller.clone() {
        record.set_caller(caller);
    }
    crate::observe::traces::continue_trace(record.span(), headers);
    let span = record.span().clone();
    let client_id = HeaderValue::from_str(record.request_id()).ok();
    let mut prologue = Prologue {
        record,
        caller,
        max_tokens_limit: state.deps.requests.max_tokens_limit,
    };
    let answered = async move {
        let read = read_body(state, &mut prologue, headers, body).await;
        match read {
            Ok(bytes) => serve(prologue, bytes).await,
            Err(error) => Err(prologue.fail(error)),
        }
    }
    .instrument(span)
    .await;
    answered.map(|mut response| {
        if let Some(id) = client_id {
            response.headers_mut().insert("x-request-id", id);
        }
        response
    })
}

/// The body, read within the router's budgets (the record holds its share
/// until the request ends) and charged to the caller's tenant.
async fn read_body(
    state: &AppState,
    prologue: &mut Prologue,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, ApiError> {
    let limits = BodyLimits::client(&state.deps.requests);
    let read = read_budgeted(headers, body, limits, &state.body_budget).await?;
    prologue.record.hold_body_share(read.permit);
    if let Some(caller) = &prologue.caller {
        caller.charge_body(read.bytes.len())?;
    }
    Ok(read.bytes)
}
