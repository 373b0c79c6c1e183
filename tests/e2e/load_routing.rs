//! Load- and cache-aware routing end to end: a real router and mock-engine
//! processes on loopback; the engines report load with their heartbeats and
//! (with a prefix cache) the KV blocks they store, as vLLM's agent does.

// Tests fail loudly on anything unexpected; that is what unwrap is for here.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
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
    let router = router(&["--decode-policy", "load_aware", "--heartbeat-ttl-s", "3"]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let idle = engine(Some(&router), "decode", &[]);
    // Busy with 50 requests from elsewhere (other routers), as it reports.
    let busy = engine(Some(&router), "decode", &["--report-waiting", "50"]);
    wait_ready(&router, 3).await;
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
    assert_eq!(engine_requests(&idle).await.len(), 8);
    assert!(engine_requests(&busy).await.is_empty());
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
