//! What the router tells its operators: log lines (`logs.rs`), Prometheus
//! metrics (`metrics.rs`, every name declared once) and distributed traces
//! (`traces.rs`, W3C context in and out, optional OTLP export).

pub mod logs;
pub mod metrics;
pub mod traces;
