//! Prometheus metrics: every name the router emits is declared here, once.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

pub const REQUESTS: &str = "connex_requests_total";
pub const REQUEST_DURATION: &str = "connex_request_duration_seconds";
pub const INSTANCE_REQUEST_DURATION: &str = "connex_instance_request_duration_seconds";
pub const PREFILL_DURATION: &str = "connex_prefill_duration_seconds";
pub const TTFT: &str = "connex_ttft_seconds";
pub const INTER_TOKEN: &str = "connex_inter_token_latency_seconds";
pub const UPSTREAM_REQUESTS: &str = "connex_upstream_requests_total";
pub const UPSTREAM_ERRORS: &str = "connex_upstream_errors_total";
pub const INSTANCE_INFLIGHT: &str = "connex_instance_inflight";
pub const INSTANCES: &str = "connex_instances";
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

/// Counter: TCP connections the router opened to engines, by engine address.
pub const ENGINE_CONNECTIONS_OPENED: &str = "connex_engine_connections_opened_total";
pub const BODY_BYTES_IN_FLIGHT: &str = "connex_request_body_bytes_in_flight";
/// Per tenant (labels bounded by the tenants file).
pub const TENANT_REQUESTS: &str = "connex_tenant_requests_total";
pub const TENANT_REJECTIONS: &str = "connex_tenant_rejections_total";
pub const TENANT_TOKENS: &str = "connex_tenant_tokens_total";
pub const TENANT_QUEUE_TIME: &str = "connex_tenant_queue_seconds";
/// The shared response store (`--response-store`).
pub const RESPONSE_STORE_UP: &str = "connex_response_store_up";
pub const RESPONSE_STORE_ERRORS: &str = "connex_response_store_errors_total";
pub const RESPONSE_STORE_FULL: &str = "connex_response_store_full_total";
pub const RESPONSE_STORE_TOO_LARGE: &str = "connex_response_store_too_large_total";

/// The kind of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every family the recorder holds: name, kind and `# HELP` text.
pub const FAMILIES: &[(&str, Kind, &str)] = &[
    (
        REQUESTS,
        Kind::Counter,
        "OpenAI requests ended, by route, model and HTTP status (499: the client went away).",
    ),
    (
        REQUEST_DURATION,
        Kind::Histogram,
        "Arrival to end of OpenAI requests, by route and model.",
    ),
    (
        INSTANCE_REQUEST_DURATION,
        Kind::Histogram,
        "Arrival to end of requests, by the decoder that finished them and model.",
    ),
    (
        PREFILL_DURATION,
        Kind::Histogram,
        "Prefill calls that answered, by prefill instance and model.",
    ),
    (
        TTFT,
        Kind::Histogram,
        "Arrival to first token (prefill included), by route, decoder instance and model.",
    ),
    (
        INTER_TOKEN,
        Kind::Histogram,
        "Time between tokens of a stream, by decoder instance.",
    ),
    (
        UPSTREAM_REQUESTS,
        Kind::Counter,
        "Calls to engines, by instance, model and phase (prefill, decode).",
    ),
    (
        UPSTREAM_ERRORS,
        Kind::Counter,
        "Failed calls to engines, by instance, model, phase and kind.",
    ),
    (
        PREFILL_RETRIES,
        Kind::Counter,
        "Prefills retried on another instance.",
    ),
    (
        RESUMES,
        Kind::Counter,
        "Requests moved to another decoder, by cause and model.",
    ),
    (
        RESUME_LATENCY,
        Kind::Histogram,
        "Decoder failure detected to first token of the next decoder.",
    ),
    (
        FAILED_AFTER_RESUME,
        Kind::Counter,
        "Requests that failed although resumes were tried, by model.",
    ),
    (
        REPREFILLS,
        Kind::Counter,
        "Resumes that found their hold gone and prefilled prompt and generated tokens again.",
    ),
    (
        HOLDS_RELEASED,
        Kind::Counter,
        "The router's releases of KV holds, by outcome (released, gone, failed).",
    ),
    (
        HOLDS_RENEWED,
        Kind::Counter,
        "Renewals of the KV holds of long requests, by outcome.",
    ),
    (
        HEALTH_CHECK_FAILURES,
        Kind::Counter,
        "Failed /health probes, by instance.",
    ),
    (
        EJECTIONS_REFUSED,
        Kind::Counter,
        "Instances kept in rotation that the probes would have ejected, by instance and why.",
    ),
    (
        ROUTING_DECISIONS,
        Kind::Counter,
        "Instance choices of the cache_aware policy, by phase and reason (cache, load, fallback).",
    ),
    (
        PREFIX_HIT_TOKENS,
        Kind::Histogram,
        "Prompt tokens the chosen instance already held (cache_aware), by phase.",
    ),
    (
        TOKENIZE_DURATION,
        Kind::Histogram,
        "Tokenizing a text prompt before choosing a prefill, by who tokenized it (router: its own tokenizer, engine: an engine's /tokenize) and outcome.",
    ),
    (
        ENGINE_CONNECTIONS_OPENED,
        Kind::Counter,
        "TCP connections the router opened to engines, by engine (host:port): kept-alive connections are reused, so a rate near the request rate means they are not.",
    ),
    (
        BODY_BYTES_IN_FLIGHT,
        Kind::Gauge,
        "Request body bytes the router's requests hold of --max-inflight-body-bytes (set at each scrape).",
    ),
    (
        TENANT_REQUESTS,
        Kind::Counter,
        "Requests admitted, by tenant.",
    ),
    (
        TENANT_REJECTIONS,
        Kind::Counter,
        "Requests refused on admission with 429, by tenant and reason (max_concurrent, tokens_per_minute, queue_full, queue_wait).",
    ),
    (
        TENANT_TOKENS,
        Kind::Counter,
        "Tokens of ended requests, by tenant and kind (prompt, completion).",
    ),
    (
        TENANT_QUEUE_TIME,
        Kind::Histogram,
        "Arrival to admission of admitted requests (time waiting for a slot), by tenant.",
    ),
    (
        RESPONSE_STORE_UP,
        Kind::Gauge,
        "1 while the shared response store (--response-store) answers, 0 while this replica is degraded to its own memory.",
    ),
    (
        RESPONSE_STORE_ERRORS,
        Kind::Counter,
        "Response store calls that failed or timed out, by op (connect, put, get, delete, append, state, read, cancel).",
    ),
    (
        RESPONSE_STORE_FULL,
        Kind::Counter,
        "Response store writes refused for want of memory (Redis maxmemory reached, OOM), by op; each is also in connex_response_store_errors_total.",
    ),
    (
        RESPONSE_STORE_TOO_LARGE,
        Kind::Counter,
        "Responses refused by the response store for passing --response-store-max-response-bytes, by kind (stored: not stored; background: failed, its generation stopped).",
    ),
];

/// The families rendered at scrape time from the membership (never stale:
/// an instance removed from it is gone from the next scrape).
pub const SCRAPE_TIME_FAMILIES: &[(&str, Kind, &str)] = &[
    (INSTANCE_INFLIGHT, Kind::Gauge, "Requests this router has in flight on an instance, by instance, role and model."),
    (INSTANCES, Kind::Gauge, "Instances known to this router, by role, model and state (ready, draining, migrating, dead, unhealthy)."),
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns its render handle.
///
/// The exporter cannot remove a series on demand; with `idle` set, a counter
/// or histogram series not updated for that long is dropped at the next
/// scrape (an evicted instance's series among them). Gauges are left alone:
/// the per-instance ones are rendered from the membership at scrape time.
pub fn install(idle: Option<Duration>) -> Option<PrometheusHandle> {
    if let Some(handle) = HANDLE.get() {
        return Some(handle.clone());
    }
    let handle = PrometheusBuilder::new()
        .set_buckets(&[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0,
        ])
        .ok()?
        .idle_timeout(MetricKindMask::COUNTER | MetricKindMask::HISTOGRAM, idle)
        // Tokens, not seconds.
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(PREFIX_HIT_TOKENS.into()),
            &[0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0],
        )
        .ok()?
        .install_recorder()
        .ok()?;
    let _ = HANDLE.set(handle.clone());
    for (name, kind, help) in FAMILIES {
        match kind {
            Kind::Counter => describe_counter!(*name, *help),
            Kind::Gauge => describe_gauge!(*name, *help),
            Kind::Histogram => describe_histogram!(*name, *help),
        }
    }
    declare_zero_series([]);
    Some(handle)
}

/// The resume causes that count as resumes (set once by the state).
static RESUME_CAUSES: OnceLock<Vec<&'static str>> = OnceLock::new();

pub fn set_resume_causes(causes: Vec<&'static str>) {
    let _ = RESUME_CAUSES.set(causes);
}

/// Counters exist at zero before anything happened: "none happened" is then
/// a sample a dashboard (and a test) reads, not an absent series. Called
/// before each scrape with the models served now, so that the idle timeout
/// drops only those of models gone.
pub fn declare_zero_series<'a>(models: impl IntoIterator<Item = &'a str>) {
    for name in [PREFILL_RETRIES, REPREFILLS] {
        counter!(name).increment(0);
    }
    let causes = RESUME_CAUSES.get().map(Vec::as_slice).unwrap_or_default();
    for model in models {
        for cause in causes {
            counter!(RESUMES, "cause" => *cause, "model" => model.to_string()).increment(0);
        }
        counter!(FAILED_AFTER_RESUME, "model" => model.to_string()).increment(0);
    }
}

/// One instance as the scrape-time gauges see it.
#[derive(Debug, Clone)]
pub struct InstanceSample<'a> {
    pub id: &'a str,
    pub role: &'static str,
    pub model: &'a str,
    /// `ready`, `draining`, `migrating`, `dead`, or `unhealthy` (the probes'
    /// verdict, whatever the lifecycle).
    pub state: &'static str,
    pub inflight: usize,
}

/// Every state of [`INSTANCES`]: each (role, model) has a sample of each, so
/// that "no draining instance" reads 0.
pub const INSTANCE_STATES: [&str; 5] = ["ready", "draining", "migrating", "dead", "unhealthy"];

/// The scrape-time families, in Prometheus text format.
pub fn render_instances(instances: &[InstanceSample<'_>]) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write;
    let mut out = String::new();
    let header = |out: &mut String, (name, _, help): &(&str, Kind, &str)| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    };
    header(&mut out, &SCRAPE_TIME_FAMILIES[0]);
    for i in instances {
        let _ = writeln!(
            out,
            "{INSTANCE_INFLIGHT}{{instance=\"{}\",role=\"{}\",model=\"{}\"}} {}",
            escape(i.id),
            i.role,
            escape(i.model),
            i.inflight
        );
    }
    header(&mut out, &SCRAPE_TIME_FAMILIES[1]);
    let mut counts: BTreeMap<(&str, &str), [usize; 5]> = BTreeMap::new();
    for i in instances {
        let slot = counts.entry((i.role, i.model)).or_default();
        if let Some(at) = INSTANCE_STATES.iter().position(|s| *s == i.state) {
            slot[at] += 1;
        }
    }
    for ((role, model), count) in counts {
        for (state, n) in INSTANCE_STATES.iter().zip(count) {
            let _ = writeln!(
                out,
                "{INSTANCES}{{role=\"{role}\",model=\"{}\",state=\"{state}\"}} {n}",
                escape(model)
            );
        }
    }
    out
}

/// A label value as the text format writes it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The status recorded for a request whose client went away before its end
/// (nginx's "client closed request").
pub const CLIENT_CLOSED: u16 = 499;

/// One request ended with `status` after `duration` (`model` empty when the
/// request was refused before its model was known).
pub fn request_ended(route: &'static str, model: &str, status: u16, duration: Duration) {
    counter!(REQUESTS, "route" => route, "model" => model.to_string(), "status" => status.to_string())
        .increment(1);
    histogram!(REQUEST_DURATION, "route" => route, "model" => model.to_string())
        .record(duration.as_secs_f64());
    upkeep_now_and_then();
}

/// A request of `tenant` was admitted after `queued` waiting for a slot.
pub fn tenant_admitted(tenant: &str, queued: Duration) {
    counter!(TENANT_REQUESTS, "tenant" => tenant.to_string()).increment(1);
    histogram!(TENANT_QUEUE_TIME, "tenant" => tenant.to_string()).record(queued.as_secs_f64());
}

/// A request of `tenant` was refused on admission (429) for `reason`.
pub fn tenant_rejected(tenant: &str, reason: &'static str) {
    counter!(TENANT_REJECTIONS, "tenant" => tenant.to_string(), "reason" => reason).increment(1);
}

/// A request of `tenant` ended having used these tokens.
pub fn tenant_tokens(tenant: &str, prompt: u64, completion: u64) {
    counter!(TENANT_TOKENS, "tenant" => tenant.to_string(), "kind" => "prompt").increment(prompt);
    counter!(TENANT_TOKENS, "tenant" => tenant.to_string(), "kind" => "completion")
        .increment(completion);
}

/// A request finished by `decoder` (the last that served it) ended.
pub fn instance_request_ended(decoder: &str, model: &str, duration: Duration) {
    histogram!(INSTANCE_REQUEST_DURATION, "instance" => decoder.to_string(), "model" => model.to_string())
        .record(duration.as_secs_f64());
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

pub fn first_token(route: &'static str, instance: &str, model: &str, ttft: Duration) {
    histogram!(TTFT, "route" => route, "instance" => instance.to_string(), "model" => model.to_string())
        .record(ttft.as_secs_f64());
}

/// A prefill call that answered after `latency`.
pub fn prefill_duration(instance: &str, model: &str, latency: Duration) {
    histogram!(PREFILL_DURATION, "instance" => instance.to_string(), "model" => model.to_string())
        .record(latency.as_secs_f64());
}

/// The inter-token histogram of one instance. A relay resolves it once and
/// records every token gap on the handle: looking the series up per token (label
/// allocation and a registry hash) was a visible share of the router's CPU.
pub fn inter_token(instance: &str) -> metrics::Histogram {
    histogram!(INTER_TOKEN, "instance" => instance.to_string())
}

pub fn upstream_request(instance: &str, model: &str, phase: &'static str) {
    counter!(UPSTREAM_REQUESTS, "instance" => instance.to_string(), "model" => model.to_string(), "phase" => phase)
        .increment(1);
}

pub fn upstream_error(instance: &str, model: &str, phase: &'static str, kind: &'static str) {
    counter!(UPSTREAM_ERRORS, "instance" => instance.to_string(), "model" => model.to_string(), "phase" => phase, "kind" => kind)
        .increment(1);
}

/// One `cache_aware` choice for `phase`.
pub fn routing_decision(phase: &'static str, reason: &'static str, hit_tokens: usize) {
    counter!(ROUTING_DECISIONS, "phase" => phase, "reason" => reason).increment(1);
    histogram!(PREFIX_HIT_TOKENS, "phase" => phase).record(hit_tokens as f64);
}

/// One `/tokenize` call of the router.
/// A prompt tokenized for `cache_aware`, by `by` ("router": its own
/// tokenizer; "engine": an engine's `/tokenize`).
pub fn tokenize(took: Duration, by: &'static str, ok: bool) {
    let outcome = if ok { "ok" } else { "failed" };
    histogram!(TOKENIZE_DURATION, "by" => by, "outcome" => outcome).record(took.as_secs_f64());
}

pub fn prefill_retry() {
    counter!(PREFILL_RETRIES).increment(1);
}

/// A request for `model` moved to another decoder after a failure of `cause`.
pub fn resume(cause: &'static str, model: &str) {
    counter!(RESUMES, "cause" => cause, "model" => model.to_string()).increment(1);
}

/// Failure detected -> first token from the next decoder.
pub fn resume_latency(latency: Duration) {
    histogram!(RESUME_LATENCY).record(latency.as_secs_f64());
}

/// A request that failed although resumes were tried.
pub fn failed_after_resume(model: &str) {
    counter!(FAILED_AFTER_RESUME, "model" => model.to_string()).increment(1);
}

/// A resume found its hold gone and prefilled prompt + generated again.
pub fn reprefill() {
    counter!(REPREFILLS).increment(1);
}

/// The router's backstop release of a hold: `released`, `gone` (already freed,
/// by the decoder or its lease), `failed`, or `dropped` (given up unsent: too
/// many releases waiting for one holder; the lease frees it).
pub fn hold_released(outcome: &'static str) {
    counter!(HOLDS_RELEASED, "outcome" => outcome).increment(1);
}

/// A renewal of the hold of a long request: `renewed`, `gone`, `failed`,
/// `expired` (renewing stopped: the hold lapsed before a renewal went
/// through) or `untracked` (the keeper's queue was full when the request took
/// its lease: never renewed).
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

/// A new TCP connection to the engine at `authority` (`host:port`).
pub fn engine_connection_opened(authority: &str) {
    counter!(ENGINE_CONNECTIONS_OPENED, "engine" => authority.to_string()).increment(1);
}
