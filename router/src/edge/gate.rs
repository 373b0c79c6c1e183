//! The layers of the gated client routes (the OpenAI routes), one job each,
//! applied outermost first in this order:
//!
//! - [`cut_at_shutdown`]: a stream still open when the shutdown grace is over
//!   ends in its protocol's own shape (the server waits no longer for it):
//!   the handler's [`StreamEnding`] when it gave one (a translated stream's
//!   failure events, numbered on from its last), else by route: an OpenAI
//!   error event and `[DONE]`, Anthropic's `error` event, Responses' `error`
//!   event.
//! - [`strip_instance_headers`]: the headers naming the instances that served
//!   a request go only to clients of a router run with
//!   `--expose-instance-headers`.
//! - [`admit`]: the caller's key and admission (its tenant's limits, a slot,
//!   see `crate::tenants`), held by the response body until it ends.

use crate::error::{is_anthropic_path, ApiError};
use crate::tenants::{Admission, Tenants};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body::Frame;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::held_body::HeldBody;
use super::server::Shutdown;

/// Whether clients are told which instances served them (`--expose-instance-headers`).
#[derive(Debug, Clone, Copy)]
pub struct ExposeInstances(pub bool);

/// Headers naming the instances that served a request: instance ids are what
/// an attacker needs to act on an instance, so clients get them only when the
/// operator says so.
const INSTANCE_HEADERS: [&str; 2] = [crate::pd::PREFILL_HEADER, crate::pd::DECODER_HEADER];

/// The caller's key and admission; a caller refused gets the error (401, 429,
/// 503) at once. The admission goes into the request (a handler may take it
/// to hold it longer: a background generation outlives its answer) and is
/// otherwise held by the response body until it ends.
pub async fn admit(
    State(tenants): State<Arc<Tenants>>,
    mut request: Request,
    next: Next,
) -> Response {
    let (admission, caller) = match tenants.admit(request.headers()).await {
        Ok(admitted) => admitted,
        Err(error) => return error.response_for(request.uri().path()),
    };
    let admission = AdmissionSlot(Arc::new(std::sync::Mutex::new(Some(admission))));
    request.extensions_mut().insert(caller);
    request.extensions_mut().insert(admission.clone());
    next.run(request).await.map(|inner| {
        // Held by the body until it ends.
        Body::new(HeldBody::new(inner, admission))
    })
}

/// Removes the instance headers unless the operator exposes them.
pub async fn strip_instance_headers(
    State(expose): State<ExposeInstances>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = next.run(request).await;
    if !expose.0 {
        for name in INSTANCE_HEADERS {
            response.headers_mut().remove(name);
        }
    }
    response
}

/// How a stream cut at the end of the shutdown grace ends, given by its
/// handler as a response extension: the stream's own last bytes in its
/// protocol (a translated stream's failure events, which carry on its
/// numbering). Called once, when the cut comes.
#[derive(Clone)]
pub struct StreamEnding(Arc<dyn Fn() -> Bytes + Send + Sync>);

impl StreamEnding {
    pub fn new(ending: impl Fn() -> Bytes + Send + Sync + 'static) -> Self {
        Self(Arc::new(ending))
    }
}

/// Ends an event stream in its protocol's shape when the shutdown grace is over.
pub async fn cut_at_shutdown(
    State(shutdown): State<Shutdown>,
    request: Request,
    next: Next,
) -> Response {
    let route = RouteShape::of(request.uri().path());
    let mut response = next.run(request).await;
    let stream = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !stream {
        return response;
    }
    let ending = response.extensions_mut().remove::<StreamEnding>();
    let cut = Box::pin(shutdown.cut.clone().cancelled_owned());
    response.map(|inner| {
        Body::new(CutBody {
            inner,
            cut,
            ending: Some(match ending {
                Some(ending) => ShutdownEnding::Handler(ending),
                None => ShutdownEnding::Route(route),
            }),
        })
    })
}

/// A request's admission, held by its response body unless a handler takes it
/// to hold it longer (a background generation outlives its answer).
#[derive(Debug, Clone)]
pub struct AdmissionSlot(Arc<std::sync::Mutex<Option<Admission>>>);

impl AdmissionSlot {
    pub fn take(&self) -> Option<Admission> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// An event stream that ends in its protocol's shape once `cut` fires.
struct CutBody {
    inner: Body,
    cut: BoxFuture<'static, ()>,
    /// Taken when the stream ends (cut or not).
    ending: Option<ShutdownEnding>,
}

/// The last bytes of a stream cut by shutdown.
enum ShutdownEnding {
    Handler(StreamEnding),
    Route(RouteShape),
}

/// A client route's protocol, for the last event of a stream cut by
/// shutdown when its handler gave none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RouteShape {
    OpenAi,
    Anthropic,
    Responses,
}

impl RouteShape {
    fn of(path: &str) -> Self {
        if is_anthropic_path(path) {
            Self::Anthropic
        } else if path == "/v1/responses" || path.starts_with("/v1/responses/") {
            Self::Responses
        } else {
            Self::OpenAi
        }
    }

    /// Its error event: OpenAI's `data: {"error": ...}` then `[DONE]`;
    /// Anthropic's `error` event (what its SDKs raise on); Responses' `error`
    /// event (a background response's follower reads on with
    /// `starting_after` elsewhere, so it takes no sequence number of the
    /// response's).
    fn ending(self) -> Bytes {
        let error = shutdown_error();
        match self {
            Self::OpenAi => Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", error.body())),
            Self::Anthropic => Bytes::from(format!(
                "event: error\ndata: {}\n\n",
                error.anthropic_body()
            )),
            Self::Responses => {
                let event = serde_json::json!({"type": "error", "code": "router_shutting_down",
                    "message": error.to_string(), "param": null});
                Bytes::from(format!("event: error\ndata: {event}\n\n"))
            }
        }
    }
}

/// Why a stream was cut at the end of the shutdown grace.
pub fn shutdown_error() -> ApiError {
    ApiError::Unavailable(
        "the router is shutting down; the stream was cut at the end of its grace period".into(),
    )
}

impl http_body::Body for CutBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.ending.is_none() {
            return Poll::Ready(None);
        }
        if self.cut.as_mut().poll(cx).is_ready() {
            let last = match self.ending.take() {
                Some(ShutdownEnding::Handler(ending)) => (ending.0)(),
                Some(ShutdownEnding::Route(route)) => route.ending(),
                None => Bytes::new(),
            };
            if last.is_empty() {
                return Poll::Ready(None);
            }
            return Poll::Ready(Some(Ok(Frame::data(last))));
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.ending = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ending.is_none() || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        // Its length is not the inner body's once it may be cut.
        http_body::SizeHint::default()
    }
}
