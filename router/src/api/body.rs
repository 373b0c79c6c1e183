//! Reading request bodies: size limit (413) and JSON parsing (400), as OpenAI errors.

use crate::error::ApiError;
use axum::body::Body;
use axum::http::HeaderMap;
use serde_json::Value;

/// Reads at most `limit` bytes of `body` and parses them as JSON.
pub async fn read_json(headers: &HeaderMap, body: Body, limit: usize) -> Result<Value, ApiError> {
    let bytes = read_bytes(headers, body, limit).await?;
    serde_json::from_slice(&bytes)
        .map_err(|err| ApiError::bad_request(format!("invalid JSON body: {err}"), None))
}

/// Reads at most `limit` bytes of `body` (413 past it).
pub async fn read_bytes(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<axum::body::Bytes, ApiError> {
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    axum::body::to_bytes(body, limit).await.map_err(|err| {
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
    limit: usize,
) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| ApiError::PayloadTooLarge(limit))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    let _ = headers;
    serde_json::from_slice(&bytes)
        .map_err(|err| ApiError::bad_request(format!("invalid JSON body: {err}"), None))
}
