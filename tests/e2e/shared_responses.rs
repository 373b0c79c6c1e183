//! Responses in the store every replica shares (issue 31): two routers on one
//! real Redis (Debian's redis-server) and the same mock engines. A response
//! made on one replica is read, continued, cancelled and deleted through the
//! other; with Redis down both go on serving, degraded to their own memory.
//! Part of the resume binary, beside the responses tests it builds on.

use crate::common::*;
use crate::responses::{assert_stopped_short, cancel, create, get, read_across, reattach};
use connex_router::ClientEvent;
use serde_json::{json, Value};
use std::time::Duration;

/// Router A with the scale-out cluster registered, router B with the same
/// engines as static instances; both on `redis`.
async fn two_replicas(redis: &Redis, d0_flags: &[&str]) -> (Proc, Proc, [Proc; 3]) {
    replicas_with(redis, &[], d0_flags).await
}

/// [`two_replicas`], both routers with `router_flags` too.
pub(super) async fn replicas_with(
    redis: &Redis,
    router_flags: &[&str],
    d0_flags: &[&str],
) -> (Proc, Proc, [Proc; 3]) {
    let mut store = vec!["--response-store", redis.url.as_str()];
    store.extend_from_slice(router_flags);
    let (a, engines) = scale_out_cluster(&store, d0_flags).await;
    let ctrl = engine_stats(&engines[0]).await["ctrl"]
        .as_str()
        .unwrap()
        .to_string();
    let prefill = format!("{},{ctrl}", engines[0].url);
    let mut flags = vec![
        "--static-model",
        "mock",
        "--decode-policy",
        "round_robin",
        "--prefill",
        prefill.as_str(),
    ];
    for decoder in &engines[1..] {
        flags.extend(["--decode", decoder.url.as_str()]);
    }
    flags.extend(&store);
    let b = router(&flags);
    wait_ready(&b, 3).await;
    (a, b, engines)
}

pub(super) fn id_of(text: &str) -> String {
    serde_json::from_str::<Value>(text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_is_read_continued_and_deleted_through_another_replica() {
    let redis = Redis::start();
    let (a, b, engines) = two_replicas(&redis, &["--decode-us-per-token", "20000"]).await;
    let body = json!({"model": "mock", "input": "Run in the background", "background": true,
                      "max_output_tokens": 40});
    let (status, text) = create(&a, &body).await;
    assert_eq!(status, 200, "{text}");
    let id = id_of(&text);
    // Its first events from A, the rest from B after the last one seen: each
    // event exactly once, and as A has them; B reads it while it runs.
    let all = read_across(&a, &b, &id, 6, async {
        let running = get(&b, &id).await;
        assert_eq!(running.0, 200, "{:?}", running.1);
        assert_eq!(running.1["id"], id.as_str());
    })
    .await;
    assert_eq!(all.last().unwrap()["type"], "response.completed");
    assert_eq!(reattach(&a, &id, None, usize::MAX).await, all);
    assert_eq!(reattach(&b, &id, None, usize::MAX).await, all);
    // The finished response, read on B.
    let done = &all.last().unwrap()["response"];
    assert_eq!(done["usage"]["output_tokens"], 40);
    assert_eq!(&get(&b, &id).await.1, done);

    // The next turn on B continues A's response: the prefill sees its output.
    let answer: String = done["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let next = json!({"model": "mock", "previous_response_id": id, "input": "And then?",
                      "max_output_tokens": 3});
    let (status, text) = create(&b, &next).await;
    assert_eq!(status, 200, "{text}");
    let requests = engine_requests(&engines[0]).await;
    let messages = &requests.last().unwrap()["body"]["messages"];
    assert_eq!(
        messages[0]["content"], "Run in the background",
        "{messages}"
    );
    assert_eq!(messages[1]["content"], answer.as_str(), "{messages}");
    assert_eq!(messages[2]["content"], "And then?", "{messages}");

    // Deleted on B: gone on A too.
    let deleted = client()
        .delete(format!("{}/v1/responses/{id}", b.url))
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    assert_eq!(get(&a, &id).await.0, 404);
    let again = json!({"model": "mock", "previous_response_id": id, "input": "x"});
    assert_eq!(create(&a, &again).await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_on_another_replica_stops_the_generation() {
    let redis = Redis::start();
    let (a, b, engines) = two_replicas(&redis, &["--decode-us-per-token", "50000"]).await;
    let body = json!({"model": "mock", "input": "Cancel me elsewhere", "background": true,
                      "max_output_tokens": 400});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    assert_eq!(reattach(&b, &id, None, 8).await.len(), 8);
    let cancelled = cancel(&b, &id).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert_eq!(get(&a, &id).await.1["status"], "cancelled");
    // A closed its decoder stream: the decoder stopped well short of 400.
    assert_stopped_short(&engines[1], 400).await;
    // B's reader gets the whole log, as A has it, and ends.
    assert_eq!(
        reattach(&b, &id, None, usize::MAX).await,
        reattach(&a, &id, None, usize::MAX).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_each_replica_serves_from_its_own_memory() {
    let mut redis = Redis::start();
    let (a, b, _engines) = two_replicas(&redis, &[]).await;
    assert_eq!(ready(&a).await["response_store"], "shared");
    redis.kill();
    // New requests are served; what is stored stays on the replica that made it.
    let body = json!({"model": "mock", "input": "Store me while Redis is down",
                      "max_output_tokens": 3});
    let (status, text) = create(&a, &body).await;
    assert_eq!(status, 200, "{text}");
    let id = id_of(&text);
    assert_eq!(ready(&a).await["response_store"], "unavailable");
    let got = get(&a, &id).await;
    assert_eq!(got.0, 200, "{:?}", got.1);
    // B cannot know it: the store is unreachable, said as such.
    let (status, error) = get(&b, &id).await;
    assert_eq!(status, 503, "{error}");
    let metrics = metrics_text(&a).await;
    assert!(
        metric(&metrics, "connex_response_store_errors_total", &[]) > 0.0,
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "connex_response_store_up", &[]), 0.0);
    // Redis back (empty): both replicas use it again.
    redis.restart();
    for replica in [&a, &b] {
        eventually(Duration::from_secs(10), "the store seen back", || async {
            ready(replica).await["response_store"] == "shared"
        })
        .await;
    }
    let (status, text) = create(&b, &body).await;
    assert_eq!(status, 200, "{text}");
    let shared = id_of(&text);
    eventually(Duration::from_secs(5), "A reads B's response", || async {
        get(&a, &shared).await.0 == 200
    })
    .await;
    assert_eq!(ready(&a).await["response_store"], "shared");
}

/// The output text of a response.
pub(super) fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().iter())
        .map(|part| part["text"].as_str().unwrap())
        .collect()
}

const LEASE: &[&str] = &["--response-lease-ms", "600"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_outlives_its_replica() {
    let redis = Redis::start();
    let (a, b, engines) = replicas_with(&redis, LEASE, &["--decode-us-per-token", "30000"]).await;
    let prompt = "Survive your router";
    // The uninterrupted answer (same prompt, greedy mock), on B.
    let (_, text) = create(
        &b,
        &json!({"model": "mock", "input": prompt, "max_output_tokens": 60}),
    )
    .await;
    let want: Value = serde_json::from_str(&text).unwrap();
    let prefills_before = engine_requests(&engines[0]).await.len();
    let body =
        json!({"model": "mock", "input": prompt, "background": true, "max_output_tokens": 60});
    let (status, text) = create(&a, &body).await;
    assert_eq!(status, 200, "{text}");
    let id = id_of(&text);
    // A reader on A gets 10 events; A dies (SIGKILL); the reader comes back
    // on B after the last one it saw, and B took the generation over. Each
    // event the reader had was in the store already (one it had and the
    // store lacked could be generated differently by B).
    let all = read_across(&a, &b, &id, 10, async {
        assert!(redis.events_of(&id) >= 10);
        a.signal("KILL");
    })
    .await;
    let done = &all.last().unwrap()["response"];
    assert_eq!(all.last().unwrap()["type"], "response.completed", "{done}");
    assert_eq!(output_text(done), output_text(&want));
    assert_eq!(done["usage"]["output_tokens"], 60);
    assert_eq!(done["id"], id.as_str());
    // Continued from the prefill's hold: no second prefill of the prompt.
    assert_eq!(
        engine_requests(&engines[0]).await.len(),
        prefills_before + 1
    );
    // Stored, as the dead replica would have stored it.
    assert_eq!(&get(&b, &id).await.1, done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_lost_its_lease_stops_writing() {
    let redis = Redis::start();
    let (a, b, _engines) = replicas_with(&redis, LEASE, &["--decode-us-per-token", "30000"]).await;
    let prompt = "Frozen router";
    let (_, text) = create(
        &b,
        &json!({"model": "mock", "input": prompt, "max_output_tokens": 60}),
    )
    .await;
    let want: Value = serde_json::from_str(&text).unwrap();
    let body =
        json!({"model": "mock", "input": prompt, "background": true, "max_output_tokens": 60});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    // A freezes past its lease (B takes over), then comes back: its writes
    // are refused (fenced by the lease's token), so the log stays one.
    let all = read_across(&b, &b, &id, 8, async {
        a.signal("STOP");
        tokio::time::sleep(Duration::from_millis(2500)).await;
        a.signal("CONT");
    })
    .await;
    let done = &all.last().unwrap()["response"];
    assert_eq!(all.last().unwrap()["type"], "response.completed", "{done}");
    assert_eq!(output_text(done), output_text(&want));
    // Nothing more arrives after the end, from A or anyone.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(reattach(&b, &id, None, usize::MAX).await, all);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_replica_hands_its_generations_over() {
    let redis = Redis::start();
    // A lease far longer than the test: only the hand-over moves it.
    let flags = ["--response-lease-ms", "60000", "--shutdown-grace-s", "0"];
    let (a, b, _engines) = replicas_with(&redis, &flags, &["--decode-us-per-token", "30000"]).await;
    let body = json!({"model": "mock", "input": "Hand me over", "background": true,
                      "max_output_tokens": 60});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let all = read_across(&a, &b, &id, 6, async {
        a.signal("TERM");
    })
    .await;
    assert_eq!(all.last().unwrap()["type"], "response.completed");
    assert_eq!(
        all.last().unwrap()["response"]["usage"]["output_tokens"],
        60
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_wins_an_expired_lease() {
    use connex_router::{LogState, RedisSettings, RedisStore};
    let redis = Redis::start();
    // The dead writer's leases are short; the claimers' long, so that a
    // slow second claim cannot find the first one's expired.
    let store = |lease_ms| {
        RedisStore::new(RedisSettings {
            url: redis.url.clone(),
            password: None,
            ca_file: None,
            prefix: "race:".into(),
            ttl: Duration::from_secs(60),
            timeout: Duration::from_secs(2),
            lease: Duration::from_millis(lease_ms),
            max_bytes: 1 << 20,
            max_response_bytes: 1 << 20,
            fallback_count: 16,
        })
        .unwrap()
    };
    let (first, second, third) = (store(100), store(60_000), store(60_000));
    let state = LogState {
        tenant: String::new(),
        response: json!({"status": "in_progress"}),
        done: false,
    };
    for n in 0..20 {
        first
            .append(
                &format!("resp_{n}"),
                "dead",
                &state,
                &[ClientEvent::from_value(
                    &json!({"type": "x", "sequence_number": 0}),
                )],
                None,
                None,
            )
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A claimer leaves its own generations alone (all 20 named: none won).
    let own: Vec<String> = (0..20).map(|n| format!("resp_{n}")).collect();
    assert_eq!(second.claim_expired("b", 20, &own).await.unwrap().len(), 0);
    let (b, c) = tokio::join!(
        second.claim_expired("b", 20, &[]),
        third.claim_expired("c", 20, &[])
    );
    let (mut b, mut c) = (b.unwrap(), c.unwrap());
    b.sort();
    c.sort();
    assert_eq!(b.len() + c.len(), 20, "{b:?} {c:?}");
    assert!(b.iter().all(|id| !c.contains(id)), "{b:?} {c:?}");
    // The dead writer is fenced from every one of them now.
    let fenced = first
        .append("resp_0", "dead", &state, &[], None, None)
        .await;
    assert!(fenced.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_tls_with_a_password_is_shared_and_a_wrong_password_is_refused() {
    let dir = std::env::temp_dir().join(format!("connex-redis-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let redis = Redis::start_tls(&dir, "s3cret-store");
    let ca = dir.join("ca.crt").to_string_lossy().into_owned();
    let password = dir.join("password");
    std::fs::write(&password, "s3cret-store\n").unwrap();
    let password = password.to_string_lossy().into_owned();
    let flags = [
        "--response-store-ca-file",
        ca.as_str(),
        "--response-store-password-file",
        password.as_str(),
    ];
    let (a, b, engines) = replicas_with(&redis, &flags, &[]).await;
    assert_eq!(ready(&a).await["response_store"], "shared");
    let (status, text) = create(&a, &json!({"model": "mock", "input": "over TLS"})).await;
    assert_eq!(status, 200, "{text}");
    let id = id_of(&text);
    assert_eq!(get(&b, &id).await.0, 200);
    assert_eq!(
        redis.cli(&["EXISTS", &format!("connex:{{{id}}}:stored")]),
        "1"
    );
    // A replica with the wrong password reaches no store: it says so, and
    // serves from its own memory.
    let wrong = dir.join("wrong");
    std::fs::write(&wrong, "not-it").unwrap();
    let ctrl = engine_stats(&engines[0]).await["ctrl"]
        .as_str()
        .unwrap()
        .to_string();
    let prefill = format!("{},{ctrl}", engines[0].url);
    let c = router(&[
        "--static-model",
        "mock",
        "--prefill",
        &prefill,
        "--decode",
        &engines[1].url,
        "--response-store",
        &redis.url,
        "--response-store-ca-file",
        &ca,
        "--response-store-password-file",
        &wrong.to_string_lossy(),
    ]);
    wait_ready(&c, 2).await;
    let (status, text) = create(&c, &json!({"model": "mock", "input": "wrong password"})).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(ready(&c).await["response_store"], "unavailable");
    assert_eq!(get(&c, &id_of(&text)).await.0, 200);
    // And a password in the URL is refused at start.
    let refused = refused_start(&["--response-store", "redis://:pw@127.0.0.1:6379"]);
    assert!(
        refused.contains("--response-store-password-file"),
        "{refused}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
