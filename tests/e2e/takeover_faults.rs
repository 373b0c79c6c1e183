//! Background responses taken over across replicas, when what the store
//! holds cannot be continued (issue 40, review of its first change): two
//! routers on one real Redis and the same mock engines; A dies mid
//! generation and B claims its response. A response whose state cannot be
//! read back ends as failed, once, with a terminal event for every reader
//! (not released and claimed again forever); a takeover that cannot go on
//! ends its readers' streams with `response.failed`; and what the store says
//! of the engine fields (`priority`, `cache_salt`) is not trusted.

use crate::common::*;
use crate::responses::{create, get, reattach};
use crate::shared_responses::{id_of, replicas_with};
use crate::store_hygiene::{checkpoint_in, taken_over_tampered};
use serde_json::{json, Value};
use std::time::Duration;

/// Reads background response `id` through `router` to its end (bounded: a
/// stream that never ends fails the test instead of hanging it).
async fn read_to_end(router: &Proc, id: &str) -> Vec<Value> {
    tokio::time::timeout(
        Duration::from_secs(25),
        reattach(router, id, None, usize::MAX),
    )
    .await
    .expect("the reader's stream ended")
}

/// Asserts that `events` are numbered 0, 1, ... and end with
/// `response.failed` (its response failed).
fn assert_ends_failed(events: &[Value]) {
    let numbers: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.failed", "{last}");
    assert_eq!(last["response"]["status"], "failed", "{last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_response_that_cannot_be_read_back_ends_failed_once() {
    let redis = Redis::start();
    let flags = ["--response-lease-ms", "3000"];
    let (a, b, _engines) = replicas_with(&redis, &flags, &["--decode-us-per-token", "30000"]).await;
    let body = json!({"model": "mock", "input": "Unreadable", "background": true,
                      "max_output_tokens": 200});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let key = format!("connex:{{{id}}}:checkpoint");
    eventually(Duration::from_secs(20), "a checkpoint", || async {
        checkpoint_in(&redis, &key).is_some() && redis.events_of(&id) >= 5
    })
    .await;
    a.signal("KILL");
    // A patch that is not JSON: no replica can read the checkpoint back.
    assert_ne!(redis.cli(&["RPUSH", &key, "{not json"]), "");
    // B claims it, cannot read it, and ends it: every reader's stream ends
    // with the failure (before, B let it go, claimed it again at its next
    // look, and so on for as long as its keys lived).
    let events = read_to_end(&b, &id).await;
    assert_ends_failed(&events);
    assert_eq!(get(&b, &id).await.1["status"], "failed");
    // No more looks at it: gone from the running ones (whose keys are kept
    // alive by every replica), its lease with it.
    assert_eq!(redis.cli(&["ZSCORE", "connex:running", &id]), "");
    assert_eq!(
        redis.cli(&["EXISTS", &format!("connex:{{{id}}}:lease")]),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_that_cannot_go_on_ends_every_readers_stream() {
    let redis = Redis::start();
    // A checkpoint naming a holder no decoder may pull from: B's
    // continuation is refused as it starts.
    let (done, b, _engines) = taken_over_tampered(&redis, "checkpoint", |checkpoint| {
        checkpoint["decode"]["kv_transfer_params"]["remote_ctrl"] = json!("127.0.0.1:9");
    })
    .await;
    assert_eq!(done["status"], "failed", "{done}");
    let id = done["id"].as_str().unwrap();
    // Read on B (which took it over) and through the store: both end with
    // `response.failed` (before, the log was marked done without one, and
    // the streams stopped after a delta).
    assert_ends_failed(&read_to_end(&b, id).await);
    let store_log = redis.events_of(id);
    let events = read_to_end(&b, id).await;
    assert_eq!(events.len() as u64, store_log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_fields_read_back_are_the_tenants() {
    let redis = Redis::start();
    let (done, _b, engines) = taken_over_tampered(&redis, "origin", |origin| {
        origin["chat"]["priority"] = json!(-5);
        origin["chat"]["cache_salt"] = json!("tenant:other");
    })
    .await;
    assert_eq!(done["status"], "incomplete", "{done}");
    assert_eq!(done["usage"]["output_tokens"], 200, "{done}");
    // The default tenant has neither: no decoder got what Redis said.
    let mut continued = 0;
    for decoder in &engines[1..] {
        for request in engine_requests(decoder).await {
            let body = &request["body"];
            assert!(
                body["priority"].as_i64().is_none_or(|p| p >= 0),
                "{request}"
            );
            assert_ne!(body["cache_salt"], "tenant:other", "{request}");
            continued += 1;
        }
    }
    assert!(continued >= 2, "A's decode and B's continuation");
}

const KEY: &str = "sk-takeover-tenant-0001";

/// POSTs `body` to `path` of `router` with the tenant's key: status, JSON.
async fn post_keyed(router: &Proc, path: &str, body: &Value) -> (u16, Value) {
    let response = client()
        .post(format!("{}{path}", router.url))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

/// Reads background response `id` to its end with the tenant's key
/// (bounded as [`read_to_end`]).
async fn read_keyed_to_end(router: &Proc, id: &str) -> Vec<Value> {
    let reading = async {
        let response = client()
            .get(format!("{}/v1/responses/{id}?stream=true", router.url))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        sse_events(&response.text().await.unwrap())
    };
    tokio::time::timeout(Duration::from_secs(25), reading)
        .await
        .expect("the reader's stream ended")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_taken_over_keeps_its_tenants_quota() {
    let redis = Redis::start();
    // The router's default: one background response a tenant; this tenant's
    // own: two.
    let dir =
        std::env::temp_dir().join(format!("connex-takeover-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tenants.toml");
    std::fs::write(
        &file,
        format!("[[tenant]]\nname = \"t\"\nkeys = [\"{KEY}\"]\nmax_background_responses = 2\n"),
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let mut flags = vec![
        "--response-store",
        redis.url.as_str(),
        "--response-lease-ms",
        "1000",
    ];
    flags.extend([
        "--tenants-file",
        file,
        "--max-background-responses-per-tenant",
        "1",
    ]);
    // Every decoder slow: a long response lasts far past the reads below.
    let slow = ["--decode-us-per-token", "30000"];
    let (a, engines) = failover_cluster(&flags, &slow, &slow).await;
    let ctrl = engine_stats(&engines[0]).await["ctrl"]
        .as_str()
        .unwrap()
        .to_string();
    let prefill = format!("{},{ctrl}", engines[0].url);
    let mut b_flags = vec!["--static-model", "mock", "--decode-policy", "round_robin"];
    b_flags.extend(["--prefill", prefill.as_str()]);
    for decoder in &engines[1..] {
        b_flags.extend(["--decode", decoder.url.as_str()]);
    }
    b_flags.extend(&flags);
    let b = router(&b_flags);
    wait_ready(&b, 3).await;

    let body = |tokens: u64| json!({"model": "mock", "input": "Quota", "background": true, "max_output_tokens": tokens});
    let (status, taken) = post_keyed(&a, "/v1/responses", &body(100)).await;
    assert_eq!(status, 200, "{taken}");
    let taken = taken["id"].as_str().unwrap().to_string();
    eventually(Duration::from_secs(20), "events in the store", || async {
        redis.events_of(&taken) >= 5
    })
    .await;
    a.signal("KILL");
    // The tenant's one on B, in progress far longer than the reads below.
    let (status, long) = post_keyed(&b, "/v1/responses", &body(4000)).await;
    assert_eq!(status, 200, "{long}");
    let long = long["id"].as_str().unwrap().to_string();
    // B takes the dead replica's over as its second of the tenant's two
    // (before, it counted it under the router's default of one and let it
    // go, again and again, until the long one ended).
    let events = read_keyed_to_end(&b, &taken).await;
    let last = events.last().unwrap();
    assert_eq!(last["response"]["usage"]["output_tokens"], 100, "{last}");
    let (_, still) = post_keyed(&b, &format!("/v1/responses/{long}/cancel"), &json!({})).await;
    assert_eq!(still["status"], "cancelled", "{still}");
}
