//! Distributed traces: W3C trace context in and out, and an optional OTLP/HTTP
//! export of the router's spans.
//!
//! A request continues the trace of the client's `traceparent` (and
//! `tracestate`), or starts one; the prefill call and every decoder call carry
//! the trace on to the engine (vLLM continues it with `--otlp-traces-endpoint`).
//! The spans (`request`, `prefill`, `decode` per attempt, `resume`) are
//! exported to `--otlp-endpoint` when one is given, through the OpenTelemetry
//! layer. Without an endpoint they still get their ids, so that the engines'
//! spans join the client's trace, from [`IdLayer`]: ids only, assigned when a
//! span opens. The OpenTelemetry layer also builds every span's data and does
//! work each time a span is entered (every poll of a request's futures): ~9%
//! of the router's CPU per request when nothing was exported (docs/bench.md).

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry::Context;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use std::time::Duration;
use tracing::span::{Attributes, Id};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::Context as LayerContext;
use tracing_subscriber::registry::{LookupSpan, Registry};

/// The headers of W3C trace context.
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// Why the trace export could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("invalid --otlp-endpoint `{0}`: an http:// or https:// URL is needed")]
    Endpoint(String),
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// The OTLP/HTTP traces URL of `endpoint`: a collector's base URL
/// (`http://collector:4318`) gets the standard `/v1/traces` path; a URL with
/// a path is used as it is.
pub fn traces_url(endpoint: &str) -> Result<String, TraceError> {
    let bad = || TraceError::Endpoint(endpoint.to_string());
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .ok_or_else(bad)?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        return Err(bad());
    }
    if path.is_empty() {
        Ok(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
    } else {
        Ok(endpoint.to_string())
    }
}

/// The tracer provider: spans get ids always, and are exported in batches to
/// `endpoint` when one is given.
pub fn provider(endpoint: Option<&str>) -> Result<SdkTracerProvider, TraceError> {
    let resource = Resource::builder()
        .with_service_name("connex-router")
        .build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(endpoint) = endpoint {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(traces_url(endpoint)?)
            .with_timeout(Duration::from_secs(10))
            .with_headers(Default::default())
            .build()?;
        builder = builder.with_batch_exporter(exporter);
    }
    Ok(builder.build())
}

/// The tracing layer that turns the router's spans into OpenTelemetry spans.
pub fn layer<S>(provider: &SdkTracerProvider) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("connex-router"))
        .with_tracked_inactivity(false)
}

/// A span's place in a W3C trace, kept in its extensions by [`IdLayer`].
#[derive(Debug, Clone)]
struct TraceIds {
    trace_id: TraceId,
    span_id: SpanId,
    flags: TraceFlags,
    state: TraceState,
}

/// The tracing layer of a router that exports no spans: each span gets a
/// span id, and the trace id of its parent (a root span starts a trace), so
/// that the calls made inside it carry a `traceparent`. Nothing else: no span
/// data, no work when a span is entered or left.
pub struct IdLayer;

impl<S> tracing_subscriber::Layer<S> for IdLayer
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, _attrs: &Attributes<'_>, id: &Id, ctx: LayerContext<'_, S>) {
        let Some(span) = ctx.span(id) else {
            return;
        };
        let ids = RandomIdGenerator::default();
        let parent = span
            .parent()
            .and_then(|p| p.extensions().get::<TraceIds>().cloned());
        let own = match parent {
            Some(parent) => TraceIds {
                span_id: ids.new_span_id(),
                ..parent
            },
            None => TraceIds {
                trace_id: ids.new_trace_id(),
                span_id: ids.new_span_id(),
                flags: TraceFlags::SAMPLED,
                state: TraceState::default(),
            },
        };
        span.extensions_mut().insert(own);
    }
}

/// `f` on the registry's data of `span` (none without a registry: unit tests
/// with no subscriber).
fn on_data<T>(
    span: &Span,
    f: impl FnOnce(&tracing_subscriber::registry::SpanRef<'_, Registry>) -> Option<T>,
) -> Option<T> {
    span.with_subscriber(|(id, dispatch)| f(&dispatch.downcast_ref::<Registry>()?.span(id)?))
        .flatten()
}

/// The [`TraceIds`] of `span`, when [`IdLayer`] gave it some.
fn ids_of(span: &Span) -> Option<TraceIds> {
    on_data(span, |data| data.extensions().get::<TraceIds>().cloned())
}

/// Whether [`IdLayer`] traces `span` (tests).
#[cfg(test)]
pub(crate) fn has_ids(span: &Span) -> bool {
    ids_of(span).is_some()
}

/// Runs `f` on the [`TraceIds`] of `span`, when [`IdLayer`] gave it some.
fn with_ids<T>(span: &Span, f: impl FnOnce(&mut TraceIds) -> T) -> Option<T> {
    on_data(span, |data| {
        data.extensions_mut().get_mut::<TraceIds>().map(f)
    })
}

struct HeaderRead<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderRead<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Makes `span` (not yet entered) continue the client's trace, when its
/// headers carry a valid `traceparent`; otherwise the span starts a trace.
pub fn continue_trace(span: &Span, headers: &axum::http::HeaderMap) {
    if !headers.contains_key("traceparent") {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&HeaderRead(headers));
    let remote = parent.span().span_context().clone();
    if !remote.is_valid() {
        return;
    }
    // Without an exporter: the span takes the client's trace (its own span
    // id stays). With one, the OpenTelemetry layer makes it the client
    // span's child. Neither is there in unit tests: nothing to continue.
    let continued = with_ids(span, |ids| {
        ids.trace_id = remote.trace_id();
        ids.flags = remote.trace_flags();
        ids.state = remote.trace_state().clone();
    });
    if continued.is_none() {
        let _ = span.set_parent(parent);
    }
}

struct HeaderWrite(Vec<(&'static str, String)>);

impl Injector for HeaderWrite {
    fn set(&mut self, key: &str, value: String) {
        if let Some(name) = TRACE_HEADERS.iter().find(|h| **h == key) {
            self.0.push((name, value));
        }
    }
}

/// The trace headers of a call made inside `span` (none without the tracing
/// layer).
pub fn headers(span: &Span) -> Vec<(&'static str, String)> {
    let mut out = HeaderWrite(Vec::new());
    let context = match ids_of(span) {
        Some(ids) => Context::new().with_remote_span_context(SpanContext::new(
            ids.trace_id,
            ids.span_id,
            ids.flags,
            false,
            ids.state,
        )),
        None => span.context(),
    };
    TraceContextPropagator::new().inject_context(&context, &mut out);
    out.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    /// (trace id, parent span id, tracestate) of the headers of a call.
    fn parsed(headers: &[(&'static str, String)]) -> (String, String, Option<String>) {
        let get = |name| {
            headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
        };
        let parent = get("traceparent").expect("a traceparent");
        let parts: Vec<&str> = parent.split('-').collect();
        assert_eq!(parts.len(), 4, "{parent}");
        (
            parts[1].to_string(),
            parts[2].to_string(),
            get("tracestate"),
        )
    }

    #[test]
    fn without_an_exporter_calls_carry_the_clients_trace_from_spans_of_their_own() {
        let subscriber = tracing_subscriber::registry().with(IdLayer);
        tracing::subscriber::with_default(subscriber, || {
            let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
            let client_span = "00f067aa0ba902b7";
            let mut incoming = axum::http::HeaderMap::new();
            let traceparent = format!("00-{client_trace}-{client_span}-01");
            incoming.insert("traceparent", traceparent.parse().expect("header"));
            incoming.insert("tracestate", "vendor=opaque".parse().expect("header"));
            let request = tracing::error_span!("request");
            continue_trace(&request, &incoming);
            let prefill = tracing::info_span!(parent: &request, "prefill");
            let decode = tracing::info_span!(parent: &request, "decode");
            let (p_trace, p_parent, p_state) = parsed(&headers(&prefill));
            let (d_trace, d_parent, _) = parsed(&headers(&decode));
            assert_eq!(
                (p_trace.as_str(), d_trace.as_str()),
                (client_trace, client_trace)
            );
            assert_eq!(p_state.as_deref(), Some("vendor=opaque"));
            assert_ne!(p_parent, client_span, "the router's own span");
            assert_ne!(p_parent, d_parent, "one span per call");

            // No trace context from the client: one new trace for the request.
            let request = tracing::error_span!("request");
            continue_trace(&request, &axum::http::HeaderMap::new());
            let prefill = tracing::info_span!(parent: &request, "prefill");
            let decode = tracing::info_span!(parent: &request, "decode");
            let (p_trace, _, _) = parsed(&headers(&prefill));
            let (d_trace, _, _) = parsed(&headers(&decode));
            assert_eq!(p_trace, d_trace);
            assert_ne!(p_trace, client_trace);
        });
    }

    #[test]
    fn a_collector_base_url_gets_the_traces_path() {
        let url = |e| traces_url(e).ok();
        assert_eq!(
            url("http://c:4318").as_deref(),
            Some("http://c:4318/v1/traces")
        );
        assert_eq!(
            url("http://c:4318/").as_deref(),
            Some("http://c:4318/v1/traces")
        );
        assert_eq!(
            url("https://c/otlp/v1/traces").as_deref(),
            Some("https://c/otlp/v1/traces")
        );
        assert!(traces_url("c:4318").is_err());
        assert!(traces_url("http:///x").is_err());
    }
}
