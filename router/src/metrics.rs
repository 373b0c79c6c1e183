//! Prometheus metrics: every name the router emits is declared here, once.

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub const REQUESTS: &str = "connex_requests_total";
pub const REQUEST_DURATION: &str = "connex_request_duration_seconds";
pub const TTFT: &str = "connex_ttft_seconds";
pub const INTER_TOKEN: &str = "connex_inter_token_latency_seconds";
pub const UPSTREAM_REQUESTS: &str = "connex_upstream_requests_total";
pub const UPSTREAM_ERRORS: &str = "connex_upstream_errors_total";
pub const INSTANCE_INFLIGHT: &str = "connex_instance_inflight";
pub const PREFILL_RETRIES: &str = "connex_prefill_retries_total";
pub const RESUMES: &str = "connex_resumes_total";
pub const RESUME_LATENCY: &str = "connex_resume_latency_seconds";
pub const FAILED_AFTER_RESUME: &str = "connex_requests_failed_after_resume_total";
pub const REPREFILLS: &str = "connex_reprefills_total";
pub const HOLDS_RELEASED: &str = "connex_holds_released_total";
pub const HOLDS_RENEWED: &str = "connex_holds_renewed_total";
pub const HEALTH_CHECK_FAILURES: &str = "connex_health_check_failures_total";
pub const EJECTIONS_REFUSED: &str = "connex_ejections_refused_total";
/// Counter: `cache_aware` choices, by phase and reason (cache, load, fallback).
pub const ROUTING_DECISIONS: &str = "connex_routing_decisions_total";
/// Histogram: prompt tokens cached on the instance `cache_aware` chose.
pub const PREFIX_HIT_TOKENS: &str = "connex_routing_prefix_hit_tokens";
/// Histogram: `/tokenize` calls for `cache_aware` prefill choice, by outcome.
pub const TOKENIZE_DURATION: &str = "connex_tokenize_duration_seconds";

/// Every metric name, for the test that checks they are all emitted.
pub const ALL: &[&str] = &[
    REQUESTS,
    REQUEST_DURATION,
    TTFT,
    INTER_TOKEN,
    UPSTREAM_REQUESTS,
    UPSTREAM_ERRORS,
    INSTANCE_INFLIGHT,
    PREFILL_RETRIES,
    RESUMES,
    RESUME_LATENCY,
    FAILED_AFTER_RESUME,
    REPREFILLS,
    HOLDS_RELEASED,
    HOLDS_RENEWED,
    HEALTH_CHECK_FAILURES,
    EJECTIONS_REFUSED,
    ROUTING_DECISIONS,
    PREFIX_HIT_TOKENS,
    TOKENIZE_DURATION,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns its render handle.
pub fn install() -> Option<PrometheusHandle> {
    if let Some(handle) = HANDLE.get() {
        return Some(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets(&[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0,
        ])
        .ok()?
        // Tokens, not seconds.
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(PREFIX_HIT_TOKENS.into()),
            &[0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0],
        )
        .ok()?
        .install_recorder()
        .ok()?;
    let _ = HANDLE.set(handle.clone());
    // Counters without labels exist from the start, at zero: "none happened"
    // is then a sample a dashboard (and a test) reads, not an absent series.
    for name in [PREFILL_RETRIES, FAILED_AFTER_RESUME, REPREFILLS] {
        counter!(name).increment(0);
    }
    Some(handle)
}

/// The status recorded for a request whose client went away before its end
/// (nginx's "client closed request").
pub const CLIENT_CLOSED: u16 = 499;

/// Records one request's metrics when it ends, however it ends: finished,
/// failed, or dropped because its client disconnected (recorded as
/// [`CLIENT_CLOSED`]). Created when the request arrives; the flow says how it
/// ended with [`RequestGuard::finish`].
#[derive(Debug)]
pub struct RequestGuard {
    route: &'static str,
    started: Instant,
    status: Option<u16>,
}

impl RequestGuard {
    pub fn new(route: &'static str) -> Self {
        Self {
            route,
            started: Instant::now(),
            status: None,
        }
    }

    /// How the request ended (the first call wins).
    pub fn finish(&mut self, status: u16) {
        self.status.get_or_insert(status);
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let status = self.status.unwrap_or(CLIENT_CLOSED);
        counter!(REQUESTS, "route" => self.route, "status" => status.to_string()).increment(1);
        histogram!(REQUEST_DURATION, "route" => self.route)
            .record(self.started.elapsed().as_secs_f64());
        upkeep_now_and_then();
    }
}

/// Requests ended, for [`upkeep_now_and_then`].
static ENDED: AtomicU64 = AtomicU64::new(0);

/// The exporter keeps every histogram sample (one per token for the
/// inter-token latency) until the next `/metrics` scrape folds them into the
/// buckets: without scrapes they would pile up. Every 1,024 requests the
/// request that ends folds them itself, so the memory stays bounded with no
/// task of its own.
fn upkeep_now_and_then() {
    if ENDED.fetch_add(1, Ordering::Relaxed) % 1024 == 1023 {
        if let Some(handle) = HANDLE.get() {
            handle.run_upkeep();
        }
    }
}

pub fn first_token(route: &'static str, instance: &str, ttft: Duration) {
    histogram!(TTFT, "route" => route, "instance" => instance.to_string())
        .record(ttft.as_secs_f64());
}

/// The inter-token histogram of one instance. A relay resolves it once and
/// records every token gap on the handle: looking the series up per token (label
/// allocation and a registry hash) was a visible share of the router's CPU.
pub fn inter_token(instance: &str) -> metrics::Histogram {
    histogram!(INTER_TOKEN, "instance" => instance.to_string())
}

pub fn upstream_request(instance: &str, phase: &'static str) {
    counter!(UPSTREAM_REQUESTS, "instance" => instance.to_string(), "phase" => phase).increment(1);
}

pub fn upstream_error(instance: &str, phase: &'static str, kind: &'static str) {
    counter!(UPSTREAM_ERRORS, "instance" => instance.to_string(), "phase" => phase, "kind" => kind)
        .increment(1);
}

/// One `cache_aware` choice for `phase`.
pub fn routing_decision(phase: &'static str, reason: &'static str, hit_tokens: usize) {
    counter!(ROUTING_DECISIONS, "phase" => phase, "reason" => reason).increment(1);
    histogram!(PREFIX_HIT_TOKENS, "phase" => phase).record(hit_tokens as f64);
}

/// One `/tokenize` call of the router.
pub fn tokenize(took: Duration, ok: bool) {
    let outcome = if ok { "ok" } else { "failed" };
    histogram!(TOKENIZE_DURATION, "outcome" => outcome).record(took.as_secs_f64());
}

pub fn prefill_retry() {
    counter!(PREFILL_RETRIES).increment(1);
}

pub fn instance_inflight(instance: &str, inflight: usize) {
    gauge!(INSTANCE_INFLIGHT, "instance" => instance.to_string()).set(inflight as f64);
}

/// A request moved to another decoder after a failure of `cause`.
pub fn resume(cause: &'static str) {
    counter!(RESUMES, "cause" => cause).increment(1);
}

/// Makes the resume series of `cause` exist (at zero).
pub fn declare_resume_cause(cause: &'static str) {
    counter!(RESUMES, "cause" => cause).increment(0);
}

/// Failure detected -> first token from the next decoder.
pub fn resume_latency(latency: Duration) {
    histogram!(RESUME_LATENCY).record(latency.as_secs_f64());
}

/// A request that failed although resumes were tried.
pub fn failed_after_resume() {
    counter!(FAILED_AFTER_RESUME).increment(1);
}

/// A resume found its hold gone and prefilled prompt + generated again.
pub fn reprefill() {
    counter!(REPREFILLS).increment(1);
}

/// The router's backstop release of a hold: `released`, `gone` (already freed,
/// by the decoder or its lease) or `failed`.
pub fn hold_released(outcome: &'static str) {
    counter!(HOLDS_RELEASED, "outcome" => outcome).increment(1);
}

/// A renewal of the hold of a long request: `renewed`, `gone` or `failed`.
pub fn hold_renewed(outcome: &'static str) {
    counter!(HOLDS_RENEWED, "outcome" => outcome).increment(1);
}

/// A failed `/health` probe of an instance.
pub fn health_check_failed(instance: &str) {
    counter!(HEALTH_CHECK_FAILURES, "instance" => instance.to_string()).increment(1);
}

/// An instance the probes would have declared dead was kept in rotation: its
/// streams deliver tokens (`delivering`), or too few instances would remain
/// (`bound`).
pub fn ejection_refused(instance: &str, why: &'static str) {
    counter!(EJECTIONS_REFUSED, "instance" => instance.to_string(), "why" => why).increment(1);
}
