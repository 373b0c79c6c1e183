//! A background response while its shared store fails (issue 40): a real
//! `redis-server` killed and restarted from its append-only file, frozen
//! (SIGSTOP), or full (`maxmemory`, `noeviction`), each for longer than the
//! lease, in the middle of a 300-token generation on slowed mock decoders.
//! Whatever the fault, the response is generated once (one decode request at
//! the decoders), every reader's stream ends with a terminal Responses event
//! (or is let go and gets one by reattaching after its last event), and the
//! stored response says what the readers were sent.

use crate::common::*;
use connex_router::ClientEvent;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The lease, and the store's timeout (well under it, so that the writer
/// sees the store fail within one lease).
const FLAGS: &[&str] = &[
    "--response-lease-ms",
    "1000",
    "--response-store-timeout-ms",
    "300",
];

/// How long each fault lasts: past the lease, whatever the host's speed.
const OUTAGE: Duration = Duration::from_millis(3000);

/// Tokens of the response (15 ms each on the decoders): the fault comes in
/// the middle of its generation.
const TOKENS: u64 = 300;

const TERMINAL: &[&str] = &[
    "response.completed",
    "response.failed",
    "response.incomplete",
    "response.cancelled",
];

fn long_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

fn is_terminal(event: &Value) -> bool {
    event["type"]
        .as_str()
        .is_some_and(|kind| TERMINAL.contains(&kind))
}

/// Reads `response`'s events into `seen` until its stream ends (or breaks).
async fn read_into(mut response: reqwest::Response, seen: &Mutex<Vec<Value>>) {
    let mut text = String::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
        *seen.lock().unwrap() = sse_events(&text);
    }
}

/// A reader of a background response on the router at `base`: what it was
/// sent on `first`, then, each time its stream ended without a terminal
/// event, what it was sent by reattaching after the last event it had (a few
/// times, each within the client's timeout).
async fn read_to_the_end(
    base: String,
    first: reqwest::Response,
    seen: Arc<Mutex<Vec<Value>>>,
) -> Vec<Value> {
    read_into(first, &seen).await;
    let mut all = numbered(seen.lock().unwrap().clone());
    // Up to ~30 s of reattaching: the store may be down for seconds.
    for _ in 0..60 {
        if all.last().is_some_and(is_terminal) {
            break;
        }
        let id = all[0]["response"]["id"].as_str().unwrap();
        let last = all.last().unwrap()["sequence_number"].as_u64().unwrap();
        let url = format!("{base}/v1/responses/{id}?stream=true&starting_after={last}");
        let response = long_client().get(url).send().await.unwrap();
        if response.status() == 200 {
            let more = Mutex::new(Vec::new());
            read_into(response, &more).await;
            all.extend(numbered(more.into_inner().unwrap()));
        }
        if !all.last().is_some_and(is_terminal) {
            // The store is not back yet: the reader tries again shortly.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    all
}

/// The response's own events of what a reader was sent: a stream that ends
/// early (its replica let it go, the store could not be read) may end with an
/// `error` event of the router's, unnumbered (it is not one of the response's
/// events: the reader reattaches after the last numbered one).
fn numbered(events: Vec<Value>) -> Vec<Value> {
    events
        .into_iter()
        .filter(|event| {
            let numbered = event["sequence_number"].is_u64();
            assert!(numbered || event["type"] == "error", "{event}");
            numbered
        })
        .collect()
}

/// The text the output deltas of `events` carried.
fn streamed_output(events: &[Value]) -> String {
    events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect()
}

fn output_text(response: &Value) -> String {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().unwrap().iter())
        .map(|part| part["text"].as_str().unwrap())
        .collect()
}

/// A 300-token background response on a router sharing `redis`, streamed to
/// its client and read by a second reader; `fault` is done to the store once
/// the readers had 20 events. Then the checks every fault shares.
async fn one_generation_through(redis: &mut Redis, fault: impl AsyncFnOnce(&mut Redis)) {
    generated_through(redis, FLAGS, 1, fault).await;
}

/// [`one_generation_through`] with the router's `store_flags`, expecting
/// `decodes` decode requests that generated at the decoders.
async fn generated_through(
    redis: &mut Redis,
    store_flags: &[&str],
    decodes: usize,
    fault: impl AsyncFnOnce(&mut Redis),
) {
    // Decoders with the tokens API: a continuation pulls the prompt's KV
    // from the prefill's hold again, as vLLM's with --enable-scale-out do.
    let slow = ["--decode-us-per-token", "15000", "--enable-scale-out"];
    let mut flags = vec!["--response-store", redis.url.as_str()];
    flags.extend_from_slice(store_flags);
    let (router, engines) = failover_cluster(&flags, &slow, &slow).await;
    let body = json!({"model": "mock", "input": "Generate me once", "background": true,
                      "stream": true, "max_output_tokens": TOKENS});
    let created = long_client()
        .post(format!("{}/v1/responses", router.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 200);
    let first_seen = Arc::new(Mutex::new(Vec::new()));
    let first = tokio::spawn(read_to_the_end(
        router.url.clone(),
        created,
        first_seen.clone(),
    ));
    eventually(
        Duration::from_secs(20),
        "the stream's first event",
        || async { !first_seen.lock().unwrap().is_empty() },
    )
    .await;
    let id = first_seen.lock().unwrap()[0]["response"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    // A second reader, from the first event.
    let second_seen = Arc::new(Mutex::new(Vec::new()));
    let opened = long_client()
        .get(format!("{}/v1/responses/{id}?stream=true", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(opened.status(), 200);
    let second = tokio::spawn(read_to_the_end(
        router.url.clone(),
        opened,
        second_seen.clone(),
    ));
    eventually(Duration::from_secs(20), "20 events read", || async {
        first_seen.lock().unwrap().len() >= 20 && second_seen.lock().unwrap().len() >= 20
    })
    .await;

    fault(redis).await;

    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    for (name, events) in [
        ("the creating client", &first),
        ("the other reader", &second),
    ] {
        let numbers: Vec<u64> = events
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(
            numbers,
            (0..events.len() as u64).collect::<Vec<_>>(),
            "{name}: each event exactly once, in order"
        );
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.completed", "{name}: {last}");
    }
    assert_eq!(first, second, "both readers were sent the same events");
    let done = &first.last().unwrap()["response"];
    assert_eq!(done["usage"]["output_tokens"], TOKENS);
    assert_eq!(output_text(done), streamed_output(&first));
    // The stored response is the one the readers were sent.
    let stored = long_client()
        .get(format!("{}/v1/responses/{id}", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(stored.status(), 200);
    assert_eq!(&stored.json::<Value>().await.unwrap(), done);
    // Generated once: one decode request reached the decoders.
    let mut made = Vec::new();
    for decoder in &engines[1..] {
        made.extend(decode_requests(decoder).await);
    }
    let summary: Vec<String> = made
        .iter()
        .map(|r| {
            format!(
                "{} epoch {} max {} emitted {} {}",
                r["path"],
                r["body"]["kv_transfer_params"]["resume_epoch"],
                r["body"]["max_tokens"],
                r["tokens_emitted"],
                r["outcome"]
            )
        })
        .collect();
    // Requests that generated (a continuation's try whose prefill hold was
    // gone emits nothing and is retried after a new prefill).
    let generating = made
        .iter()
        .filter(|r| r["tokens_emitted"].as_u64() > Some(0))
        .count();
    assert_eq!(generating, decodes, "decode requests: {summary:?}");
    if decodes == 1 {
        assert_eq!(made.len(), 1, "decode requests: {summary:?}");
    }
}

/// The generation requests a decoder served: completions, chat, and the
/// tokens API's generate (what a continuation from a checkpoint uses).
async fn decode_requests(decoder: &Proc) -> Vec<Value> {
    engine_requests(decoder)
        .await
        .into_iter()
        .filter(|r| {
            r["path"].as_str().is_some_and(|p| {
                p == "/v1/completions"
                    || p == "/v1/chat/completions"
                    || p == "/inference/v1/generate"
            })
        })
        .collect()
}

fn aof_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("connex-redis-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_past_the_lease_generates_once() {
    let dir = aof_dir("killed");
    let mut redis = Redis::start_persistent(&dir);
    one_generation_through(&mut redis, async |redis| {
        redis.kill();
        tokio::time::sleep(OUTAGE).await;
        redis.restart();
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_past_the_lease_generates_once() {
    let dir = aof_dir("frozen");
    let mut redis = Redis::start_persistent(&dir);
    one_generation_through(&mut redis, async |redis| {
        redis.signal("STOP");
        tokio::time::sleep(OUTAGE).await;
        redis.signal("CONT");
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_full_past_the_lease_generates_once() {
    let dir = aof_dir("full");
    let mut redis = Redis::start_persistent(&dir);
    one_generation_through(&mut redis, async |redis| {
        // Every write refused (noeviction), reads served, as a full store's.
        assert_eq!(
            redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]),
            "OK"
        );
        assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
        let refused = redis.cli(&["SET", "probe", "x"]);
        assert!(refused.contains("OOM"), "{refused}");
        tokio::time::sleep(OUTAGE).await;
        assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "0"]), "OK");
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A writer that lost its lease (frozen, or cut off from the store, past it)
/// while another replica took the response over and ended it: neither its
/// events and state nor its stored response overwrite what that one wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_past_its_lease_never_overwrites_the_end_another_wrote() {
    use connex_router::{
        AppendError, CheckpointWrite, LogState, RedisSettings, RedisStore, Stored,
    };
    let redis = Redis::start();
    let store = |lease_ms| {
        RedisStore::new(RedisSettings {
            url: redis.url.clone(),
            password: None,
            ca_file: None,
            prefix: "fence:".into(),
            ttl: Duration::from_secs(60),
            timeout: Duration::from_secs(2),
            lease: Duration::from_millis(lease_ms),
            max_bytes: 1 << 20,
            max_response_bytes: 1 << 20,
            fallback_count: 16,
        })
        .unwrap()
    };
    let (stale, taker) = (store(100), store(60_000));
    let event = |n: u64| ClientEvent::from_value(&json!({"type": "x", "sequence_number": n}));
    let running = LogState {
        tenant: "t".into(),
        response: json!({"status": "in_progress"}),
        done: false,
    };
    let whole = CheckpointWrite::Whole(r#"{"n": 1}"#);
    stale
        .append("resp_1", "stale", &running, &[event(0)], Some(whole), None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        taker.claim_expired("taker", 1, &[]).await.unwrap(),
        ["resp_1"]
    );
    // While the taker holds the lease, the stale writer's end is refused.
    let stale_end = Stored::new(
        serde_json::value::to_raw_value(&json!({"status": "completed", "by": "stale"})).unwrap(),
        &[],
        "t".into(),
    );
    assert!(matches!(
        stale.put_final("resp_1", "stale", &stale_end).await,
        Err(AppendError::Fenced)
    ));
    // The taker ends it (its stored response, then its done state: the lease goes).
    let end = Stored::new(
        serde_json::value::to_raw_value(&json!({"status": "completed", "by": "taker"})).unwrap(),
        &[],
        "t".into(),
    );
    taker.put_final("resp_1", "taker", &end).await.unwrap();
    let done = LogState {
        tenant: "t".into(),
        response: json!({"status": "completed", "by": "taker"}),
        done: true,
    };
    taker
        .append("resp_1", "taker", &done, &[event(1)], None, None)
        .await
        .unwrap();
    assert_eq!(redis.cli(&["EXISTS", "fence:{resp_1}:lease"]), "0");
    // No lease held now: the stale writer still may not write over the end.
    let late = LogState {
        tenant: "t".into(),
        response: json!({"status": "in_progress", "by": "stale"}),
        done: false,
    };
    assert!(matches!(
        stale
            .append("resp_1", "stale", &late, &[event(1), event(2)], None, None)
            .await,
        Err(AppendError::Fenced)
    ));
    assert!(matches!(
        stale.put_final("resp_1", "stale", &stale_end).await,
        Err(AppendError::Fenced)
    ));
    let state = stale.log_state("resp_1").await.unwrap().unwrap();
    assert!(state.done);
    assert_eq!(state.response["by"], "taker");
    assert_eq!(redis.cli(&["XLEN", "fence:{resp_1}:events"]), "2");
    let stored: Value =
        serde_json::from_str(&redis.cli(&["GET", "fence:{resp_1}:stored"])).unwrap();
    assert_eq!(stored["response"]["by"], "taker", "{stored}");
}

/// Redis gone for longer than a writer waits (20 leases): the writer gives
/// its generation up (its decoder stream closed, its readers let go without a
/// terminal event); once Redis is back, a replica (here the same one, whose
/// writer ended) takes it over from its last checkpoint, and the readers,
/// reattaching after their last event, read the rest to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_given_up_is_taken_over_and_its_readers_reattach() {
    let dir = aof_dir("given-up");
    let mut redis = Redis::start_persistent(&dir);
    // Lease 300 ms: given up after 6 s of a store down 8 s.
    let flags = [
        "--response-lease-ms",
        "300",
        "--response-store-timeout-ms",
        "100",
    ];
    generated_through(&mut redis, &flags, 2, async |redis| {
        redis.kill();
        tokio::time::sleep(Duration::from_secs(8)).await;
        redis.restart();
    })
    .await;
    let _ = std::fs::remove_dir_all(&dir);
}
