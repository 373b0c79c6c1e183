//! The rest of vLLM's OpenAI surface, passed through: embeddings, tokenize and
//! detokenize, pooling, score and rerank (with vLLM's `/v1/` aliases) need no
//! prefill/decode split, so each goes whole to one healthy instance of the
//! request's model, whatever its role, the least loaded one. The body goes as
//! the client sent it and a successful answer comes back as the engine gave it;
//! an engine's error answer comes back as its status and message (as on the
//! generation routes).

use super::body::{read_budgeted, BodyLimits, BudgetedBody};
use crate::error::ApiError;
use crate::membership::{Instance, LoadGuard, Pick, Registry};
use crate::pd::record::RequestRecord;
use crate::pd::upstream::{Call, CallError};
use crate::state::AppState;
use crate::tenants::Caller;
use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use tracing::Instrument;

/// The routes passed through, as vLLM serves them.
pub const PATHS: &[&str] = &[
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
];

/// Instances tried for one request: a second one when the first could not be
/// reached (it never saw the request).
const MAX_TRIES: usize = 2;

/// Passes one request of `path` through.
pub async fn forward(
    state: Arc<AppState>,
    path: &'static str,
    caller: Option<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let mut record = RequestRecord::new(path, super::openai::request_id(&headers));
    crate::observe::traces::continue_trace(record.span(), &headers);
    let span = record.span().clone();
    let result = run(&state, path, caller.as_ref(), &headers, body, &mut record)
        .instrument(span)
        .await;
    record.finish(match &result {
        Ok(response) => response.status().as_u16(),
        Err(error) => error.status().as_u16(),
    });
    result
}

async fn run(
    state: &AppState,
    path: &'static str,
    caller: Option<&Caller>,
    headers: &HeaderMap,
    body: Body,
    record: &mut RequestRecord,
) -> Result<Response, ApiError> {
    let limits = BodyLimits::client(&state.config);
    // The share is held until the engine's answer is relayed.
    let BudgetedBody {
        bytes,
        permit: _share,
    } = read_budgeted(headers, body, limits, &state.body_budget).await?;
    if let Some(caller) = caller {
        caller.charge_body(bytes.len())?;
    }
    let model = model_of(state, &bytes)?;
    record.set_model(&model);
    let request_id = super::openai::engine_request_id(record.request_id());
    let mut tried: Vec<String> = Vec::new();
    loop {
        let Some(instance) = choose(&state.flow.registry, &model, &tried) else {
            return Err(ApiError::Unavailable(format!(
                "no instance is ready for model `{model}`"
            )));
        };
        let _load = LoadGuard::new(instance.clone());
        let call = Call {
            url: &instance.url,
            path,
            request_id: &request_id,
            trace: crate::observe::traces::headers(record.span()),
            body: bytes.clone().into(),
        };
        match state.flow.upstream.prefill(call).await {
            Ok(reply) if (200..300).contains(&reply.status) => {
                let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
                return Ok((
                    status,
                    [("content-type", "application/json")],
                    Body::from(reply.body),
                )
                    .into_response());
            }
            Ok(reply) => return Err(ApiError::upstream(reply.status, &reply.body)),
            Err(CallError::Connect { message, .. }) if tried.len() + 1 < MAX_TRIES => {
                tracing::warn!(instance = %instance.id, %message, path, "unreachable, trying another");
                tried.push(instance.id.clone());
            }
            Err(error) => {
                return Err(ApiError::BadGateway {
                    instance: instance.id.clone(),
                    message: error.to_string(),
                })
            }
        }
    }
}

/// The request's model: its `model`, or the one model served when it names
/// none (vLLM's default for these routes). Only `model` is read: the body
/// goes to the engine as its bytes, and is never a tree of values here
/// (an embeddings batch of token ids would cost 32 bytes an id).
fn model_of(state: &AppState, bytes: &[u8]) -> Result<String, ApiError> {
    #[derive(serde::Deserialize)]
    struct ModelOnly<'a> {
        #[serde(borrow, default)]
        model: Option<&'a serde_json::value::RawValue>,
    }
    let request = match serde_json::from_slice::<ModelOnly<'_>>(bytes) {
        Ok(request) => request,
        // Not an object: said as for any route.
        Err(err) if err.is_data() => {
            return Err(ApiError::bad_request(
                "request body must be a JSON object",
                None,
            ))
        }
        Err(err) => {
            return Err(ApiError::bad_request(
                format!("invalid JSON body: {err}"),
                None,
            ))
        }
    };
    let model = match request.model.map(|raw| raw.get()) {
        None | Some("null") => None,
        Some(text) => Some(
            serde_json::from_str::<String>(text)
                .ok()
                .filter(|m| !m.is_empty())
                .ok_or_else(|| {
                    ApiError::bad_request("`model` must be a non-empty string", Some("model"))
                })?,
        ),
    };
    match model {
        Some(model) => {
            if state.flow.registry.knows_model(&model) {
                Ok(model)
            } else {
                Err(ApiError::ModelNotFound(model))
            }
        }
        None => match state.flow.registry.models().as_slice() {
            [only] => Ok(only.clone()),
            _ => Err(ApiError::bad_request(
                "`model` is required when the router serves more than one model",
                Some("model"),
            )),
        },
    }
}

/// The least loaded instance of `model` that may take a request, any role,
/// not one of `tried`.
pub(crate) fn choose(registry: &Registry, model: &str, tried: &[String]) -> Option<Arc<Instance>> {
    let mut candidates = registry.eligible(model, Pick::Prefill);
    for decoder in registry.eligible(model, Pick::Decode) {
        if !candidates.iter().any(|c| c.id == decoder.id) {
            candidates.push(decoder);
        }
    }
    candidates
        .into_iter()
        .filter(|c| !tried.contains(&c.id))
        .min_by_key(|c| c.inflight())
}
