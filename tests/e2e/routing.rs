//! End-to-end routing: a real router and real mock-engine processes on
//! loopback, checked from what a client sees and what each engine received.

use crate::common::*;
use connex_mock_engine::model;
use serde_json::{json, Value};
use std::time::Duration;

const PROMPT: &str = "The quick brown fox";

/// A router with one prefill and one decode engine, all ready.
async fn cluster(router_flags: &[&str]) -> (Proc, Proc, Proc) {
    let (router, [prefill, decode]) =
        pd_cluster(router_flags, [("prefill", &[]), ("decode", &[])]).await;
    (router, prefill, decode)
}

fn chat_prompt_ids(messages: &Value) -> Vec<u32> {
    model::tokenize(&model::apply_chat_template(messages).expect("valid messages"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_match_the_model_stream_and_non_stream() {
    let (router, _prefill, _decode) = cluster(&[]).await;
    let expected = model::generate(&model::tokenize(PROMPT), 12);

    let (status, reply) = post(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":PROMPT,"max_tokens":12,"return_token_ids":true}),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(ids(&reply["choices"][0]["token_ids"]), expected);
    assert_eq!(
        reply["choices"][0]["text"],
        model::detokenize(&expected).as_str()
    );
    assert_eq!(
        reply["usage"]["prompt_tokens"],
        model::tokenize(PROMPT).len()
    );
    assert_eq!(reply["usage"]["completion_tokens"], 12);
    assert!(
        reply["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cmpl-")),
        "{reply}"
    );

    let chunks = stream(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":PROMPT,"max_tokens":12,"stream":true,"return_token_ids":true,
                "stream_options":{"include_usage":true}}),
    )
    .await;
    assert_eq!(chunks.last(), Some(&Value::String("[DONE]".into())));
    assert_eq!(streamed_token_ids(&chunks), expected);
    let text: String = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/text").and_then(Value::as_str))
        .collect();
    assert_eq!(text, model::detokenize(&expected));
    let usage = chunks
        .iter()
        .find(|c| c["usage"].is_object())
        .expect("usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    // One id for the whole stream.
    let first_id = chunks[0]["id"].clone();
    assert!(chunks
        .iter()
        .filter(|c| c.is_object())
        .all(|c| c["id"] == first_id));

    // Without return_token_ids the client sees no token ids (vLLM's default).
    let (_, plain) = post(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":PROMPT,"max_tokens":3}),
    )
    .await;
    assert!(
        plain["choices"][0]
            .get("token_ids")
            .is_none_or(Value::is_null),
        "{plain}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_matches_the_model_stream_and_non_stream() {
    let (router, _prefill, _decode) = cluster(&[]).await;
    let messages =
        json!([{"role":"system","content":"be brief"},{"role":"user","content":"hello there"}]);
    let expected = model::generate(&chat_prompt_ids(&messages), 9);

    let (status, reply) = post(
        &router,
        "/v1/chat/completions",
        &json!({"model":"mock","messages":messages,"max_tokens":9,"return_token_ids":true}),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "chat.completion");
    assert_eq!(ids(&reply["choices"][0]["token_ids"]), expected);
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        model::detokenize(&expected).as_str()
    );
    assert_eq!(reply["usage"]["completion_tokens"], 9);

    let chunks = stream(
        &router,
        "/v1/chat/completions",
        &json!({"model":"mock","messages":messages,"max_completion_tokens":9,"stream":true,"return_token_ids":true,
                "stream_options":{"include_usage":true}}),
    )
    .await;
    assert_eq!(streamed_token_ids(&chunks), expected);
    let content: String = chunks
        .iter()
        .filter_map(|c| {
            c.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(content, model::detokenize(&expected));
    assert!(chunks
        .iter()
        .filter(|c| c.is_object())
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks.last(), Some(&Value::String("[DONE]".into())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_then_decode_follow_the_vllm_protocol() {
    let (router, prefill, decode) = cluster(&[]).await;
    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .header("x-request-id", "client-chosen-42")
        .json(&json!({"model":"mock","prompt":PROMPT,"max_tokens":5}))
        .send()
        .await
        .expect("post");
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-request-id"], "client-chosen-42");

    let prefills = engine_requests(&prefill).await;
    let decodes = engine_requests(&decode).await;
    assert_eq!((prefills.len(), decodes.len()), (1, 1));
    let (p, d) = (&prefills[0], &decodes[0]);
    assert_eq!(p["body"]["max_tokens"], 1);
    assert_eq!(p["body"]["stream"], false);
    assert_eq!(p["body"]["kv_transfer_params"]["do_remote_decode"], true);
    // Engines see the client's id made unique to this request (vLLM keys its
    // requests by it), the same at prefill and decoder.
    let engine_id = p["request_id"].as_str().unwrap().to_string();
    assert!(engine_id.starts_with("client-chosen-42-"), "{engine_id}");
    assert_eq!(d["request_id"], engine_id.as_str());
    assert_eq!(d["body"]["max_tokens"], 5);
    // The decoder got exactly what the prefill returned: recompute it.
    let kv = &d["body"]["kv_transfer_params"];
    assert_eq!(kv["do_remote_prefill"], true);
    assert_eq!(kv["remote_num_tokens"], model::tokenize(PROMPT).len());
    let stats = engine_stats(&prefill).await;
    assert_eq!(kv["remote_engine_id"], stats["engine_id"]);
    // The decoder reused the prefill's KV: no prompt token computed again.
    assert_eq!(d["computed_prompt_tokens"], 0);
    assert_eq!(d["outcome"], "completed");

    // Without a client id the router generates one and passes the same to both.
    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .json(&json!({"model":"mock","prompt":"x","max_tokens":1}))
        .send()
        .await
        .unwrap();
    let generated = response.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(!generated.is_empty());
    let engine_id = engine_requests(&prefill).await[1]["request_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        engine_id.starts_with(&format!("{generated}-")),
        "{engine_id}"
    );
    assert_eq!(
        engine_requests(&decode).await[1]["request_id"],
        engine_id.as_str()
    );
}

/// Two clients that send one `X-Request-Id` (or one that reuses its own)
/// never give an engine two requests of one id: vLLM keys its request state
/// by it. Each client still gets its own id back. Before, the id went to the
/// engines as the client sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_sharing_a_request_id_do_not_share_it_at_the_engine() {
    let (router, prefill, decode) = cluster(&[]).await;
    for _ in 0..2 {
        let response = client()
            .post(format!("{}/v1/completions", router.url))
            .header("x-request-id", "same-id")
            .json(&json!({"model":"mock","prompt":PROMPT,"max_tokens":2}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-request-id"], "same-id");
    }
    for engine in [&prefill, &decode] {
        let ids: Vec<String> = engine_requests(engine)
            .await
            .iter()
            .map(|r| r["request_id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ids.len(), 2);
        assert_ne!(ids[0], ids[1], "one id for two requests: {ids:?}");
        assert!(ids.iter().all(|id| id.starts_with("same-id-")), "{ids:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_decoders_evenly() {
    let (router, [_prefill, a, b]) = pd_cluster(
        &["--decode-policy", "round_robin"],
        [("prefill", &[]), ("decode", &[]), ("decode", &[])],
    )
    .await;
    for i in 0..10 {
        let (status, _) = post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":format!("p{i}"),"max_tokens":2}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        (
            engine_requests(&a).await.len(),
            engine_requests(&b).await.len()
        ),
        (5, 5)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_routed_only_to_instances_serving_them() {
    let (router, [_p, beta]) = pd_cluster(
        &[],
        [
            ("both", &["--model", "alpha"]),
            ("both", &["--model", "beta"]),
        ],
    )
    .await;
    let models: Value = client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut names: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    names.sort();
    assert_eq!(names, ["alpha", "beta"]);
    for _ in 0..4 {
        let (status, _) = post(
            &router,
            "/v1/completions",
            &json!({"model":"beta","prompt":"x","max_tokens":1}),
        )
        .await;
        assert_eq!(status, 200);
    }
    // A "both" engine serves its model's prefill and decode: 4 requests, 8 records.
    assert_eq!(engine_requests(&beta).await.len(), 8);
    let (status, body) = post(
        &router,
        "/v1/completions",
        &json!({"model":"gamma","prompt":"x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drained_decoder_finishes_in_flight_and_gets_no_new_requests() {
    let (router, [_prefill, slow]) = pd_cluster(
        &["--decode-policy", "round_robin"],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "20000"]),
        ],
    )
    .await;

    // Start a 40-token (~0.8 s) stream on the only decoder, then drain it.
    let url = format!("{}/v1/completions", router.url);
    let in_flight = tokio::spawn(async move {
        let body = json!({"model":"mock","prompt":PROMPT,"max_tokens":40,"stream":true,"return_token_ids":true});
        client()
            .post(url)
            .json(&body)
            .send()
            .await
            .expect("post")
            .text()
            .await
            .expect("body")
    });
    // The stream is on the slow decoder once the journal says so.
    eventually(
        Duration::from_secs(10),
        "the stream reached its decoder",
        || async {
            journal(&router, false)
                .await
                .iter()
                .any(|e| e["phase"] == "decode" && e["decoder"].is_string())
        },
    )
    .await;
    let other = engine(Some(&router), "decode", &[]);
    wait_ready(&router, 3).await;
    let slow_id = instance_id(&router, &slow).await;
    let drained = client()
        .post(format!(
            "{}/admin/instances/{slow_id}/drain",
            router.internal
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(drained.status(), 200);

    for i in 0..4 {
        let (status, _) = post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":format!("n{i}"),"max_tokens":2}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        engine_requests(&slow).await.len(),
        1,
        "a drained decoder got new requests"
    );
    assert_eq!(engine_requests(&other).await.len(), 4);

    let text = in_flight.await.unwrap();
    let mut parser = connex_router::SseParser::default();
    let chunks: Vec<Value> = parser
        .push(bytes::Bytes::copy_from_slice(text.as_bytes()))
        .iter()
        .filter_map(|d| serde_json::from_slice(d).ok())
        .collect();
    assert_eq!(
        streamed_token_ids(&chunks),
        model::generate(&model::tokenize(PROMPT), 40)
    );
    assert!(text.trim_end().ends_with("data: [DONE]"));
    assert_eq!(engine_requests(&slow).await[0]["outcome"], "completed");

    // Activate brings it back.
    let activated = client()
        .post(format!(
            "{}/admin/instances/{slow_id}/activate",
            router.internal
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(activated.status(), 200);
    assert!(instances(&router)
        .await
        .iter()
        .any(|i| i["id"] == slow_id.as_str() && i["state"] == "ready"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_whose_heartbeats_stop_is_skipped() {
    let router = router(&["--heartbeat-ttl-s", "1"]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let live = engine(Some(&router), "decode", &[]);
    // A real engine that never heartbeats: registered once by hand.
    let silent = engine(None, "decode", &[]);
    let reply = client()
        .post(format!("{}/v1/instances", router.internal))
        .json(&json!({"role":"decode","url":silent.url,"model":"mock"}))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 201);
    wait_ready(&router, 3).await;
    // The silent engine is dead once its TTL ran out.
    eventually(
        Duration::from_secs(10),
        "the silent engine's TTL ran out",
        || async {
            instances(&router)
                .await
                .iter()
                .any(|i| i["url"] == silent.url.as_str() && i["state"] == "dead")
        },
    )
    .await;
    for i in 0..6 {
        let (status, _) = post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":format!("h{i}"),"max_tokens":1}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        engine_requests(&silent).await.len(),
        0,
        "an instance with a lapsed lease got traffic"
    );
    assert_eq!(engine_requests(&live).await.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_requires_the_bearer_token() {
    let router = router(&[]);
    for (method, path) in [
        ("GET", "/admin/instances"),
        ("POST", "/admin/instances"),
        ("POST", "/admin/instances/x/drain"),
        ("POST", "/admin/instances/x/activate"),
        ("DELETE", "/admin/instances/x"),
        ("GET", "/admin/requests"),
    ] {
        for token in [None, Some("wrong")] {
            let mut request = client().request(
                method.parse().unwrap(),
                format!("{}{path}", router.internal),
            );
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 401, "{method} {path} with {token:?}");
            let body: Value = response.json().await.unwrap();
            assert!(body["error"]["message"].is_string(), "{body}");
        }
    }
    // With the token: add, list, remove.
    let added = client()
        .post(format!("{}/admin/instances", router.internal))
        .bearer_auth(ADMIN_TOKEN)
        .json(&json!({"role":"decode","url":"http://127.0.0.1:9","model":"mock"}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), 201);
    let id = added.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(instances(&router).await.len(), 1);
    let removed = client()
        .delete(format!("{}/admin/instances/{id}", router.internal))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), 204);
    assert!(instances(&router).await.is_empty());
    let missing = client()
        .post(format!("{}/admin/instances/{id}/drain", router.internal))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_an_openai_error_with_the_right_status() {
    let (router, prefill, decode) = cluster(&["--max-body-bytes", "4096"]).await;
    let raw = |body: &'static str| {
        let url = format!("{}/v1/completions", router.url);
        async move {
            let r = client()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (
                r.status().as_u16(),
                r.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let mut cases: Vec<(&str, u16, Value)> = Vec::new();
    let (s, b) = raw("{not json").await;
    cases.push(("invalid JSON", s, b));
    let (s, b) = raw("[1,2]").await;
    cases.push(("body not an object", s, b));
    for (what, path, body, want) in [
        (
            "missing model",
            "/v1/completions",
            json!({"prompt":"x"}),
            400,
        ),
        (
            "missing prompt",
            "/v1/completions",
            json!({"model":"mock"}),
            400,
        ),
        (
            "missing messages",
            "/v1/chat/completions",
            json!({"model":"mock"}),
            400,
        ),
        (
            "model not a string",
            "/v1/completions",
            json!({"model":5,"prompt":"x"}),
            400,
        ),
        (
            "prompt wrong type",
            "/v1/completions",
            json!({"model":"mock","prompt":{"a":1}}),
            400,
        ),
        (
            "empty prompt",
            "/v1/completions",
            json!({"model":"mock","prompt":""}),
            400,
        ),
        (
            "empty prompt in a list",
            "/v1/completions",
            json!({"model":"mock","prompt":[""]}),
            400,
        ),
        (
            "prompt token ids not integers",
            "/v1/completions",
            json!({"model":"mock","prompt":[1, 2.5, -3]}),
            400,
        ),
        (
            "messages not a list",
            "/v1/chat/completions",
            json!({"model":"mock","messages":"hi"}),
            400,
        ),
        (
            "stream not a bool",
            "/v1/completions",
            json!({"model":"mock","prompt":"x","stream":"yes"}),
            400,
        ),
        (
            "max_tokens negative",
            "/v1/completions",
            json!({"model":"mock","prompt":"x","max_tokens":-1}),
            400,
        ),
        (
            "max_tokens absurd",
            "/v1/completions",
            json!({"model":"mock","prompt":"x","max_tokens":1u64 << 40}),
            400,
        ),
        (
            "max_tokens a string",
            "/v1/completions",
            json!({"model":"mock","prompt":"x","max_tokens":"5"}),
            400,
        ),
        (
            "unknown model",
            "/v1/chat/completions",
            json!({"model":"nope","messages":[{"role":"user","content":"x"}]}),
            404,
        ),
        (
            "body over the limit",
            "/v1/completions",
            json!({"model":"mock","prompt":"x".repeat(5000)}),
            413,
        ),
    ] {
        let (status, reply) = post(&router, path, &body).await;
        assert_eq!(status, want, "{what}: {reply}");
        cases.push((what, status, reply));
    }
    for (what, status, body) in &cases {
        assert!((400..500).contains(status), "{what}: {status}");
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {body}"
        );
        assert!(error["type"].is_string(), "{what}: {body}");
    }
    assert_eq!(cases[0].1, 400);
    // None of it reached an engine, and the router still serves.
    assert!(engine_requests(&prefill).await.is_empty());
    assert!(engine_requests(&decode).await.is_empty());
    let (status, _) = post(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":"ok","max_tokens":1}),
    )
    .await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_the_requests_made() {
    let (router, _prefill, decode) = cluster(&[]).await;
    for _ in 0..3 {
        post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":"m","max_tokens":2}),
        )
        .await;
    }
    stream(&router, "/v1/chat/completions", &json!({"model":"mock","messages":[{"role":"user","content":"m"}],"stream":true,"max_tokens":2})).await;
    post(&router, "/v1/completions", &json!({"model":"mock"})).await;
    let text = client()
        .get(format!("{}/metrics", router.internal))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(
            &text,
            "connex_requests_total",
            &["route=\"/v1/completions\"", "status=\"200\""]
        ),
        3.0,
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "connex_requests_total",
            &["route=\"/v1/chat/completions\"", "status=\"200\""]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "connex_requests_total",
            &["route=\"/v1/completions\"", "status=\"400\""]
        ),
        1.0
    );
    assert_eq!(
        metric(&text, "connex_ttft_seconds_count", &[]),
        4.0,
        "{text}"
    );
    let decode_id = instance_id(&router, &decode).await;
    assert_eq!(
        metric(
            &text,
            "connex_upstream_requests_total",
            &[&format!("instance=\"{decode_id}\"")]
        ),
        4.0,
        "{text}"
    );
    assert!(text.contains("connex_request_duration_seconds"));
    assert!(text.contains("connex_instance_inflight"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_prefill_is_retried_once_on_another_instance() {
    let (router, [broken, good, _decode]) = pd_cluster(
        &["--prefill-policy", "round_robin"],
        [
            ("prefill", &["--fail-status", "500"]),
            ("prefill", &[]),
            ("decode", &[]),
        ],
    )
    .await;
    for i in 0..4 {
        let (status, reply) = post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":format!("r{i}"),"max_tokens":2}),
        )
        .await;
        assert_eq!(status, 200, "{reply}");
    }
    assert_eq!(engine_requests(&good).await.len(), 4);
    assert!(!engine_requests(&broken).await.is_empty());
    let text = client()
        .get(format!("{}/metrics", router.internal))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metric(&text, "connex_prefill_retries_total", &[]) >= 1.0,
        "{text}"
    );

    // With only broken prefills the client gets an error, not a hang.
    let (router2, [_b, _d]) = pd_cluster(
        &[],
        [("prefill", &["--fail-status", "500"]), ("decode", &[])],
    )
    .await;
    let (status, reply) = post(
        &router2,
        "/v1/completions",
        &json!({"model":"mock","prompt":"x","max_tokens":2}),
    )
    .await;
    assert!(status >= 500, "{status} {reply}");
    assert!(reply["error"]["message"].is_string());
}

#[test]
fn demo_serves_every_request_through_prefill_and_both_decoders() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_connex-router"))
        .args(["demo", "--max-tokens", "5"])
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("completion") || l.starts_with("chat"))
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for row in &rows {
        let fields: Vec<&str> = row.split_whitespace().collect();
        assert!(
            fields.contains(&"5"),
            "each request got its 5 tokens: {row}"
        );
    }
    assert!(
        rows.iter().any(|r| r.contains("decode-0")) && rows.iter().any(|r| r.contains("decode-1")),
        "{stdout}"
    );
    // Part two: a decoder killed mid-stream, the stream completed on the other.
    let resumed = stdout
        .lines()
        .find(|l| l.contains("the router resumed the request on"))
        .unwrap_or_else(|| panic!("no resume in the demo: {stdout}"));
    assert!(
        resumed.contains("decode-0 died") && resumed.ends_with("decode-1")
            || resumed.contains("decode-1 died") && resumed.ends_with("decode-0"),
        "{resumed}"
    );
    assert!(
        stdout.contains("identical to an uninterrupted run"),
        "{stdout}"
    );
    assert!(stdout.contains("gap at the failure"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_choices_each_get_their_tokens_and_usage_counts_all() {
    let (router, _prefill, _decode) = cluster(&[]).await;
    let expected = model::generate(&model::tokenize(PROMPT), 5);
    let (status, reply) = post(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":PROMPT,"max_tokens":5,"n":3,"return_token_ids":true}),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    let choices = reply["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        assert_eq!(ids(&choice["token_ids"]), expected);
    }
    assert_eq!(reply["usage"]["completion_tokens"], 15);

    let chunks = stream(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":PROMPT,"max_tokens":5,"n":2,"stream":true,
                "stream_options":{"include_usage":true}}),
    )
    .await;
    assert_eq!(chunks.last(), Some(&json!("[DONE]")));
    for index in 0..2 {
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"].as_array())
            .flatten()
            .filter(|c| c["index"] == index)
            .filter_map(|c| c["text"].as_str())
            .collect();
        assert_eq!(text, model::detokenize(&expected), "choice {index}");
    }
    let usage = chunks.iter().find(|c| c["usage"].is_object()).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_naming_a_foreign_holder_is_not_used() {
    // p1 answers with a `remote_ctrl` that is not the control address it
    // registered: a decoder would pull (and the router would send its hold
    // calls) to a holder of the prefill's choosing.
    let (router, [_honest, liar, decoder]) = pd_cluster(
        &["--prefill-policy", "round_robin"],
        [
            ("prefill", &["--id", "p0"]),
            (
                "prefill",
                &["--id", "p1", "--answer-remote-ctrl", "127.0.0.1:1"],
            ),
            ("decode", &[]),
        ],
    )
    .await;
    for i in 0..4 {
        let (status, reply) = post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":format!("foreign {i}"),"max_tokens":2}),
        )
        .await;
        assert_eq!(status, 200, "{reply}");
    }
    assert!(
        !engine_requests(&liar).await.is_empty(),
        "the lying prefill was tried"
    );
    for request in engine_requests(&decoder).await {
        assert_ne!(
            request["body"]["kv_transfer_params"]["remote_ctrl"], "127.0.0.1:1",
            "a decoder was sent the foreign holder"
        );
    }
    let text = metrics_text(&router).await;
    assert!(
        metric(
            &text,
            "connex_upstream_errors_total",
            &["kind=\"foreign_ctrl\"", "instance=\"p1\""]
        ) >= 1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_from_an_engine_are_not_followed() {
    // Where a redirect would send the router: an engine that must see nothing.
    let elsewhere = engine(None, "decode", &[]);
    let target = format!("{}/v1/completions", elsewhere.url);
    let (router, [_prefill, _redirecting, _d1]) =
        failover_cluster(&[], &["--redirect-to", &target], &[]).await;
    let (status, reply) = post(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":"stay here","max_tokens":3}),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert!(
        engine_requests(&elsewhere).await.is_empty(),
        "the router followed a redirect"
    );
}
