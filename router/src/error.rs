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
    #[error("upstream {instance} failed: {message}")]
    BadGateway { instance: String, message: String },
    /// An engine's own 4xx answer, passed through to the client.
    #[error("upstream rejected the request")]
    Upstream {
        status: StatusCode,
        body: bytes::Bytes,
    },
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound(_) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::BadGateway { .. } => StatusCode::BAD_GATEWAY,
            Self::Upstream { status, .. } => *status,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::BadRequest { .. } | Self::PayloadTooLarge(_) | Self::UnsupportedMediaType => {
                "invalid_request_error"
            }
            Self::Forbidden(_) => "permission_error",
            Self::Conflict(_) => "conflict_error",
            Self::Overloaded { .. } => "rate_limit_error",
            Self::ModelNotFound(_) | Self::NotFound(_) => "not_found_error",
            Self::Unauthorized(_) => "authentication_error",
            Self::Unavailable(_) => "service_unavailable",
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Self::Upstream { status, body } = self {
            return (status, [("content-type", "application/json")], body).into_response();
        }
        if let Self::Overloaded { retry_after_s, .. } = self {
            let retry = retry_after_s.to_string();
            return (self.status(), [("retry-after", retry)], Json(self.body())).into_response();
        }
        (self.status(), Json(self.body())).into_response()
    }
}
