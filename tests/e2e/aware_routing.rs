//! Load- and cache-aware routing end to end: a real router and mock-engine
//! processes on loopback; the engines report load with their heartbeats and
//! (with a prefix cache) the KV blocks they store, as vLLM's agent does.

use crate::common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// The load an instance last reported, from the admin view.
async fn reported_waiting(router: &Proc, engine: &Proc) -> Option<u64> {
    instances(router)
        .await
        .iter()
        .find(|i| i["url"] == engine.url.as_str())
        .and_then(|i| i["load"]["waiting"].as_u64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_reporting_heavy_load_gets_no_new_requests() {
    // The second decoder is busy with 50 requests from elsewhere (other
    // routers), as it reports.
    let (router, [_prefill, idle, busy]) = pd_cluster(
        &["--decode-policy", "load_aware", "--heartbeat-ttl-s", "3"],
        [
            ("prefill", &[]),
            ("decode", &[]),
            ("decode", &["--report-waiting", "50"]),
        ],
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "the busy decoder reports its load",
        || async {
            reported_waiting(&router, &busy).await == Some(50)
                && reported_waiting(&router, &idle).await == Some(0)
        },
    )
    .await;
    for i in 0..8 {
        let (status, _) = post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":format!("p{i}"),"max_tokens":2}),
        )
        .await;
        assert_eq!(status, 200);
    }
    assert_eq!(engine_generations(&idle).await.len(), 8);
    assert!(engine_generations(&busy).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_with_malformed_load_is_refused_with_an_openai_error() {
    let router = router(&[]);
    let (status, registered) = post_internal(
        &router,
        "/v1/instances",
        &json!({"role":"decode","url":"http://127.0.0.1:9","model":"mock"}),
        None,
    )
    .await;
    assert_eq!(status, 201);
    let id = registered["id"].as_str().unwrap();
    let credential = registered["credential"].as_str();
    let (status, body): (u16, Value) = post_internal(
        &router,
        &format!("/v1/instances/{id}/heartbeat"),
        &json!({"running": 1, "kv_usage": 7}),
        credential,
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "kv_usage");
    let (status, _) = post_internal(
        &router,
        &format!("/v1/instances/{id}/heartbeat"),
        &json!({"running": 1, "waiting": 2, "kv_usage": 0.25}),
        credential,
    )
    .await;
    assert_eq!(status, 200);
    let listed = instances(&router).await;
    assert_eq!(listed[0]["load"]["waiting"], 2);
    assert_eq!(listed[0]["load"]["kv_usage"], 0.25);
}

/// A system prompt of 512 byte-tokens (32 blocks of 16) shared by every chat.
fn system_prompt() -> String {
    (0..64).map(|i| format!("rule{i:03} ")).collect()
}

fn chat(user: &str) -> Value {
    json!({"model": "mock", "max_tokens": 2, "messages": [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": user},
    ]})
}

const PREFIX_CACHE: &[&str] = &["--prefix-cache-blocks", "4096", "--block-size", "16"];

/// Blocks the router has indexed for `engine`.
async fn indexed_blocks(router: &Proc, engine: &Proc) -> u64 {
    instances(router)
        .await
        .iter()
        .find(|i| i["url"] == engine.url.as_str())
        .and_then(|i| i["prefix_index_blocks"].as_u64())
        .unwrap_or(0)
}

/// Sends `body` to the engine itself (not through the router), so that it
/// computes, caches and reports the prompt's blocks.
async fn warm(engine: &Proc, body: &Value) {
    let response = client()
        .post(format!("{}/v1/chat/completions", engine.url))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
}

/// Sends `body` to `path` through the router; returns which of `a` and `b`
/// served it (then the other), once the router has indexed its blocks.
async fn served_and_indexed<'e>(
    router: &Proc,
    path: &str,
    body: &Value,
    (a, b): (&'e Proc, &'e Proc),
) -> (&'e Proc, &'e Proc) {
    let (status, _) = post(router, path, body).await;
    assert_eq!(status, 200);
    let (first, other) = if engine_generations(a).await.len() == 1 {
        (a, b)
    } else {
        (b, a)
    };
    eventually(
        Duration::from_secs(5),
        "the engine's KV events are indexed",
        || async { indexed_blocks(router, first).await >= 32 },
    )
    .await;
    (first, other)
}

/// A router with `cache_aware` prefill choice, prefills `a` (with `a_extra`)
/// and `b` with prefix caches, and one decoder.
async fn cache_cluster(router_flags: &[&str], a_extra: &[&str]) -> (Proc, Proc, Proc, Proc) {
    let flags = [
        &["--prefill-policy", "cache_aware", "--heartbeat-ttl", "3s"],
        router_flags,
    ]
    .concat();
    let a = [PREFIX_CACHE, a_extra].concat();
    let (router, [a, b, decode]) = pd_cluster(
        &flags,
        [("prefill", &a), ("prefill", PREFIX_CACHE), ("decode", &[])],
    )
    .await;
    (router, a, b, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_and_a_growing_chat_go_to_the_prefill_that_holds_them() {
    let (router, a, b, _decode) = cache_cluster(&[], &[]).await;
    let (first, other) =
        served_and_indexed(&router, "/v1/chat/completions", &chat("first"), (&a, &b)).await;
    // Users sharing the system prompt, and one user's chat growing turn by turn.
    let mut conversation = chat("turn 0");
    for i in 0..6 {
        let (status, _) = post(&router, "/v1/chat/completions", &chat(&format!("user {i}"))).await;
        assert_eq!(status, 200);
        let (status, answer) = post(&router, "/v1/chat/completions", &conversation).await;
        assert_eq!(status, 200);
        let messages = conversation["messages"].as_array_mut().unwrap();
        messages.push(
            json!({"role": "assistant", "content": answer["choices"][0]["message"]["content"]}),
        );
        messages.push(json!({"role": "user", "content": format!("turn {}", i + 1)}));
    }
    let served = engine_generations(first).await;
    assert_eq!(served.len(), 13, "every request went where its prefix is");
    assert!(engine_generations(other).await.is_empty());
    // And the engine computed only what was not cached: the system prompt once.
    for request in &served[1..] {
        let computed = request["computed_prompt_tokens"].as_u64().unwrap();
        assert!(computed < 100, "computed {computed} prompt tokens again");
    }
    let metrics = metrics_text(&router).await;
    assert_eq!(
        metric(
            &metrics,
            "connex_routing_decisions_total",
            &["phase=\"prefill\"", "reason=\"cache\""]
        ),
        12.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefix_wins_over_load_under_the_balance_threshold() {
    // `a` holds the prefix and is busier (30 waiting), within the default
    // threshold of 64.
    let (router, a, b, _decode) = cache_cluster(&[], &["--report-waiting", "30"]).await;
    warm(&a, &chat("warm-up")).await;
    eventually(
        Duration::from_secs(5),
        "a's blocks are indexed and its load known",
        || async {
            indexed_blocks(&router, &a).await >= 32
                && reported_waiting(&router, &a).await == Some(30)
        },
    )
    .await;
    for i in 0..4 {
        let (status, _) = post(&router, "/v1/chat/completions", &chat(&format!("u{i}"))).await;
        assert_eq!(status, 200);
    }
    assert_eq!(engine_generations(&a).await.len(), 1 + 4);
    assert!(engine_generations(&b).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_past_the_balance_threshold_overrides_the_prefix() {
    let (router, a, b, _decode) = cache_cluster(
        &["--balance-abs-threshold", "8"],
        &["--report-waiting", "30"],
    )
    .await;
    warm(&a, &chat("warm-up")).await;
    eventually(
        Duration::from_secs(5),
        "a's blocks are indexed and its load known",
        || async {
            indexed_blocks(&router, &a).await >= 32
                && reported_waiting(&router, &a).await == Some(30)
        },
    )
    .await;
    for i in 0..4 {
        let (status, _) = post(&router, "/v1/chat/completions", &chat(&format!("u{i}"))).await;
        assert_eq!(status, 200);
    }
    assert_eq!(engine_generations(&a).await.len(), 1, "only the warm-up");
    assert_eq!(engine_generations(&b).await.len(), 4);
    let metrics = metrics_text(&router).await;
    assert_eq!(
        metric(
            &metrics,
            "connex_routing_decisions_total",
            &["phase=\"prefill\"", "reason=\"load\""]
        ),
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_starts_with_an_empty_index() {
    let (router, a, _b, _decode) = cache_cluster(&[], &["--id", "pa"]).await;
    warm(&a, &chat("warm-up")).await;
    eventually(Duration::from_secs(5), "a's blocks are indexed", || async {
        indexed_blocks(&router, &a).await >= 32
    })
    .await;
    drop(a);
    let a = engine(
        Some(&router),
        "prefill",
        &[PREFIX_CACHE, &["--id", "pa"]].concat(),
    );
    eventually(
        Duration::from_secs(5),
        "the new a is registered",
        || async {
            instances(&router)
                .await
                .iter()
                .any(|i| i["url"] == a.url.as_str())
        },
    )
    .await;
    assert_eq!(indexed_blocks(&router, &a).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_need_the_instance_credential_and_a_valid_batch() {
    let router = router(&[]);
    let (_, registered) = post_internal(
        &router,
        "/v1/instances",
        &json!({"role":"prefill","url":"http://127.0.0.1:9","model":"mock"}),
        None,
    )
    .await;
    let id = registered["id"].as_str().unwrap();
    let path = format!("/v1/instances/{id}/kv-events");
    let stored = json!({"events": [{"type": "BlockStored", "block_hashes": [1, 2],
        "parent_block_hash": null, "token_ids": [1, 2, 3, 4], "block_size": 2}]});
    let (status, _) = post_internal(&router, &path, &stored, Some("not-it")).await;
    assert_eq!(status, 403);
    let short = json!({"events": [{"type": "BlockStored", "block_hashes": [1, 2],
        "token_ids": [1, 2, 3], "block_size": 2}]});
    let credential = registered["credential"].as_str();
    let (status, body) = post_internal(&router, &path, &short, credential).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "events");
    let (status, _) = post_internal(&router, &path, &stored, credential).await;
    assert_eq!(status, 204);
    assert_eq!(instances(&router).await[0]["prefix_index_blocks"], 2);
    let cleared = json!({"events": [{"type": "AllBlocksCleared"}]});
    post_internal(&router, &path, &cleared, credential).await;
    assert_eq!(instances(&router).await[0]["prefix_index_blocks"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_goes_to_the_decoder_that_cached_it() {
    let (router, [_prefill, a, b]) = pd_cluster(
        &["--decode-policy", "cache_aware"],
        [
            ("prefill", &[]),
            ("decode", PREFIX_CACHE),
            ("decode", PREFIX_CACHE),
        ],
    )
    .await;
    let (first, other) =
        served_and_indexed(&router, "/v1/chat/completions", &chat("first"), (&a, &b)).await;
    for i in 0..4 {
        let (status, _) = post(&router, "/v1/chat/completions", &chat(&format!("u{i}"))).await;
        assert_eq!(status, 200);
    }
    let served = engine_generations(first).await;
    assert_eq!(served.len(), 5);
    assert!(engine_generations(other).await.is_empty());
    // It pulled only what its cache lacked: the first request the whole
    // prompt, the others the blocks after the shared system prompt.
    let pulled: Vec<u64> = served
        .iter()
        .map(|r| r["pulled_bytes"].as_u64().unwrap())
        .collect();
    let bytes_per_block = 16 * 64;
    assert!(pulled[0] >= 32 * bytes_per_block, "{pulled:?}");
    for later in &pulled[1..] {
        assert!(*later <= 3 * bytes_per_block, "pulled again: {pulled:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kv_events_the_prompts_sent_stand_in_for_the_cache() {
    // Engines without a prefix cache send no KV events: the router indexes
    // the prompts it sent each one.
    let (router, [a, b, _decode]) = pd_cluster(
        &["--prefill-policy", "cache_aware"],
        [("prefill", &[]), ("prefill", &[]), ("decode", &[])],
    )
    .await;
    for i in 0..5 {
        let (status, _) = post(&router, "/v1/chat/completions", &chat(&format!("u{i}"))).await;
        assert_eq!(status, 200);
    }
    let counts = (
        engine_generations(&a).await.len(),
        engine_generations(&b).await.len(),
    );
    assert!(counts == (5, 0) || counts == (0, 5), "{counts:?}");
    let sources: Vec<Value> = instances(&router)
        .await
        .iter()
        .filter(|i| i["role"] == "prefill")
        .map(|i| i["prefix_index_source"].clone())
        .collect();
    assert!(sources.contains(&json!("sent_prompts")), "{sources:?}");
}

/// With the model's tokenizer file (`--tokenizer`), the router tokenizes a
/// completions text prompt itself: the prompts still go where their prefix
/// is (the ids are the engine's), and no engine is asked to tokenize.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_models_tokenizer_file_text_prompts_are_tokenized_in_the_router() {
    let path =
        std::env::temp_dir().join(format!("connex-e2e-tokenizer-{}.json", std::process::id()));
    std::fs::write(
        &path,
        connex_mock_engine::model::tokenizer_json().to_string(),
    )
    .unwrap();
    let tokenizer = format!("mock={}", path.display());
    let (router, a, b, _decode) = cache_cluster(&["--tokenizer", &tokenizer], &[]).await;
    let completion =
        |user: &str| json!({"model": "mock", "max_tokens": 2, "prompt": system_prompt() + user});
    let (first, other) =
        served_and_indexed(&router, "/v1/completions", &completion("first"), (&a, &b)).await;
    for i in 0..4 {
        let (status, _) = post(&router, "/v1/completions", &completion(&format!("u{i}"))).await;
        assert_eq!(status, 200);
    }
    assert_eq!(engine_generations(first).await.len(), 5);
    assert!(engine_generations(other).await.is_empty());
    let metrics = metrics_text(&router).await;
    let tokenized = |by: &str| {
        metric(
            &metrics,
            "connex_tokenize_duration_seconds_count",
            &[&format!("by=\"{by}\""), "outcome=\"ok\""],
        )
    };
    assert_eq!(tokenized("router"), 5.0);
    assert_eq!(tokenized("engine"), 0.0, "no /tokenize round trip");
    let _ = std::fs::remove_file(&path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_file_that_cannot_be_loaded_stops_the_router_with_a_clear_error() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_connex-router"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--internal-listen",
            "127.0.0.1:0",
        ])
        .args(["--tokenizer", "mock=/nonexistent/tokenizer.json"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr
            .contains("cannot load the tokenizer of model `mock` from /nonexistent/tokenizer.json"),
        "{stderr}"
    );
}

/// Registrants cannot grow the prefix index past its total: twenty
/// instances each reporting 500 blocks (under their own cap) hold at most
/// `--prefix-index-total-blocks` together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrants_cannot_grow_the_prefix_index_past_its_total() {
    let router = router(&["--prefix-index-total-blocks", "1000"]);
    for n in 0..20u64 {
        let url = format!("http://127.0.0.1:{}", 10_000 + n);
        let (status, registered) = post_internal(
            &router,
            "/v1/instances",
            &json!({"role": "decode", "url": url, "model": "mock"}),
            None,
        )
        .await;
        assert!((200..300).contains(&status), "{status}: {registered}");
        let id = registered["id"].as_str().unwrap();
        let hashes: Vec<u64> = (0..500).map(|h| n * 1_000 + h).collect();
        let tokens: Vec<u64> = (0..1_000).map(|t| n * 10_000 + t).collect();
        let events = json!({"events": [{"type": "BlockStored", "block_hashes": hashes,
            "parent_block_hash": null, "token_ids": tokens, "block_size": 2}]});
        let path = format!("/v1/instances/{id}/kv-events");
        let (status, _) =
            post_internal(&router, &path, &events, registered["credential"].as_str()).await;
        assert_eq!(status, 204);
    }
    let held: u64 = instances(&router)
        .await
        .iter()
        .map(|i| i["prefix_index_blocks"].as_u64().unwrap())
        .sum();
    assert_eq!(held, 1000, "all indexes together");
}
