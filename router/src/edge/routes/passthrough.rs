//! The rest of vLLM's OpenAI surface, passed through: embeddings, tokenize and
//! detokenize, pooling, score and rerank (with vLLM's `/v1/` aliases) need no
//! prefill/decode split, so each goes whole to one healthy instance of the
//! request's model, whatever its role, the least loaded one. The body goes as
//! the client sent it and a successful answer comes back as the engine gave it;
//! an engine's error answer comes back as its status and message (as on the
//! generation routes).

use super::body::{read_budgeted, BodyLimits, BudgetedBody};
use crate::edge::app::AppState;
use crate::engines::http::Payload;
use crate::error::ApiError;
use crate::membership::{Instance, LoadGuard, Pick, Registry};
use crate::pd::record::RequestRecord;
use crate::pd::upstream::{Call, CallError};
use crate::tenants::Caller;
use axum::body::Body;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
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
    let mut record = RequestRecord::new(path, crate::pd::record::request_id(&headers));
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
    let limits = BodyLimits::client(&state.deps.requests);
    // The share is held until the engine's answer is relayed.
    let BudgetedBody {
        bytes,
        permit: _share,
    } = read_budgeted(headers, body, limits, &state.body_budget).await?;
    if let Some(caller) = caller {
        caller.charge_body(bytes.len())?;
    }
    let fields = fields_of(&bytes)?;
    let model = model_of(state, &fields)?;
    record.set_model(&model);
    let body = with_bounded_priority(&bytes, fields.priority, caller)?;
    let request_id = crate::pd::record::engine_request_id(record.request_id());
    let mut tried: Vec<String> = Vec::new();
    loop {
        let Some(instance) = choose(&state.deps.registry, &model, &tried) else {
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
            body: body.clone(),
        };
        match state.deps.upstream.answer(call).await {
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

/// What the router reads of a passed-through body: `model` and `priority`.
/// Nothing else: the body goes to the engine as its bytes, and is never a
/// tree of values here (an embeddings batch of token ids would cost 32 bytes
/// an id).
#[derive(serde::Deserialize)]
struct Fields<'a> {
    #[serde(borrow, default)]
    model: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    priority: Option<&'a serde_json::value::RawValue>,
}

fn fields_of(bytes: &[u8]) -> Result<Fields<'_>, ApiError> {
    match serde_json::from_slice::<Fields<'_>>(bytes) {
        Ok(fields) => Ok(fields),
        // Not an object: said as for any route.
        Err(err) if err.is_data() => Err(ApiError::bad_request(
            "request body must be a JSON object",
            None,
        )),
        Err(err) => Err(ApiError::bad_request(
            format!("invalid JSON body: {err}"),
            None,
        )),
    }
}

/// The request's model: its `model`, or the one model served when it names
/// none (vLLM's default for these routes).
fn model_of(state: &AppState, fields: &Fields<'_>) -> Result<String, ApiError> {
    let model = match fields.model.map(|raw| raw.get()) {
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
            if state.deps.registry.knows_model(&model) {
                Ok(model)
            } else {
                Err(ApiError::ModelNotFound(model))
            }
        }
        None => match state.deps.registry.models().as_slice() {
            [only] => Ok(only.clone()),
            _ => Err(ApiError::bad_request(
                "`model` is required when the router serves more than one model",
                Some("model"),
            )),
        },
    }
}

/// The body as the engine gets it: the client's, with its vLLM `priority`
/// bounded by its tenant's as on the generating routes (`Caller::priority_for`:
/// no client jumps a tenant ranked before its own), the number written in
/// place of the client's (or the tenant's put first when the client sent
/// none). The rest of the body is shared, not copied.
fn with_bounded_priority(
    bytes: &Bytes,
    asked: Option<&serde_json::value::RawValue>,
    caller: Option<&Caller>,
) -> Result<Payload, ApiError> {
    let asked_value = asked
        .map(|raw| serde_json::from_str::<serde_json::Value>(raw.get()))
        .transpose()
        .map_err(|_| ApiError::bad_request("`priority` must be an integer", Some("priority")))?;
    let tenant = caller.and_then(|caller| caller.priority);
    let Some(priority) = crate::tenants::bounded_priority(asked_value.as_ref(), tenant)? else {
        return Ok(bytes.clone().into());
    };
    let number = Bytes::from(priority.to_string());
    let mut body = Payload::new();
    match asked {
        Some(raw) => {
            // `raw` borrows `bytes`: where it lies in them.
            let start = (raw.get().as_ptr() as usize).saturating_sub(bytes.as_ptr() as usize);
            let end = start + raw.get().len();
            body.push(bytes.slice(..start));
            body.push(number);
            body.push(bytes.slice(end..));
        }
        None => {
            // An object (`fields_of` read it as one): the field goes first.
            let open = bytes.iter().position(|b| *b == b'{').unwrap_or(0) + 1;
            let empty = bytes[open..]
                .iter()
                .find(|b| !b.is_ascii_whitespace())
                .is_some_and(|b| *b == b'}');
            body.push(bytes.slice(..open));
            body.push(Bytes::from_static(b"\"priority\":"));
            body.push(number);
            if !empty {
                body.push(Bytes::from_static(b","));
            }
            body.push(bytes.slice(open..));
        }
    }
    Ok(body)
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
