//! The process's log output: text or JSON lines on stderr, filtered by
//! `--log-level` (else `CONNEX_LOG`, else the command's default).
//!
//! Every line logged on a request's path runs inside its `request` span
//! (`pd::record`), so that a line names its request: text lines show the span
//! as `request{request_id=..}:`, JSON lines carry it as `span` (and `spans`).

use crate::config::LogFormat;
use std::io::IsTerminal;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The env var read when no `--log-level` is given.
pub const LOG_ENV: &str = "CONNEX_LOG";

/// The tracing target of the access log: one line per request at its end.
pub const ACCESS_TARGET: &str = "connex::access";

/// Why the logs could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("invalid log filter `{filter}`: {source}")]
    Filter {
        filter: String,
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("cannot install the log subscriber: {0}")]
    Install(#[from] tracing_subscriber::util::TryInitError),
    #[error(transparent)]
    Traces(#[from] crate::observe::traces::TraceError),
}

/// The installed logs and traces; dropping it flushes the spans not yet
/// exported.
pub struct Telemetry {
    provider: opentelemetry_sdk::trace::SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Err(err) = self.provider.shutdown() {
            eprintln!("connex-router: flushing the last spans failed: {err}");
        }
    }
}

/// The filter: `level` when given, else `CONNEX_LOG`, else `default`.
pub fn filter(level: Option<&str>, default: &str) -> Result<EnvFilter, LogError> {
    let directive = match level {
        Some(level) => level.to_string(),
        None => std::env::var(LOG_ENV)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| default.to_string()),
    };
    EnvFilter::try_new(&directive).map_err(|source| LogError::Filter {
        filter: directive,
        source,
    })
}

/// The formatting layer of `format`, writing to stderr.
pub fn format_layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    // Colours only for a person at a terminal, never in a file or a pipe.
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => layer.boxed(),
        LogFormat::Json => layer
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .boxed(),
    }
}

/// The JSON line that tells the router's bound addresses (`url`, the client
/// listener; `internal_url`), shaped as the JSON log lines are.
pub fn listening_line(url: &str, internal_url: &str) -> String {
    use tracing_subscriber::fmt::format::Writer;
    use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
    let mut timestamp = String::new();
    // Writing to a String cannot fail; a timestamp left empty is still JSON.
    let _ = SystemTime.format_time(&mut Writer::new(&mut timestamp));
    serde_json::json!({
        "timestamp": timestamp,
        "level": "INFO",
        "message": "connex-router listening",
        "url": url,
        "internal_url": internal_url,
        "target": "connex_router",
    })
    .to_string()
}

/// Installs the process-wide subscriber: the log lines (filtered by the log
/// level) and the trace spans of the request path (whatever the log level;
/// exported to `otlp_endpoint` when given).
pub fn init(
    format: LogFormat,
    level: Option<&str>,
    default: &str,
    otlp_endpoint: Option<&str>,
) -> Result<Telemetry, LogError> {
    let provider = crate::observe::traces::provider(otlp_endpoint)?;
    let exporter = otlp_endpoint.is_some().then_some(&provider);
    subscriber(format, filter(level, default)?, exporter).try_init()?;
    Ok(Telemetry { provider })
}

/// The process's subscriber: log lines through `logs`, and the request path's
/// spans traced whatever the log level, by the OpenTelemetry layer of
/// `exporter` when spans are exported, else given their trace ids alone
/// (crate::observe::traces says why).
fn subscriber(
    format: LogFormat,
    logs: EnvFilter,
    exporter: Option<&opentelemetry_sdk::trace::SdkTracerProvider>,
) -> tracing::Dispatch {
    // The hint says that no event passes this filter, and no span finer than
    // INFO (the request path's spans are INFO and ERROR): without it the
    // subscriber's level is TRACE, `log`'s max level with it, and every
    // `log::trace!` of a dependency (the tokenizers crate has them in its
    // inner loops) went through tracing-log and the filters, ~25% of the
    // router's CPU while it tokenized.
    let spans = tracing_subscriber::filter::filter_fn(|meta| {
        meta.is_span() && meta.target().starts_with("connex")
    })
    .with_max_level_hint(tracing_subscriber::filter::LevelFilter::INFO);
    let lines = tracing_subscriber::registry().with(format_layer(format).with_filter(logs));
    match exporter {
        Some(provider) => tracing::Dispatch::new(
            lines.with(crate::observe::traces::layer(provider).with_filter(spans)),
        ),
        None => {
            tracing::Dispatch::new(lines.with(crate::observe::traces::IdLayer.with_filter(spans)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The subscriber the router installs, without an exporter: a request's
    /// spans get their trace ids from the light layer even with every log
    /// line filtered out, and the engine calls carry them.
    #[test]
    fn without_an_exporter_spans_get_ids_whatever_the_log_level() {
        let off = filter(Some("off"), "info").expect("filter");
        let dispatch = subscriber(LogFormat::Text, off, None);
        tracing::dispatcher::with_default(&dispatch, || {
            let request = tracing::error_span!("request");
            let call = tracing::info_span!(parent: &request, "decode");
            assert!(
                crate::observe::traces::has_ids(&call),
                "not traced by the id layer"
            );
            let headers = crate::observe::traces::headers(&call);
            assert!(
                headers.iter().any(|(name, _)| *name == "traceparent"),
                "{headers:?}"
            );
        });
    }
}
