//! Distributed traces: W3C trace context in and out, and an optional OTLP/HTTP
//! export of the router's spans.
//!
//! A request continues the trace of the client's `traceparent` (and
//! `tracestate`), or starts one; the prefill call and every decoder call carry
//! the trace on to the engine (vLLM continues it with `--otlp-traces-endpoint`).
//! The spans (`request`, `prefill`, `decode` per attempt, `resume`) are
//! exported to `--otlp-endpoint` when one is given; without it they still get
//! their ids, so that the engines' spans join the client's trace.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use std::time::Duration;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

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
    // Fails only without the tracing layer (unit tests): nothing to continue.
    let _ = span.set_parent(parent);
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
    TraceContextPropagator::new().inject_context(&span.context(), &mut out);
    out.0
}

#[cfg(test)]
mod tests {
    use super::*;

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
