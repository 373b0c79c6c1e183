//! End-to-end observability: a real router's logs (JSON and text), read from
//! its stderr as an operator's log pipeline would, with a real prefill and
//! decoders as processes on loopback.

use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// Every stderr line of the router, each parsed as one JSON object.
fn json_lines(logs: &LogLines) -> Vec<Value> {
    logs.lines()
        .iter()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|err| panic!("log line is not JSON ({err}): {line}"))
        })
        .collect()
}

/// The access lines (target `connex::access`) of `request_id`.
fn access_lines(lines: &[Value], request_id: &str) -> Vec<Value> {
    lines
        .iter()
        .filter(|l| l["target"] == "connex::access" && l["request_id"] == request_id)
        .cloned()
        .collect()
}

/// Whether a JSON line was logged inside the span of `request_id`.
fn in_request_span(line: &Value, request_id: &str) -> bool {
    line["span"]["request_id"] == request_id
        || line["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| s["name"] == "request" && s["request_id"] == request_id)
}

/// Waits until the router logged the access line of `request_id` (it is
/// written when the request's stream has been dropped).
async fn wait_access_line(logs: &LogLines, request_id: &str) {
    eventually(Duration::from_secs(10), "the access line", || async {
        logs.lines()
            .iter()
            .any(|l| l.contains("connex::access") && l.contains(request_id))
    })
    .await;
}

/// With `--log-format json` every line the router writes is JSON: a log
/// shipper reading its stdout and stderr together must never meet a line it
/// cannot parse. The bound addresses, which text mode prints as two plain
/// lines, come as fields of one JSON line.
#[tokio::test(flavor = "multi_thread")]
async fn json_mode_writes_only_json_lines_with_the_addresses_as_fields() {
    let (router, logs) = router_logged(&["--log-format", "json"]);
    let health = client()
        .get(format!("{}/health", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "the router is at the address it gave");
    let stdout = router.stdout.lines();
    let announced: Vec<Value> = stdout
        .iter()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|err| panic!("stdout line is not JSON ({err}): {line}"))
        })
        .collect();
    assert_eq!(announced.len(), 1, "{stdout:?}");
    assert_eq!(announced[0]["url"], router.url.as_str());
    assert_eq!(announced[0]["internal_url"], router.internal.as_str());
    assert_eq!(announced[0]["level"], "INFO");
    assert!(announced[0]["timestamp"]
        .as_str()
        .is_some_and(|t| !t.is_empty()));
    json_lines(&logs);
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_carry_an_access_line_per_request_and_the_request_id_on_every_line() {
    // d0 crashes after 4 tokens: the request resumes on d1 (round-robin over
    // the sorted ids sends the first request to d0).
    let (router, logs) = router_logged(&["--log-format", "json", "--decode-policy", "round_robin"]);
    let prefill = engine(Some(&router), "prefill", &[]);
    let _d0 = engine(
        Some(&router),
        "decode",
        &[
            "--id",
            "d0",
            "--crash-after-tokens",
            "4",
            "--decode-us-per-token",
            "1000",
        ],
    );
    let _d1 = engine(Some(&router), "decode", &["--id", "d1"]);
    wait_ready(&router, 3).await;
    let prefill_id = instance_id(&router, &prefill).await;

    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .header("x-request-id", "obs-resumed")
        .json(
            &json!({"model": "mock", "prompt": "watch me", "max_tokens": 16,
                      "stream": true, "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let events = sse_events(&response.text().await.unwrap());
    let usage = events
        .iter()
        .find_map(|e| e.get("usage").filter(|u| u.is_object()))
        .cloned()
        .expect("usage chunk");
    assert_eq!(usage["completion_tokens"], 16);

    let refused = client()
        .post(format!("{}/v1/completions", router.url))
        .header("x-request-id", "obs-refused")
        .json(&json!({"model": "mock", "prompt": "x", "max_tokens": "many"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);

    wait_access_line(&logs, "obs-resumed").await;
    wait_access_line(&logs, "obs-refused").await;
    let lines = json_lines(&logs);

    // One access line per request, at INFO, with what an operator looks for.
    let access = access_lines(&lines, "obs-resumed");
    assert_eq!(access.len(), 1, "one access line: {access:?}");
    let access = &access[0];
    assert_eq!(access["level"], "INFO");
    assert_eq!(access["model"], "mock");
    assert_eq!(access["route"], "/v1/completions");
    assert_eq!(access["status"], 200);
    assert_eq!(access["prefill"], prefill_id.as_str());
    assert_eq!(access["decoders"], "d0,d1");
    assert_eq!(access["resumes"], 1);
    assert_eq!(access["prompt_tokens"], usage["prompt_tokens"]);
    assert_eq!(access["completion_tokens"], usage["completion_tokens"]);
    assert_eq!(access["completion_tokens"], 16);
    let ttft = access["ttft_ms"].as_f64().expect("ttft_ms");
    let duration = access["duration_ms"].as_f64().expect("duration_ms");
    assert!(
        ttft > 0.0 && ttft <= duration,
        "ttft {ttft} ms, duration {duration} ms"
    );

    let refused = access_lines(&lines, "obs-refused");
    assert_eq!(refused.len(), 1, "one access line: {refused:?}");
    assert_eq!(refused[0]["status"], 400);

    // The resume's warnings name their request through its span.
    let failures: Vec<&Value> = lines
        .iter()
        .filter(|l| l["level"] == "WARN" && l["message"] == "decoder failed")
        .collect();
    assert!(!failures.is_empty(), "no `decoder failed` line: {lines:?}");
    for line in failures {
        assert!(
            in_request_span(line, "obs-resumed"),
            "no request id: {line}"
        );
        assert_eq!(line["decoder"], "d0");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn log_level_filters_lines_and_text_lines_name_their_request() {
    // Warnings, and the access log by its target: not the startup INFO lines.
    let (router, logs) = router_logged(&["--log-level", "warn,connex::access=info"]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let _decoder = engine(Some(&router), "decode", &[]);
    wait_ready(&router, 2).await;
    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .header("x-request-id", "obs-text")
        .json(&json!({"model": "mock", "prompt": "hi", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    wait_access_line(&logs, "obs-text").await;
    let lines = logs.lines();
    assert!(
        !lines.iter().any(|l| l.contains("connex-router listening")),
        "an INFO line passed a warn filter: {lines:?}"
    );
    let access: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("connex::access"))
        .collect();
    assert_eq!(access.len(), 1, "{lines:?}");
    // The span is on even though a warn filter would leave out an INFO span.
    let failed = lines.iter().filter(|l| l.contains("WARN")).count();
    assert_eq!(failed, 0, "{lines:?}");
    for field in [
        "request_id=obs-text",
        "status=200",
        "model=\"mock\"",
        "completion_tokens=4",
    ] {
        assert!(
            access[0].contains(field),
            "`{field}` missing: {}",
            access[0]
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn host_and_port_flags_set_the_client_listener() {
    let port = free_port();
    let router = Proc::start(
        env!("CARGO_BIN_EXE_connex-router"),
        &[
            "serve".to_string(),
            "--host".to_string(),
            "127.0.0.1".to_string(),
            "--port".to_string(),
            port.to_string(),
            "--internal-listen".to_string(),
            "127.0.0.1:0".to_string(),
        ],
    );
    assert_eq!(router.url, format!("http://127.0.0.1:{port}"));
    let health = client()
        .get(format!("{}/health", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);

    // With --listen as well: refused, and the error names both flags.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_connex-router"))
        .args(["serve", "--listen", "127.0.0.1:0", "--port", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--listen") && err.contains("--port"), "{err}");
}

/// The families of a Prometheus text: name -> (type, help).
fn families(text: &str) -> std::collections::BTreeMap<String, (String, String)> {
    let mut out = std::collections::BTreeMap::<String, (String, String)>::new();
    for line in text.lines() {
        let mut words = line.splitn(4, ' ');
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("#"), Some("TYPE"), Some(name), Some(kind)) => {
                out.entry(name.into()).or_default().0 = kind.into();
            }
            (Some("#"), Some("HELP"), Some(name), help) => {
                let help = help.unwrap_or_default().to_string();
                out.entry(name.into()).or_default().1 = help;
            }
            _ => {}
        }
    }
    out
}

/// The family a sample line belongs to (a histogram's `_bucket`, `_sum` and
/// `_count` are its family's).
fn family_of<'a>(
    sample: &'a str,
    known: &std::collections::BTreeMap<String, (String, String)>,
) -> &'a str {
    let name = sample.split(['{', ' ']).next().unwrap_or_default();
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if known.get(base).is_some_and(|(kind, _)| kind == "histogram") {
                return base;
            }
        }
    }
    name
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_name_the_model_time_each_instance_and_all_have_help() {
    let (router, [prefill, _d0, _d1]) = failover_cluster(
        &[],
        &["--crash-after-tokens", "4", "--decode-us-per-token", "1000"],
        &[],
    )
    .await;
    let prefill_id = instance_id(&router, &prefill).await;
    let body = json!({"model": "mock", "prompt": "count me", "max_tokens": 12, "stream": true});
    stream(&router, "/v1/completions", &body).await;
    let text = metrics_text(&router).await;

    // Every family says what it is.
    let known = families(&text);
    for sample in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let family = family_of(sample, &known);
        let (kind, help) = known.get(family).cloned().unwrap_or_default();
        assert!(!kind.is_empty(), "no # TYPE for {family}:\n{text}");
        assert!(help.trim().len() > 10, "no # HELP for {family}:\n{text}");
    }

    let model = "model=\"mock\"";
    let one = |name: &str, labels: &[&str]| {
        assert_eq!(
            metric(&text, name, labels),
            1.0,
            "{name} {labels:?}:\n{text}"
        );
    };
    one("connex_requests_total", &[model, "status=\"200\""]);
    one("connex_request_duration_seconds_count", &[model]);
    one("connex_resumes_total", &[model, "cause=\"reset\""]);
    // The first token came from d0 (before its crash); d1 finished the request.
    one("connex_ttft_seconds_count", &[model, "instance=\"d0\""]);
    one(
        "connex_instance_request_duration_seconds_count",
        &[model, "instance=\"d1\""],
    );
    one(
        "connex_prefill_duration_seconds_count",
        &[model, &format!("instance=\"{prefill_id}\"")],
    );
    one(
        "connex_upstream_requests_total",
        &[model, "instance=\"d1\"", "phase=\"decode\""],
    );
    assert_eq!(
        metric(&text, "connex_requests_failed_after_resume_total", &[model]),
        0.0
    );
    for (role, ready) in [("prefill", 1.0), ("decode", 2.0)] {
        let labels = [model, &format!("role=\"{role}\"")];
        assert!(
            metric(&text, "connex_instances", &labels) >= ready,
            "{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn instance_gauges_follow_the_membership_and_removed_instances_leave_metrics() {
    let (router, [_prefill, mut d0, _d1]) =
        failover_cluster(&["--metrics-idle-timeout-s", "1"], &[], &[]).await;
    let body = json!({"model": "mock", "prompt": "hi", "max_tokens": 4});
    assert_eq!(post(&router, "/v1/completions", &body).await.0, 200);
    let state = |text: &str, role: &str, state: &str| {
        let labels = [
            "model=\"mock\"".to_string(),
            format!("role=\"{role}\""),
            format!("state=\"{state}\""),
        ];
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        metric(text, "connex_instances", &labels)
    };
    let text = metrics_text(&router).await;
    assert_eq!(state(&text, "decode", "ready"), 2.0, "{text}");
    assert_eq!(state(&text, "decode", "draining"), 0.0, "{text}");
    assert_eq!(state(&text, "prefill", "ready"), 1.0, "{text}");
    assert!(
        text.contains("instance=\"d0\""),
        "d0 served the request:\n{text}"
    );

    let (status, _) = admin(
        &router,
        reqwest::Method::POST,
        "/admin/instances/d1/drain",
        None,
    )
    .await;
    assert_eq!(status, 200);
    let text = metrics_text(&router).await;
    assert_eq!(state(&text, "decode", "ready"), 1.0, "{text}");
    assert_eq!(state(&text, "decode", "draining"), 1.0, "{text}");

    // d0 goes away for good: its gauges at once, its counters and histograms
    // after the idle timeout; d1 (still a member) keeps its gauge.
    d0.kill();
    let (status, _) = admin(
        &router,
        reqwest::Method::DELETE,
        "/admin/instances/d0",
        None,
    )
    .await;
    assert_eq!(status, 204);
    let text = metrics_text(&router).await;
    assert_eq!(state(&text, "decode", "ready"), 0.0, "{text}");
    assert!(
        !text.contains("connex_instance_inflight{instance=\"d0\""),
        "{text}"
    );
    assert!(
        text.contains("connex_instance_inflight{instance=\"d1\""),
        "{text}"
    );
    eventually(Duration::from_secs(10), "d0's series dropped", || async {
        !metrics_text(&router).await.contains("instance=\"d0\"")
    })
    .await;
}

/// One span as an OTLP receiver got it (ids in hex).
#[derive(Debug, Clone)]
struct ReceivedSpan {
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    trace_state: String,
    attributes: Vec<(String, String)>,
}

impl ReceivedSpan {
    fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A small OTLP/HTTP (protobuf) traces receiver on loopback: its URL and the
/// spans it got.
async fn otlp_receiver() -> (String, std::sync::Arc<std::sync::Mutex<Vec<ReceivedSpan>>>) {
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
    use prost::Message;
    let spans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let got = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: bytes::Bytes| {
            let got = got.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                let mut got = got.lock().unwrap();
                for span in request
                    .resource_spans
                    .iter()
                    .flat_map(|r| &r.scope_spans)
                    .flat_map(|s| &s.spans)
                {
                    let attributes = span
                        .attributes
                        .iter()
                        .map(|kv| {
                            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                                Some(Any::StringValue(s)) => s.clone(),
                                Some(Any::IntValue(i)) => i.to_string(),
                                Some(Any::BoolValue(b)) => b.to_string(),
                                other => format!("{other:?}"),
                            };
                            (kv.key.clone(), value)
                        })
                        .collect();
                    got.push(ReceivedSpan {
                        name: span.name.clone(),
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        trace_state: span.trace_state.clone(),
                        attributes,
                    });
                }
                (
                    [("content-type", "application/x-protobuf")],
                    ExportTraceServiceResponse::default().encode_to_vec(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}

/// The client's trace and span in the trace tests.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// A streamed completion of `max_tokens` whose client sends trace context
/// (span [`CLIENT_SPAN`] of trace [`TRACE_ID`], tracestate `vendor=opaque`),
/// read to its end.
async fn traced_stream(router: &Proc, max_tokens: u32) {
    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .header("traceparent", format!("00-{TRACE_ID}-{CLIENT_SPAN}-01"))
        .header("tracestate", "vendor=opaque")
        .json(&json!({"model": "mock", "prompt": "trace me", "max_tokens": max_tokens, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.text().await.unwrap();
}

/// (trace id, parent span id) of a W3C `traceparent`.
fn trace_parent(header: &str) -> (String, String) {
    let parts: Vec<&str> = header.split('-').collect();
    assert_eq!(parts.len(), 4, "traceparent {header}");
    assert_eq!(parts[0], "00", "traceparent {header}");
    (parts[1].to_string(), parts[2].to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn traces_continue_the_clients_trace_to_every_engine_call_and_are_exported() {
    let (collector, spans) = otlp_receiver().await;
    let (router, [prefill, d0, d1]) = failover_cluster(
        &["--otlp-endpoint", &collector],
        &["--crash-after-tokens", "4", "--decode-us-per-token", "1000"],
        &[],
    )
    .await;
    let (trace_id, client_span) = (TRACE_ID, CLIENT_SPAN);
    traced_stream(&router, 12).await;
    // d0's records (it crashed) are gone with it: what it got is checked
    // through the spans' ids below.
    let prefill_calls = engine_requests(&prefill).await;
    let d1_calls = engine_requests(&d1).await;
    drop(d0);

    // A request without trace context starts a trace of its own, carried to
    // the prefill and the decoder alike.
    let (status, _) = post(
        &router,
        "/v1/completions",
        &json!({"model": "mock", "prompt": "new", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    let started = engine_requests(&prefill).await[1]["traceparent"]
        .as_str()
        .map(trace_parent);
    let (new_trace, _) = started.expect("the prefill got a traceparent");
    assert_ne!(new_trace, trace_id);
    let decoded = engine_requests(&d1).await;
    let (d1_trace, _) = trace_parent(decoded.last().unwrap()["traceparent"].as_str().unwrap());
    assert_eq!(d1_trace, new_trace);

    // SIGTERM: the router stops and exports the spans it still has.
    router.signal("TERM");
    eventually(
        Duration::from_secs(15),
        "the request's spans exported",
        || async {
            let spans = spans.lock().unwrap();
            spans
                .iter()
                .any(|s| s.trace_id == trace_id && s.name == "request")
                && spans
                    .iter()
                    .filter(|s| s.trace_id == trace_id && s.name == "decode")
                    .count()
                    == 2
        },
    )
    .await;
    let spans: Vec<ReceivedSpan> = spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .cloned()
        .collect();
    let named =
        |name: &str| -> Vec<&ReceivedSpan> { spans.iter().filter(|s| s.name == name).collect() };
    let request = named("request");
    assert_eq!(request.len(), 1, "{spans:#?}");
    let request = request[0];
    assert_eq!(
        request.parent_span_id, client_span,
        "the request continues the client's span"
    );
    assert_eq!(request.trace_state, "vendor=opaque");
    let prefill_spans = named("prefill");
    assert_eq!(prefill_spans.len(), 1, "{spans:#?}");
    assert_eq!(prefill_spans[0].parent_span_id, request.span_id);
    let resume = named("resume");
    assert_eq!(resume.len(), 1, "{spans:#?}");
    assert_eq!(resume[0].attribute("cause"), Some("reset"));
    assert_eq!(resume[0].attribute("from"), Some("d0"));
    let decode = named("decode");
    let first = decode
        .iter()
        .find(|s| s.attribute("decoder") == Some("d0"))
        .expect("d0's attempt");
    let second = decode
        .iter()
        .find(|s| s.attribute("decoder") == Some("d1"))
        .expect("d1's attempt");
    assert_eq!(first.parent_span_id, request.span_id);
    assert_eq!(second.parent_span_id, resume[0].span_id);

    // Each engine call carried the client's trace, from its own span.
    let (prefill_trace, prefill_parent) = trace_parent(
        prefill_calls[0]["traceparent"]
            .as_str()
            .expect("prefill traceparent"),
    );
    assert_eq!(prefill_trace, trace_id);
    assert_eq!(prefill_parent, prefill_spans[0].span_id);
    assert_eq!(prefill_calls[0]["tracestate"], "vendor=opaque");
    let (d1_trace, d1_parent) = trace_parent(
        d1_calls[0]["traceparent"]
            .as_str()
            .expect("decoder traceparent"),
    );
    assert_eq!(d1_trace, trace_id);
    assert_eq!(d1_parent, second.span_id);
}

/// Without an exporter the router builds no span data, only the spans' ids:
/// the engines still get the client's trace (each call from a span of its
/// own) and a request without trace context still has one trace for its
/// prefill and its decode.
#[tokio::test(flavor = "multi_thread")]
async fn without_an_exporter_the_engines_still_get_the_trace() {
    let (router, [prefill, decoder]) = pd_cluster(&[], [("prefill", &[]), ("decode", &[])]).await;
    let (trace_id, client_span) = (TRACE_ID, CLIENT_SPAN);
    traced_stream(&router, 4).await;
    let traced = |call: &Value| trace_parent(call["traceparent"].as_str().expect("a traceparent"));
    let prefilled = engine_requests(&prefill).await;
    let decoded = engine_requests(&decoder).await;
    let (p_trace, p_parent) = traced(&prefilled[0]);
    let (d_trace, d_parent) = traced(&decoded[0]);
    assert_eq!((p_trace.as_str(), d_trace.as_str()), (trace_id, trace_id));
    assert_eq!(prefilled[0]["tracestate"], "vendor=opaque");
    assert_eq!(decoded[0]["tracestate"], "vendor=opaque");
    assert_ne!(p_parent, client_span, "the router's own span");
    assert_ne!(p_parent, d_parent, "one span per call");

    let body = json!({"model": "mock", "prompt": "new", "max_tokens": 2});
    let (status, _) = post(&router, "/v1/completions", &body).await;
    assert_eq!(status, 200);
    let (p_trace, _) = traced(&engine_requests(&prefill).await[1]);
    let (d_trace, _) = traced(&engine_requests(&decoder).await[1]);
    assert_eq!(p_trace, d_trace);
    assert_ne!(p_trace, trace_id);
}

/// Model names no engine serves are refused before they become a label: a
/// client sending made-up names must not grow the metric series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_model_names_do_not_become_metric_series() {
    let (router, [_prefill, _decoder]) = pd_cluster(&[], [("prefill", &[]), ("decode", &[])]).await;
    for i in 0..20 {
        let body = json!({"model": format!("made-up-{i}"), "prompt": "x", "max_tokens": 2});
        let (status, _) = post(&router, "/v1/completions", &body).await;
        assert_eq!(status, 404);
    }
    let body = json!({"model": "mock", "prompt": "x", "max_tokens": 2});
    assert_eq!(post(&router, "/v1/completions", &body).await.0, 200);
    let text = metrics_text(&router).await;
    assert!(text.contains("model=\"mock\""), "{text}");
    assert!(!text.contains("made-up-"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sequential_streams_reuse_the_connection_to_their_decoder() {
    let (router, [_prefill, decoder]) = pd_cluster(&[], [("prefill", &[]), ("decode", &[])]).await;
    let body = json!({"model": "mock", "prompt": "again", "max_tokens": 8, "stream": true});
    for _ in 0..20 {
        let chunks = stream(&router, "/v1/completions", &body).await;
        assert_eq!(chunks.last(), Some(&json!("[DONE]")));
        assert!(!streamed_text(&chunks).is_empty());
    }
    // Each stream ended with [DONE] and its response read to the end, so its
    // connection went back to the pool: one connection (a few, should a
    // health probe take one meanwhile) serves all twenty.
    let text = metrics_text(&router).await;
    let authority = decoder.url.trim_start_matches("http://");
    let opened = metric(
        &text,
        "connex_engine_connections_opened_total",
        &[&format!("engine=\"{authority}\"")],
    );
    assert!(
        (1.0..=3.0).contains(&opened),
        "{opened} connections:\n{text}"
    );
}
