//! Faithful OpenAI behaviour (issue 15), on real processes: what a client gets
//! through the router is what the engine alone would have answered.
//!
//! The router streams from its decoder even for a non-stream client and
//! assembles the answer; the reference is a mock engine of the same model
//! answering the same request unstreamed, itself (the mock builds its
//! non-stream answer independently of its stream, as vLLM does).

use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// A router with one prefill and one decode engine, and a lone engine of the
/// same model as the reference.
async fn cluster() -> (Proc, Proc, Proc, Proc) {
    let (router, [prefill, decode]) = pd_cluster(&[], [("prefill", &[]), ("decode", &[])]).await;
    let reference = engine(None, "both", &[]);
    (router, prefill, decode, reference)
}

/// An answer without what differs between any two answers (id, created).
fn comparable(mut answer: Value) -> Value {
    if let Some(map) = answer.as_object_mut() {
        map.remove("id");
        map.remove("created");
    }
    answer
}

/// Posts `body` to the router and to the lone engine; both must answer 200
/// with equal bodies.
async fn assert_same_answer(router: &Proc, reference: &Proc, path: &str, body: Value) {
    let (status, through_router) = post(router, path, &body).await;
    assert_eq!(status, 200, "{body}: {through_router}");
    let (status, alone) = post(reference, path, &body).await;
    assert_eq!(status, 200, "{body}: {alone}");
    assert_eq!(
        comparable(through_router),
        comparable(alone),
        "router vs engine for {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_completions_equal_the_engines_own_answer() {
    let (router, _prefill, _decode, reference) = cluster().await;
    let base = json!({"model":"mock","prompt":"The quick brown fox","max_tokens":9});
    let variants = [
        json!({}),
        json!({"logprobs": 3}),
        json!({"logprobs": 0, "echo": true}),
        json!({"echo": true}),
        json!({"n": 2, "logprobs": 2}),
        json!({"return_token_ids": true, "logprobs": 1}),
        json!({"response_format": {"type": "json_object"}}),
    ];
    for variant in variants {
        let mut body = base.clone();
        body.as_object_mut()
            .unwrap()
            .extend(variant.as_object().unwrap().clone());
        assert_same_answer(&router, &reference, "/v1/completions", body).await;
    }
    // A streaming client of `echo` gets the prompt's text first, as from the
    // engine (which echoes it only when not asked for token ids, as vLLM).
    let body = json!({"model":"mock","prompt":"The quick brown fox","max_tokens":4,
        "echo":true,"stream":true});
    let through_router = streamed_text(&stream(&router, "/v1/completions", &body).await);
    assert!(
        through_router.starts_with("The quick brown fox"),
        "{through_router}"
    );
    let alone = streamed_text(&stream(&reference, "/v1/completions", &body).await);
    assert_eq!(through_router, alone);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_chat_equals_the_engines_own_answer_tools_reasoning_and_logprobs() {
    let (router, _prefill, _decode, reference) = cluster().await;
    let tool = |name: &str| {
        json!({"type":"function","function":{"name":name,"parameters":{"type":"object",
            "properties":{"words":{"type":"string"}}}}})
    };
    let base = json!({"model":"mock","messages":[{"role":"user","content":"Say a few words"}],
        "max_completion_tokens":10});
    let variants = [
        json!({}),
        json!({"logprobs": true, "top_logprobs": 2}),
        json!({"logprobs": true}),
        json!({"n": 3}),
        json!({"tools": [tool("lookup"), tool("store")], "tool_choice": "auto"}),
        json!({"tools": [tool("lookup")], "n": 2, "logprobs": true, "top_logprobs": 1}),
        json!({"reasoning_effort": "low"}),
        json!({"reasoning_effort": "low", "tools": [tool("lookup"), tool("store")]}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"return_token_ids": true}),
    ];
    for variant in variants {
        let mut body = base.clone();
        body.as_object_mut()
            .unwrap()
            .extend(variant.as_object().unwrap().clone());
        assert_same_answer(&router, &reference, "/v1/chat/completions", body).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_tool_calls_and_logprobs_reach_the_client_and_assemble_to_the_answer() {
    let (router, _prefill, _decode, reference) = cluster().await;
    let body = json!({"model":"mock","messages":[{"role":"user","content":"call"}],
        "max_completion_tokens":6,"logprobs":true,"top_logprobs":1,
        "tools":[{"type":"function","function":{"name":"lookup","parameters":{}}}]});
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&router, "/v1/chat/completions", &streamed).await;
    let arguments: String = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/delta/tool_calls/0/function/arguments"))
        .filter_map(Value::as_str)
        .collect();
    let logprobs = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/logprobs/content"))
        .filter_map(Value::as_array)
        .map(Vec::len)
        .sum::<usize>();
    let (status, alone) = post(&reference, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    assert_eq!(
        alone["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        arguments.as_str()
    );
    assert_eq!(logprobs, 6, "one logprobs entry per token");
}

/// One request of every passed-through route.
fn passthrough_cases() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/v1/embeddings",
            json!({"model":"mock","input":["The quick brown fox","jumps"]}),
        ),
        ("/tokenize", json!({"model":"mock","prompt":"hello"})),
        (
            "/tokenize",
            json!({"model":"mock","messages":[{"role":"user","content":"hi"}]}),
        ),
        ("/detokenize", json!({"model":"mock","tokens":[104, 105]})),
        ("/pooling", json!({"model":"mock","input":"hello"})),
        (
            "/score",
            json!({"model":"mock","text_1":"fox","text_2":["a quick fox","a lazy dog"]}),
        ),
        (
            "/v1/score",
            json!({"model":"mock","text_1":["a","b"],"text_2":["c","d"]}),
        ),
        (
            "/rerank",
            json!({"model":"mock","query":"fox","documents":["a","b","c"],"top_n":2}),
        ),
        (
            "/v1/rerank",
            json!({"model":"mock","query":"fox","documents":["a quick fox","a lazy dog"]}),
        ),
    ]
}

/// POSTs `body` to `base` + `path`: status and raw answer.
async fn post_raw(base: &str, path: &str, body: &Value) -> (u16, Vec<u8>) {
    let response = client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.bytes().await.unwrap().to_vec())
}

/// The records of `path` requests on `engines`.
async fn served(engines: &[&Proc], path: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for engine in engines {
        out.extend(
            engine_requests(engine)
                .await
                .into_iter()
                .filter(|r| r["path"] == path),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rest_of_the_openai_surface_passes_through_untouched() {
    let (router, prefill, decode, reference) = cluster().await;
    for (at, (path, body)) in passthrough_cases().into_iter().enumerate() {
        let (status, through_router) = post_raw(&router.url, path, &body).await;
        assert_eq!(
            status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&through_router)
        );
        let (_, alone) = post_raw(&reference.url, path, &body).await;
        assert_eq!(through_router, alone, "{path}: the engine's bytes");
        // One instance of the model got the client's body as it was.
        let records = served(&[&prefill, &decode], path).await;
        let last = records
            .last()
            .unwrap_or_else(|| panic!("{path}: no engine record"));
        assert_eq!(last["body"], body, "{path} (case {at})");
    }
    // No model named: the router's one model is meant (as vLLM's default).
    let (status, answer) = post_raw(&router.url, "/tokenize", &json!({"prompt":"hi"})).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));

    // OpenAI-style errors: unknown model, bad JSON, an engine's own refusal.
    let (status, reply) = post(
        &router,
        "/v1/embeddings",
        &json!({"model":"nope","input":"x"}),
    )
    .await;
    assert_eq!(status, 404, "{reply}");
    assert!(reply["error"]["message"].as_str().unwrap().contains("nope"));
    let response = client()
        .post(format!("{}/rerank", router.url))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let reply: Value = response.json().await.unwrap();
    assert_eq!(reply["error"]["type"], "invalid_request_error", "{reply}");
    let (status, reply) = post(
        &router,
        "/detokenize",
        &json!({"model":"mock","tokens":"x"}),
    )
    .await;
    assert_eq!(status, 400, "{reply}");
    assert!(reply["error"]["message"]
        .as_str()
        .unwrap()
        .contains("tokens"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_goes_to_the_least_loaded_instance_of_any_role() {
    // A slow decoder: a stream keeps it busy for seconds; and `solo`, a model
    // served by one decode-role instance only.
    let (router, [prefill, decode, solo]) = pd_cluster(
        &[],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "20000"]),
            ("decode", &["--model", "solo"]),
        ],
    )
    .await;
    let (status, _) = post_raw(
        &router.url,
        "/tokenize",
        &json!({"model":"solo","prompt":"x"}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        served(&[&solo], "/tokenize").await.len(),
        1,
        "any role serves"
    );

    // While the decoder streams, every passthrough goes to the idle prefill.
    let busy = client()
        .post(format!("{}/v1/completions", router.url))
        .json(&json!({"model":"mock","prompt":"busy","max_tokens":200,"stream":true}))
        .send()
        .await
        .unwrap();
    assert_eq!(busy.status(), 200);
    for _ in 0..4 {
        let (status, _) = post_raw(
            &router.url,
            "/v1/embeddings",
            &json!({"model":"mock","input":"x"}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(served(&[&prefill], "/v1/embeddings").await.len(), 4);
    assert!(served(&[&decode], "/v1/embeddings").await.is_empty());
    drop(busy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_list_what_the_engines_report() {
    let (router, _prefill, _decode, _reference) = cluster().await;
    let models: Value = client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let entry = &models["data"][0];
    assert_eq!(entry["id"], "mock");
    assert_eq!(entry["owned_by"], "connex-mock");
    assert_eq!(entry["max_model_len"], 4096);
}

/// How many times `engine` answered `GET /v1/models`.
async fn model_list_calls(engine: &Proc) -> u64 {
    engine_stats(engine).await["model_list_calls"]
        .as_u64()
        .unwrap()
}

async fn models_of(router: &Proc) -> Value {
    client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_polling_the_model_list_does_not_reach_the_engines_each_time() {
    let (router, prefill, decode, _reference) = cluster().await;
    let calls = || async { model_list_calls(&prefill).await + model_list_calls(&decode).await };
    assert_eq!(calls().await, 0);
    // Polled, and by several clients at once: one engine read per model.
    for _ in 0..10 {
        let lists = futures_util::future::join_all((0..5).map(|_| models_of(&router))).await;
        for list in lists {
            assert_eq!(list["data"][0]["owned_by"], "connex-mock", "{list}");
            assert_eq!(list["data"][0]["max_model_len"], 4096, "{list}");
        }
    }
    assert_eq!(calls().await, 1);
    // The entry is refreshed once it is stale (5 s).
    tokio::time::sleep(Duration::from_millis(5200)).await;
    for _ in 0..5 {
        assert_eq!(
            models_of(&router).await["data"][0]["owned_by"],
            "connex-mock"
        );
    }
    assert_eq!(calls().await, 2);
}

/// The admin list entry of the instance at `url`.
async fn listed(router: &Proc, url: &str) -> Option<Value> {
    instances(router)
        .await
        .into_iter()
        .find(|i| i["url"] == url)
}

async fn state_of(router: &Proc, url: &str) -> String {
    listed(router, url)
        .await
        .and_then(|i| i["state"].as_str().map(str::to_string))
        .unwrap_or_else(|| "absent".into())
}

async fn completion_status(router: &Proc) -> u16 {
    let body = json!({"model":"mock","prompt":"static","max_tokens":4});
    post(router, "/v1/completions", &body).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_instances_serve_without_heartbeats_and_sit_out_failed_probes() {
    // Engines without the agent: they never register nor heartbeat.
    let prefill = engine(None, "prefill", &[]);
    let listen = format!("127.0.0.1:{}", free_port());
    let mut decode = engine(None, "decode", &["--listen", &listen]);
    let ctrl = engine_stats(&prefill).await["ctrl"]
        .as_str()
        .unwrap()
        .to_string();
    let prefill_flag = format!("{},{ctrl}", prefill.url);
    let router = router(&[
        "--heartbeat-ttl-s",
        "1",
        "--health-check-interval-ms",
        "100",
        "--health-check-failures",
        "1",
        "--prefill",
        &prefill_flag,
        "--decode",
        &decode.url,
        "--static-model",
        "mock",
    ]);
    wait_ready(&router, 2).await;
    // Several heartbeat TTLs without a heartbeat: still in rotation.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for url in [&prefill.url, &decode.url] {
        let entry = listed(&router, url).await.unwrap();
        assert_eq!(entry["state"], "ready", "{entry}");
        assert_eq!(entry["persistent"], true, "{entry}");
    }
    assert_eq!(completion_status(&router).await, 200);

    // The decoder goes away: out of rotation, still listed.
    decode.kill();
    eventually(
        Duration::from_secs(5),
        "the dead static decoder leaves rotation",
        || async { state_of(&router, &decode.url).await == "dead" },
    )
    .await;
    assert_eq!(completion_status(&router).await, 503);
    // Back on its address: its probes pass and it serves again.
    let decode = engine(None, "decode", &["--listen", &listen]);
    eventually(
        Duration::from_secs(5),
        "the static decoder is back",
        || async { state_of(&router, &decode.url).await == "ready" },
    )
    .await;
    assert_eq!(completion_status(&router).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_instances_without_a_model_flag_are_registered_under_the_model_they_serve() {
    // Engines without the agent, serving a model the router is not told of;
    // the decoder is not up yet when the router starts.
    let prefill = engine(None, "prefill", &["--model", "found"]);
    let ctrl = engine_stats(&prefill).await["ctrl"]
        .as_str()
        .unwrap()
        .to_string();
    let prefill_flag = format!("{},{ctrl}", prefill.url);
    let listen = format!("127.0.0.1:{}", free_port());
    let decode_url = format!("http://{listen}");
    let (router, logs) = router_logged(&[
        "--health-check-interval-ms",
        "100",
        "--prefill",
        &prefill_flag,
        "--decode",
        &decode_url,
    ]);
    eventually(
        Duration::from_secs(5),
        "the static prefill is registered under its model",
        || async { listed(&router, &prefill.url).await.is_some() },
    )
    .await;
    let entry = listed(&router, &prefill.url).await.unwrap();
    assert_eq!(entry["model"], "found", "{entry}");
    assert_eq!(entry["persistent"], true, "{entry}");
    assert_eq!(entry["ctrl"], ctrl.as_str(), "{entry}");
    // The decoder is asked again until it answers (and the log says why it waits).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(listed(&router, &decode_url).await.is_none());
    assert!(
        logs.lines()
            .iter()
            .any(|l| l.contains("waiting for its model list") && l.contains(&decode_url)),
        "{:?}",
        logs.lines()
    );
    let _decode = engine(None, "decode", &["--listen", &listen, "--model", "found"]);
    eventually(
        Duration::from_secs(10),
        "the static decoder is registered once it is up",
        || async { state_of(&router, &decode_url).await == "ready" },
    )
    .await;
    assert_eq!(
        listed(&router, &decode_url).await.unwrap()["model"],
        "found"
    );
    let body = json!({"model":"found","prompt":"static","max_tokens":4});
    let (status, answer) = post(&router, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_persistent_registrations_never_expire_and_are_kept_until_removed() {
    let router = router(&["--heartbeat-ttl-s", "1"]);
    let lasting = engine(None, "decode", &[]);
    let passing = engine(None, "decode", &[]);
    for (engine, persistent) in [(&lasting, true), (&passing, false)] {
        let body = json!({"role":"decode","url":engine.url,"model":"mock","persistent":persistent});
        let (status, reply) = admin(
            &router,
            reqwest::Method::POST,
            "/admin/instances",
            Some(&body),
        )
        .await;
        assert_eq!(status, 201, "{reply}");
    }
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(state_of(&router, &lasting.url).await, "ready");
    assert_eq!(state_of(&router, &passing.url).await, "dead");
    // Removed on request.
    let id = listed(&router, &lasting.url).await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, _) = admin(
        &router,
        reqwest::Method::DELETE,
        &format!("/admin/instances/{id}"),
        None,
    )
    .await;
    assert!(status < 300, "{status}");
    assert_eq!(state_of(&router, &lasting.url).await, "absent");
    // Only operators add persistent instances.
    let body = json!({"role":"decode","url":lasting.url,"model":"mock","persistent":true});
    let (status, reply) = post_internal(&router, "/v1/instances", &body, None).await;
    assert_eq!(status, 400, "{reply}");
}

/// A router whose first decoder (`d0`) crashes after `k` tokens, a healthy
/// `d1` to resume on, and a lone engine as the reference.
async fn crashing_cluster(k: u32) -> (Proc, Vec<Proc>, Proc) {
    let crash = k.to_string();
    // Paced, so that each token is on the wire before the process dies.
    let d0 = [
        "--crash-after-tokens",
        &crash,
        "--decode-us-per-token",
        "20000",
    ];
    let (router, engines) = failover_cluster(&[], &d0, &[]).await;
    let reference = engine(None, "both", &[]);
    (router, engines.into(), reference)
}

/// Every field of the chunks' logprobs for choice 0, joined.
fn streamed_logprobs(chunks: &[Value]) -> Value {
    let mut joined = json!({});
    for chunk in chunks {
        let Some(lp) = chunk
            .pointer("/choices/0/logprobs")
            .filter(|l| !l.is_null())
        else {
            continue;
        };
        for (key, value) in lp.as_object().unwrap() {
            let into = joined
                .as_object_mut()
                .unwrap()
                .entry(key.clone())
                .or_insert(json!([]));
            into.as_array_mut()
                .unwrap()
                .extend(value.as_array().unwrap().iter().cloned());
        }
    }
    joined
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_requests_resume_mid_stream_with_the_uninterrupted_logprobs() {
    let completion =
        json!({"model":"mock","prompt":"Resume with logprobs","max_tokens":12,"logprobs":2});
    let chat = json!({"model":"mock","messages":[{"role":"user","content":"Resume"}],
        "max_completion_tokens":12,"logprobs":true,"top_logprobs":2});
    for (path, body, logprobs_at) in [
        ("/v1/completions", completion, "/choices/0/logprobs"),
        ("/v1/chat/completions", chat, "/choices/0/logprobs"),
    ] {
        // Streamed: the decoder crashes after 5 tokens; the client gets every
        // token's logprobs once, as an uninterrupted run gives them.
        let (router, engines, reference) = crashing_cluster(5).await;
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let chunks = stream(&router, path, &streamed).await;
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "{path}: {chunks:?}"
        );
        let (status, alone) = post(&reference, path, &body).await;
        assert_eq!(status, 200);
        assert_eq!(
            streamed_logprobs(&chunks),
            alone.pointer(logprobs_at).unwrap().clone(),
            "{path}: streamed logprobs after a resume"
        );
        // The resume happened: d1 continued after d0's tokens.
        let resumed = engine_requests(&engines[2]).await;
        assert_eq!(resumed.len(), 1, "{path}: {resumed:?}");
        assert_eq!(resumed[0]["path"], "/v1/completions", "{resumed:?}");

        // Not streamed: the whole answer equals the uninterrupted one.
        let (router, _engines, _reference) = crashing_cluster(5).await;
        let (status, through_router) = post(&router, path, &body).await;
        assert_eq!(status, 200, "{through_router}");
        assert_eq!(
            comparable(through_router),
            comparable(alone),
            "{path}: non-stream answer after a resume"
        );
    }
}

/// The last finish of choice 0 in a stream: (finish_reason, stop_reason).
fn streamed_finish(chunks: &[Value]) -> (Value, Value) {
    chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0"))
        .filter(|c| !c["finish_reason"].is_null())
        .map(|c| (c["finish_reason"].clone(), c["stop_reason"].clone()))
        .next_back()
        .unwrap_or((Value::Null, Value::Null))
}

/// Posts `body` to the router: its answer must equal the engine's own
/// (`alone`) but for the `system_fingerprint` an engine sends in its last
/// chunk, which a decoder cut off at a stop string never sends
/// (docs/resume.md).
async fn assert_same_but_the_fingerprint(router: &Proc, path: &str, body: &Value, alone: &Value) {
    let (status, through_router) = post(router, path, body).await;
    assert_eq!(status, 200, "{through_router}");
    let without_fingerprint = |answer: &Value| {
        let mut answer = comparable(answer.clone());
        answer.as_object_mut().unwrap().remove("system_fingerprint");
        answer
    };
    assert_eq!(
        without_fingerprint(&through_router),
        without_fingerprint(alone),
        "{body}"
    );
}

/// A stop string spanning the boundary between generated tokens `at - 1` and
/// `at` of `body`'s answer on `reference`, found first there.
async fn stop_across(reference: &Proc, path: &str, body: &Value, at: usize) -> String {
    let mut plain = body.clone();
    plain["return_token_ids"] = json!(true);
    let (_, answer) = post(reference, path, &plain).await;
    let ids = ids(&answer["choices"][0]["token_ids"]);
    let before = connex_mock_engine::model::token_text(ids[at - 1]);
    let after = connex_mock_engine::model::token_text(ids[at]);
    let stop = format!("{}{}", &before[before.len() - 3..], &after[..3]);
    let text = connex_mock_engine::model::detokenize(&ids);
    let boundary = connex_mock_engine::model::detokenize(&ids[..at]).len();
    assert_eq!(
        text.find(&stop),
        Some(boundary - 3),
        "{stop} first at the boundary"
    );
    stop
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_are_matched_by_the_router_as_the_engine_would() {
    // Paced, so that it is still generating when the stop is found.
    let (router, [_prefill, decode]) = pd_cluster(
        &[],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "5000"]),
        ],
    )
    .await;
    let reference = engine(None, "both", &[]);
    let completion = json!({"model":"mock","prompt":"Stop strings","max_tokens":30});
    let chat = json!({"model":"mock","messages":[{"role":"user","content":"Stop"}],"max_completion_tokens":30});
    for (path, body) in [
        ("/v1/completions", completion),
        ("/v1/chat/completions", chat),
    ] {
        let stop = stop_across(&reference, path, &body, 6).await;
        for include in [false, true] {
            let mut body = body.clone();
            body["stop"] = json!(["never appears", stop]);
            body["include_stop_str_in_output"] = json!(include);
            let (status, alone) = post(&reference, path, &body).await;
            assert_eq!(status, 200, "{alone}");
            assert_eq!(alone["choices"][0]["finish_reason"], "stop");
            assert_same_but_the_fingerprint(&router, path, &body, &alone).await;
            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            let chunks = stream(&router, path, &streamed).await;
            let text = alone["choices"][0]
                .get("text")
                .or_else(|| alone.pointer("/choices/0/message/content"))
                .unwrap();
            assert_eq!(streamed_text(&chunks), text.as_str().unwrap(), "{path}");
            assert_eq!(streamed_finish(&chunks), (json!("stop"), json!(stop)));
        }
    }
    // The decoders never saw `stop`, and were cut off at the stop (asked for
    // 30 tokens, they stopped generating well before).
    let records = engine_requests(&decode).await;
    assert!(records.iter().all(|r| r["body"].get("stop").is_none()));
    eventually(
        Duration::from_secs(5),
        "decoders aborted at the stop",
        || async {
            engine_requests(&decode)
                .await
                .iter()
                .all(|r| r["outcome"] == "aborted" && r["tokens_emitted"].as_u64() < Some(30))
        },
    )
    .await;
}

/// vLLM merges tokens into one chunk when its API server lags; the engine
/// alone stops at the token that completed the stop, and so does the router:
/// token ids and usage included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ending_inside_a_merged_chunk_keeps_the_engines_token_ids() {
    let (router, [_prefill, _decode]) = pd_cluster(
        &[],
        [("prefill", &[]), ("decode", &["--tokens-per-chunk", "4"])],
    )
    .await;
    let reference = engine(None, "both", &[]);
    let completion =
        json!({"model":"mock","prompt":"Merged","max_tokens":20,"return_token_ids":true});
    let chat = json!({"model":"mock","messages":[{"role":"user","content":"Merged"}],
        "max_completion_tokens":20,"return_token_ids":true});
    for (path, body) in [
        ("/v1/completions", completion),
        ("/v1/chat/completions", chat),
    ] {
        // Ends in token 6, the third of the decoder's chunk of tokens 4 to 7.
        let stop = stop_across(&reference, path, &body, 6).await;
        let mut body = body.clone();
        body["stop"] = json!(stop);
        let (_, alone) = post(&reference, path, &body).await;
        let want = ids(&alone["choices"][0]["token_ids"]);
        assert_eq!(want.len(), 7, "{alone}");
        assert_same_but_the_fingerprint(&router, path, &body, &alone).await;
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let chunks = stream(&router, path, &streamed).await;
        assert_eq!(streamed_token_ids(&chunks), want, "{path}");
        assert_eq!(streamed_finish(&chunks), (json!("stop"), json!(stop)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_dying_while_a_stop_string_is_held_back_loses_no_character() {
    let (router, _engines, reference) = crashing_cluster(5).await;
    let mut body = json!({"model":"mock","prompt":"Held back","max_tokens":12});
    // The stop starts in the last token d0 sends before it dies and ends in
    // the first one its successor sends.
    let stop = stop_across(&reference, "/v1/completions", &body, 5).await;
    body["stop"] = json!(stop);
    let (_, alone) = post(&reference, "/v1/completions", &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&router, "/v1/completions", &streamed).await;
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "{chunks:?}"
    );
    assert_eq!(
        streamed_text(&chunks),
        alone["choices"][0]["text"].as_str().unwrap()
    );
    assert_eq!(streamed_finish(&chunks), (json!("stop"), json!(stop)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_aborts_the_decoder_within_one_event() {
    // One token every 50 ms: an event the decoder sends after the router let go
    // of it would show.
    let (router, [_prefill, decode]) = pd_cluster(
        &[],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "50000"]),
        ],
    )
    .await;
    let mut response = client()
        .post(format!("{}/v1/completions", router.url))
        .json(&json!({"model":"mock","prompt":"disconnect","max_tokens":400,"stream":true}))
        .send()
        .await
        .unwrap();
    for _ in 0..3 {
        assert!(response.chunk().await.unwrap().is_some());
    }
    let emitted = |records: Vec<Value>| records[0]["tokens_emitted"].as_u64().unwrap();
    let at_disconnect = emitted(engine_requests(&decode).await);
    let started = std::time::Instant::now();
    drop(response);
    eventually(Duration::from_secs(5), "the decoder aborted", || async {
        engine_requests(&decode).await[0]["outcome"] == "aborted"
    })
    .await;
    let after = emitted(engine_requests(&decode).await) - at_disconnect;
    eprintln!(
        "disconnect: decoder aborted {:?} after the client left, {after} token(s) later",
        started.elapsed()
    );
    assert!(after <= 1, "the decoder went on for {after} tokens");
}

/// The router matches stop strings on every chunk it relays: their number and
/// length are bounded, and a request past the bound is a clear 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_or_too_long_stop_strings_are_a_400() {
    let (router, [_prefill, _decoder]) = pd_cluster(&[], [("prefill", &[]), ("decode", &[])]).await;
    let many: Vec<String> = (0..65).map(|i| format!("stop{i}")).collect();
    let long = "x".repeat(1025);
    for stop in [json!(many), json!([long])] {
        let body = json!({"model":"mock","prompt":"hi","max_tokens":4,"stop":stop});
        let (status, answer) = post(&router, "/v1/completions", &body).await;
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["param"], "stop", "{answer}");
    }
    let body = json!({"model":"mock","prompt":"hi","max_tokens":4,"stop":["a", "b"]});
    assert_eq!(post(&router, "/v1/completions", &body).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_ends_at_its_eos_token_equals_the_engines_own() {
    let model = ["--eos-after-tokens", "7"];
    let (router, [_prefill, _decode]) =
        pd_cluster(&[], [("prefill", &model[..]), ("decode", &model[..])]).await;
    let reference = engine(None, "both", &model);
    let tool = json!({"type":"function","function":{"name":"lookup","parameters":{"type":"object",
        "properties":{"words":{"type":"string"}}}}});
    let asked = json!([{"role":"user","content":"Look it up"}]);
    let answered = json!([{"role":"user","content":"Look it up"},
        {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
            "function":{"name":"lookup","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c1","content":"found"}]);
    for (messages, finish) in [
        (&asked, "tool_calls"),
        (&answered, "stop"),
        (&asked, "length"),
    ] {
        let max = if finish == "length" { 5 } else { 64 };
        let body = json!({"model":"mock","messages":messages,"tools":[tool],
            "max_completion_tokens":max});
        let (status, answer) = post(&router, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["choices"][0]["finish_reason"], finish, "{answer}");
        let tokens = if finish == "length" { 5 } else { 7 };
        assert_eq!(answer["usage"]["completion_tokens"], tokens, "{answer}");
        assert_same_answer(&router, &reference, "/v1/chat/completions", body.clone()).await;
        // Streamed: the same end.
        let mut streamed = body;
        streamed["stream"] = json!(true);
        let chunks = stream(&router, "/v1/chat/completions", &streamed).await;
        let ends: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/finish_reason"))
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(ends, [&json!(finish)], "{chunks:?}");
    }
    // Completions end there too.
    let body = json!({"model":"mock","prompt":"Once","max_tokens":64});
    let (_, answer) = post(&router, "/v1/completions", &body).await;
    assert_eq!(answer["choices"][0]["finish_reason"], "stop", "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 7);
    assert_same_answer(&router, &reference, "/v1/completions", body).await;
}
