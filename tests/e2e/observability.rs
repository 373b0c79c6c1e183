//! End-to-end observability: a real router's logs (JSON and text), read from
//! its stderr as an operator's log pipeline would, with a real prefill and
//! decoders as processes on loopback.

// Tests fail loudly on anything unexpected; that is what unwrap is for here.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
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
