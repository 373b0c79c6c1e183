//! A response body that keeps something alive until the body is dropped
//! (ended, or its stream reset): a request's count in flight, its admission.

use axum::body::Body;
use bytes::Bytes;
use http_body::Frame;
use std::pin::Pin;
use std::task::{Context, Poll};

/// `inner`, holding `guard` until it is dropped.
pub struct HeldBody<G> {
    inner: Body,
    _guard: G,
}

impl<G> HeldBody<G> {
    pub fn new(inner: Body, guard: G) -> Self {
        Self {
            inner,
            _guard: guard,
        }
    }
}

impl<G: Unpin> http_body::Body for HeldBody<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    // HTTP/2 sets content-length from an exact hint.
    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
