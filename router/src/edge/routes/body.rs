//! Reading request bodies: size limit (413), time limit (408) and JSON
//! parsing (400), as OpenAI errors.
//!
//! The time limit is for the whole body, not per read: a client that trickles
//! it would otherwise hold its request (and its concurrency permit) as long as
//! it likes, and over HTTP/2 one connection carries many such requests.

use crate::edge::body_budget::BodyBudget;
use crate::error::ApiError;
use axum::body::Body;
use axum::http::HeaderMap;
use bytes::BytesMut;
use http_body_util::BodyExt;
use serde_json::Value;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;

/// How much of a body is read, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub bytes: usize,
    pub within: Duration,
}

impl BodyLimits {
    /// The limits of a client's request (`--max-body-bytes`,
    /// `--body-read-timeout`).
    pub fn client(requests: &crate::config::RequestArgs) -> Self {
        Self {
            bytes: requests.max_body_bytes,
            within: requests.body_read_timeout,
        }
    }
}

/// Reads `body` within `limits` and parses it as JSON.
pub async fn read_json(
    headers: &HeaderMap,
    body: Body,
    limits: BodyLimits,
) -> Result<Value, ApiError> {
    parse_json(&read_bytes(headers, body, limits).await?)
}

/// Parses a body read whole as JSON (400 when it is not).
pub fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes)
        .map_err(|err| ApiError::bad_request(format!("invalid JSON body: {err}"), None))
}

/// The body's declared `content-length`, refused (413) past `limit`.
fn declared_length(headers: &HeaderMap, limit: usize) -> Result<Option<usize>, ApiError> {
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    match declared {
        Some(len) if len > limit => Err(ApiError::PayloadTooLarge(limit)),
        _ => Ok(declared),
    }
}

/// Reads at most `limits.bytes` of `body` (413 past it) within
/// `limits.within` (408 past it).
pub async fn read_bytes(
    headers: &HeaderMap,
    body: Body,
    limits: BodyLimits,
) -> Result<axum::body::Bytes, ApiError> {
    let limit = limits.bytes;
    // A declared length past the limit is refused before anything is read.
    declared_length(headers, limit)?;
    let read = tokio::time::timeout(limits.within, axum::body::to_bytes(body, limit))
        .await
        .map_err(|_| ApiError::BodyTimeout(limits.within))?;
    read.map_err(|err| {
        let too_large = std::error::Error::source(&err)
            .is_some_and(|source| source.is::<http_body_util::LengthLimitError>());
        if too_large {
            ApiError::PayloadTooLarge(limit)
        } else {
            ApiError::bad_request(format!("cannot read request body: {err}"), None)
        }
    })
}

/// Parses an optional JSON body: empty means `null`.
pub async fn read_optional_json(
    headers: &HeaderMap,
    body: Body,
    limits: BodyLimits,
) -> Result<Value, ApiError> {
    let bytes = read_bytes(headers, body, limits).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    parse_json(&bytes)
}

/// A body read within the budget: its bytes and their share of the budget,
/// given back when the permit drops.
pub struct BudgetedBody {
    pub bytes: axum::body::Bytes,
    pub permit: Option<OwnedSemaphorePermit>,
}

/// [`read_bytes`], each piece of the body taken from `budget` before it is
/// read on: the declared length at once, a body of unknown length frame by
/// frame. 503 with `Retry-After` when the budget is spent.
pub async fn read_budgeted(
    headers: &HeaderMap,
    body: Body,
    limits: BodyLimits,
    budget: &BodyBudget,
) -> Result<BudgetedBody, ApiError> {
    let limit = limits.bytes;
    let declared = declared_length(headers, limit)?;
    let mut permit = None;
    if let Some(declared) = declared {
        budget.take(&mut permit, declared)?;
    }
    let taken = declared.unwrap_or(0);
    let read = async {
        let mut body = body;
        let mut out = BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| {
                ApiError::bad_request(format!("cannot read request body: {err}"), None)
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if out.len() + data.len() > limit {
                return Err(ApiError::PayloadTooLarge(limit));
            }
            // Past what was declared (or all of it, when nothing was), each
            // frame is paid for before it is kept.
            let beyond = (out.len() + data.len()).saturating_sub(taken.max(out.len()));
            budget.take(&mut permit, beyond)?;
            out.extend_from_slice(&data);
        }
        Ok(out.freeze())
    };
    let bytes = tokio::time::timeout(limits.within, read)
        .await
        .map_err(|_| ApiError::BodyTimeout(limits.within))??;
    Ok(BudgetedBody { bytes, permit })
}
