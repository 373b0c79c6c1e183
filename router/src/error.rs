//! The router's one error type, mapped once to an OpenAI-style error response.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// Every way a request can fail in the router.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<&'static str>,
    },
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("request body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    /// The client did not send its whole body within the time limit.
    #[error("request body not received within {} ms", .0.as_millis())]
    BodyTimeout(std::time::Duration),
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Conflict(String),
    #[error("this route takes `content-type: application/json`")]
    UnsupportedMediaType,
    /// The router's concurrency limit: try again after `retry_after_s`.
    #[error("the router is at its limit of {limit} requests in flight; retry later")]
    Overloaded { limit: usize, retry_after_s: u64 },
    /// A tenant's own limit (requests in flight, tokens per minute).
    #[error("{message}")]
    RateLimited { message: String, retry_after_s: u64 },
    /// The router's budget of request bytes in flight is spent.
    #[error(
        "the router holds its limit of {limit} bytes of request bodies in flight; retry later"
    )]
    BodyBudget { limit: usize, retry_after_s: u64 },
    #[error("upstream {instance} failed: {message}")]
    BadGateway { instance: String, message: String },
    /// An engine's own 4xx answer: its status and its message, never its raw
    /// bytes (see [`ApiError::upstream`]).
    #[error("{message}")]
    Upstream { status: StatusCode, message: String },
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param,
        }
    }

    /// An engine's error answer as the client gets it: the engine's status
    /// (when it is an error status) and the message of its OpenAI or FastAPI
    /// error body, bounded; any other body becomes a short lossy excerpt.
    pub fn upstream(status: u16, body: &[u8]) -> Self {
        let status = StatusCode::from_u16(status)
            .ok()
            .filter(|s| s.is_client_error() || s.is_server_error())
            .unwrap_or(StatusCode::BAD_GATEWAY);
        let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
        let message = parsed
            .as_ref()
            .and_then(|v| {
                v.pointer("/error/message")
                    .or_else(|| v.get("message"))
                    .or_else(|| v.get("detail"))
            })
            .map(|m| match m.as_str() {
                Some(text) => text.to_string(),
                None => m.to_string(),
            })
            .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
        Self::Upstream {
            status,
            message: truncate(message.trim(), MAX_UPSTREAM_MESSAGE),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Overloaded { .. } | Self::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::BodyBudget { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::BadGateway { .. } => StatusCode::BAD_GATEWAY,
            Self::Upstream { status, .. } => *status,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::BadRequest { .. }
            | Self::PayloadTooLarge(_)
            | Self::BodyTimeout(_)
            | Self::UnsupportedMediaType => "invalid_request_error",
            Self::Forbidden(_) => "permission_error",
            Self::Conflict(_) => "conflict_error",
            Self::Overloaded { .. } | Self::RateLimited { .. } => "rate_limit_error",
            Self::ModelNotFound(_) | Self::NotFound(_) => "not_found_error",
            Self::Unauthorized(_) => "authentication_error",
            Self::Unavailable(_) | Self::BodyBudget { .. } => "service_unavailable",
            Self::BadGateway { .. } | Self::Upstream { .. } => "upstream_error",
        }
    }

    /// The OpenAI error object (`{"error": {...}}`) for this error.
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            Self::BadRequest { param, .. } => json!(param),
            Self::ModelNotFound(_) => json!("model"),
            _ => serde_json::Value::Null,
        };
        let code = match self {
            Self::ModelNotFound(_) => json!("model_not_found"),
            _ => json!(self.status().as_u16()),
        };
        json!({"error": {"message": self.to_string(), "type": self.kind(), "param": param, "code": code}})
    }
}

impl ApiError {
    /// The error in Anthropic's shape (`/v1/messages`): `{"type": "error",
    /// "error": {"type", "message"}}`, its type by status as Anthropic names them.
    pub fn anthropic_body(&self) -> serde_json::Value {
        let kind = match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        };
        json!({"type": "error", "error": {"type": kind, "message": self.to_string()}})
    }

    /// The response of this error with `body` (its status, and `Retry-After`
    /// where the error has one).
    fn respond_with(self, body: serde_json::Value) -> Response {
        if let Self::Overloaded { retry_after_s, .. }
        | Self::RateLimited { retry_after_s, .. }
        | Self::BodyBudget { retry_after_s, .. } = self
        {
            let retry = retry_after_s.to_string();
            return (self.status(), [("retry-after", retry)], Json(body)).into_response();
        }
        (self.status(), Json(body)).into_response()
    }

    /// The response for a request to `path`: Anthropic's shape on its route,
    /// OpenAI's everywhere else.
    pub fn response_for(self, path: &str) -> Response {
        if is_anthropic_path(path) {
            let body = self.anthropic_body();
            self.respond_with(body)
        } else {
            self.into_response()
        }
    }
}

/// The route whose errors are in Anthropic's shape.
pub const ANTHROPIC_PATH: &str = "/v1/messages";

/// Whether `path` is Anthropic's route or under it (`/v1/messages/...`: its
/// 404s too are in Anthropic's shape, for Anthropic's clients).
pub fn is_anthropic_path(path: &str) -> bool {
    path.strip_prefix(ANTHROPIC_PATH)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        self.respond_with(body)
    }
}

/// Longest engine message passed on to a client, in bytes.
pub const MAX_UPSTREAM_MESSAGE: usize = 4096;

/// `text` cut to at most `max` bytes, on a character boundary, marked when cut.
pub fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_error_keeps_its_status_and_message_never_its_bytes() {
        let error = ApiError::upstream(
            400,
            br#"{"error":{"message":"prompt too long","type":"BadRequestError","code":400}}"#,
        );
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
        assert_eq!(error.body()["error"]["message"], "prompt too long");
        assert_eq!(error.body()["error"]["code"], 400);
        let fastapi = ApiError::upstream(422, br#"{"detail":"bad field"}"#);
        assert_eq!(fastapi.body()["error"]["message"], "bad field");
        let huge = vec![b'x'; 1 << 20];
        let error = ApiError::upstream(413, &huge);
        let message = error.body()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .len();
        assert!(message <= MAX_UPSTREAM_MESSAGE + 3, "bounded: {message}");
        // A success or odd status from an error path is a bad gateway.
        assert_eq!(
            ApiError::upstream(302, b"").status(),
            StatusCode::BAD_GATEWAY
        );
    }
}
