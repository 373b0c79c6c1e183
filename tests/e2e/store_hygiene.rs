//! The shared response store kept bounded and tidy, and read as input
//! (issue 40): two routers on one real Redis (Debian's redis-server) and the
//! same mock engines. A delete removes every key of a response and ends its
//! replays; a running response's keys live as long as it runs; readers on a
//! replica share its connections; a full store is counted; a response past
//! the store's byte bound fails; and what is read back from Redis (events,
//! checkpoints) is checked as a client's or an engine's data would be,
//! tampered with here by `redis-cli` as an attacker with access to Redis
//! would.

use crate::common::*;
use crate::responses::{create, get, reattach};
use crate::shared_responses::{id_of, output_text, replicas_with};
use serde_json::{json, Value};
use std::time::Duration;

/// The keys the store holds of response `id` (default prefix).
fn keys_of(redis: &Redis, id: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis
        .cli(&["--scan", "--pattern", &format!("connex:{{{id}}}*")])
        .lines()
        .map(str::to_string)
        .filter(|k| !k.is_empty())
        .collect();
    keys.sort();
    keys
}

/// `GET /v1/responses/{id}` with `query` through `router`: status and body.
async fn get_raw(router: &Proc, id: &str, query: &str) -> (u16, String) {
    let response = client()
        .get(format!("{}/v1/responses/{id}{query}", router.url))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

async fn delete(router: &Proc, id: &str) -> (u16, Value) {
    let response = client()
        .delete(format!("{}/v1/responses/{id}", router.url))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

/// Waits (bounded) until background response `id` is no longer running, as
/// `router` reads it; returns it.
async fn ended(router: &Proc, id: &str) -> Value {
    let running = |r: &Value| {
        ["queued", "in_progress"].contains(&r["status"].as_str().unwrap_or("in_progress"))
    };
    eventually(Duration::from_secs(60), "the response ended", || async {
        !running(&get(router, id).await.1)
    })
    .await;
    get(router, id).await.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_removes_every_key_and_ends_every_replay() {
    let redis = Redis::start();
    let (a, b, engines) = replicas_with(&redis, &[], &["--decode-us-per-token", "50000"]).await;

    // A background response still generating on A (on its first, slow
    // decoder), read on B as it is deleted through B: it stops, B's
    // reader's stream ends, and nothing of it is left.
    let body = json!({"model": "mock", "input": "Delete me running", "background": true,
                      "max_output_tokens": 400});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let reader = {
        let (url, id) = (b.url.clone(), id.clone());
        tokio::spawn(async move {
            let url = format!("{url}/v1/responses/{id}?stream=true");
            client()
                .get(url)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        })
    };
    eventually(Duration::from_secs(20), "events in the store", || async {
        redis.events_of(&id) >= 5
    })
    .await;
    let (status, deleted) = delete(&b, &id).await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["deleted"], true);
    let read = tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("the reader's stream ended")
        .unwrap();
    let events = sse_events(&read);
    assert_eq!(events[0]["type"], "response.created", "{read}");
    assert_eq!(keys_of(&redis, &id), Vec::<String>::new());
    for router in [&a, &b] {
        assert_eq!(get_raw(router, &id, "?stream=true").await.0, 404);
    }
    // Its generation stopped well short of 400 tokens.
    eventually(Duration::from_secs(10), "the decoders stopped", || async {
        let mut running = false;
        for decoder in &engines[1..] {
            running |= engine_requests(decoder)
                .await
                .iter()
                .any(|r| r["outcome"] == "running");
        }
        !running
    })
    .await;
    let mut emitted = Vec::new();
    for decoder in &engines[1..] {
        for request in engine_requests(decoder).await {
            emitted.push(request["tokens_emitted"].as_u64().unwrap_or_default());
        }
    }
    assert!(emitted.iter().all(|&n| n < 400), "{emitted:?}");

    // A finished background response made on A, deleted through B.
    let body = json!({"model": "mock", "input": "Delete me when done", "background": true,
                      "max_output_tokens": 5});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let all = reattach(&a, &id, None, usize::MAX).await;
    assert_eq!(all.last().unwrap()["type"], "response.completed");
    assert!(!keys_of(&redis, &id).is_empty());
    let (status, deleted) = delete(&b, &id).await;
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(keys_of(&redis, &id), Vec::<String>::new());
    // No replica reads or replays it again (A has its log in memory).
    for router in [&a, &b] {
        assert_eq!(get_raw(router, &id, "").await.0, 404);
        assert_eq!(get_raw(router, &id, "?stream=true").await.0, 404);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_running_longer_than_the_ttl_keeps_its_keys_and_is_taken_over() {
    let redis = Redis::start();
    let flags = ["--response-store-ttl", "3s", "--response-lease-ms", "600"];
    let (a, b, _engines) = replicas_with(&redis, &flags, &["--decode-us-per-token", "30000"]).await;
    let prompt = "Outlive the TTL";
    let (_, text) = create(
        &b,
        &json!({"model": "mock", "input": prompt, "max_output_tokens": 300}),
    )
    .await;
    let want: Value = serde_json::from_str(&text).unwrap();
    let body =
        json!({"model": "mock", "input": prompt, "background": true, "max_output_tokens": 300});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let origin = format!("connex:{{{id}}}:origin");
    // Past the TTL (3 s) of its keys' first write, A dies: B takes the
    // generation over from its origin and checkpoint, both still there.
    let all = crate::responses::read_across(&a, &b, &id, 5, async {
        tokio::time::sleep(Duration::from_millis(4500)).await;
        let ttl: i64 = redis.cli(&["TTL", &origin]).parse().unwrap();
        assert!(ttl > 0, "the origin's TTL: {ttl}");
        a.signal("KILL");
    })
    .await;
    let done = &all.last().unwrap()["response"];
    assert_eq!(all.last().unwrap()["type"], "response.completed", "{done}");
    assert_eq!(output_text(done), output_text(&want));
}

/// `connected_clients` of the server.
fn clients(redis: &Redis) -> u64 {
    redis
        .cli(&["INFO", "clients"])
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_of_another_replicas_response_share_connections() {
    let redis = Redis::start();
    let (a, b, _engines) = replicas_with(&redis, &[], &["--decode-us-per-token", "50000"]).await;
    let body = json!({"model": "mock", "input": "Read me many times", "background": true,
                      "max_output_tokens": 300});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    // One reader on B first (whatever B connects for reads is made), then
    // the count with twelve more open at once.
    assert_eq!(reattach(&b, &id, None, 3).await.len(), 3);
    let before = clients(&redis);
    let (got, mut reading) = tokio::sync::mpsc::channel(12);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut readers = Vec::new();
    for _ in 0..12 {
        let (url, got, mut stopped) = (
            format!("{}/v1/responses/{id}?stream=true", b.url),
            got.clone(),
            stopped.clone(),
        );
        readers.push(tokio::spawn(async move {
            let mut response = client().get(url).send().await.unwrap();
            assert_eq!(response.status(), 200);
            assert!(response.chunk().await.unwrap().is_some());
            got.send(()).await.unwrap();
            let _ = stopped.wait_for(|stop| *stop).await;
        }));
    }
    for _ in 0..12 {
        reading.recv().await.unwrap();
    }
    let during = clients(&redis);
    stop.send(true).unwrap();
    for reader in readers {
        reader.await.unwrap();
    }
    assert!(
        during <= before + 1,
        "{before} connections before twelve readers, {during} with them"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_is_counted_and_the_response_still_served() {
    let redis = Redis::start();
    let (a, _b, _engines) = replicas_with(&redis, &[], &[]).await;
    // Redis refuses every write (maxmemory reached, noeviction).
    assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK");
    let body =
        json!({"model": "mock", "input": "Store me in a full store", "max_output_tokens": 3});
    let (status, text) = create(&a, &body).await;
    assert_eq!(status, 200, "{text}");
    let id = id_of(&text);
    // Kept in A's memory meanwhile, and said: counted as the store full.
    assert_eq!(get(&a, &id).await.0, 200);
    let metrics = metrics_text(&a).await;
    assert!(
        metric(
            &metrics,
            "connex_response_store_full_total",
            &["op=\"put\""]
        ) >= 1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_past_the_stores_byte_bound_fails_and_stops() {
    let redis = Redis::start();
    let flags = ["--response-store-max-response-bytes", "20000"];
    let (a, b, engines) = replicas_with(&redis, &flags, &["--decode-us-per-token", "10000"]).await;
    let body = json!({"model": "mock", "input": "Write a lot", "background": true,
                      "max_output_tokens": 2000});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let all = reattach(&a, &id, None, usize::MAX).await;
    let last = all.last().unwrap();
    assert_eq!(last["type"], "response.failed", "{last}");
    let error = all.iter().find(|e| e["type"] == "error").unwrap();
    assert_eq!(error["code"], "response_too_large", "{error}");
    // Another replica reads it failed, with why.
    let failed = ended(&b, &id).await;
    assert_eq!(failed["status"], "failed", "{failed}");
    assert!(
        failed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("20000 bytes"),
        "{failed}"
    );
    let metrics = metrics_text(&a).await;
    assert_eq!(
        metric(
            &metrics,
            "connex_response_store_too_large_total",
            &["kind=\"background\""]
        ),
        1.0
    );
    let mut emitted = 0;
    for decoder in &engines[1..] {
        for request in engine_requests(decoder).await {
            emitted += request["tokens_emitted"].as_u64().unwrap_or_default();
        }
    }
    assert!(emitted < 2000, "{emitted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_whose_request_passes_the_stores_byte_bound_fails_unwritten() {
    let redis = Redis::start();
    let flags = ["--response-store-max-response-bytes", "20000"];
    let (a, b, _engines) = replicas_with(&redis, &flags, &["--decode-us-per-token", "20000"]).await;
    // Few events, but a request (the chat a takeover would continue) past
    // the bound on its own.
    let body = json!({"model": "mock", "input": "word ".repeat(5000), "background": true,
                      "max_output_tokens": 20});
    let (status, text) = create(&a, &body).await;
    assert_eq!(status, 200, "{text}");
    let id = id_of(&text);
    let all = reattach(&a, &id, None, usize::MAX).await;
    let last = all.last().unwrap();
    assert_eq!(last["type"], "response.failed", "{last}");
    let error = all.iter().find(|e| e["type"] == "error").unwrap();
    assert_eq!(error["code"], "response_too_large", "{error}");
    assert_eq!(ended(&b, &id).await["status"], "failed");
    // Its request was never written to the store.
    let origin = format!("connex:{{{id}}}:origin");
    assert_eq!(redis.cli(&["EXISTS", &origin]), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_response_past_the_per_response_bound_is_not_stored() {
    use connex_router::{RedisSettings, RedisStore, Stored};
    use serde_json::value::RawValue;
    let redis = Redis::start();
    // Room for it in the replica's own memory (`max_bytes`), not in the
    // store's bound per response.
    let store = RedisStore::new(RedisSettings {
        url: redis.url.clone(),
        password: None,
        ca_file: None,
        prefix: "final:".into(),
        ttl: Duration::from_secs(60),
        timeout: Duration::from_secs(2),
        lease: Duration::from_secs(60),
        max_bytes: 1 << 20,
        max_response_bytes: 1024,
        fallback_count: 16,
    })
    .unwrap();
    let stored = |text: &str| {
        let response = json!({"id": "x", "output_text": text}).to_string();
        Stored::new(RawValue::from_string(response).unwrap(), &[], String::new())
    };
    for (id, text, kept) in [
        ("resp_small", "x", "1"),
        ("resp_big", &"x".repeat(2000)[..], "0"),
    ] {
        store.put_final(id, "writer", &stored(text)).await.unwrap();
        let key = format!("final:{{{id}}}:stored");
        assert_eq!(redis.cli(&["EXISTS", &key]), kept, "{id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_that_cannot_reach_the_store_changes_nothing() {
    let dir = std::env::temp_dir().join(format!("connex-redis-delete-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut redis = Redis::start_persistent(&dir);
    let (a, b, _engines) = replicas_with(&redis, &[], &[]).await;
    let body = json!({"model": "mock", "input": "Delete me while the store is down",
                      "background": true, "max_output_tokens": 5});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let all = reattach(&a, &id, None, usize::MAX).await;
    assert_eq!(all.last().unwrap()["type"], "response.completed");
    redis.kill();
    let (status, refused) = delete(&a, &id).await;
    assert_eq!(status, 503, "{refused}");
    // Refused, it changed nothing: A still replays it whole.
    let (status, text) = get_raw(&a, &id, "?stream=true").await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(sse_events(&text), all);
    // The store back, the delete goes through, and nothing of it is left.
    redis.restart();
    eventually(
        Duration::from_secs(20),
        "the delete went through",
        || async { delete(&a, &id).await.0 == 200 },
    )
    .await;
    assert_eq!(keys_of(&redis, &id), Vec::<String>::new());
    // Gone on both replicas: 404 once each reaches the store again (B's
    // connection comes back at its next attempt: 503 until then, never 200).
    for router in [&a, &b] {
        eventually(
            Duration::from_secs(20),
            "the deleted one is 404",
            || async {
                let status = get_raw(router, &id, "?stream=true").await.0;
                assert!(status == 404 || status == 503, "{status}");
                status == 404
            },
        )
        .await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A background response made on A, whose key `what` (`checkpoint`,
/// `origin`; once past its prefill) is rewritten by `tamper` after A dies,
/// before B takes it over. Returns the response as B ends it, and the
/// routers and engines.
/// A background response's checkpoint as the store has it (a list: the
/// whole one, then its patches), as a takeover reads it.
pub(super) fn checkpoint_in(redis: &Redis, key: &str) -> Option<Value> {
    let parts: Vec<String> = redis
        .cli(&["LRANGE", key, "0", "-1"])
        .lines()
        .filter(|line| !line.is_empty())
        .map(str::to_string)
        .collect();
    connex_router::checkpoint_of(&parts).ok().flatten()
}

pub(super) async fn taken_over_tampered(
    redis: &Redis,
    what: &str,
    tamper: impl FnOnce(&mut Value),
) -> (Value, Proc, [Proc; 3]) {
    // A lease long enough to tamper before B claims.
    let flags = ["--response-lease-ms", "3000"];
    let (a, b, engines) = replicas_with(redis, &flags, &["--decode-us-per-token", "30000"]).await;
    let body = json!({"model": "mock", "input": "Tamper with me", "background": true,
                      "max_output_tokens": 200});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let key = format!("connex:{{{id}}}:checkpoint");
    eventually(
        Duration::from_secs(20),
        "a checkpoint past the prefill",
        || async {
            checkpoint_in(redis, &key).is_some_and(|c| c["decode"].is_object())
                && redis.events_of(&id) >= 5
        },
    )
    .await;
    a.signal("KILL");
    let key = format!("connex:{{{id}}}:{what}");
    if what == "checkpoint" {
        // Written again whole, tampered, as one part.
        let mut value = checkpoint_in(redis, &key).unwrap();
        tamper(&mut value);
        assert_eq!(redis.cli(&["DEL", &key]), "1");
        assert_eq!(redis.cli(&["RPUSH", &key, &value.to_string()]), "1");
        assert_eq!(redis.cli(&["EXPIRE", &key, "600"]), "1");
    } else {
        let mut value: Value = serde_json::from_str(&redis.cli(&["GET", &key])).unwrap();
        tamper(&mut value);
        let text = value.to_string();
        assert_eq!(redis.cli(&["SET", &key, &text, "KEEPTTL"]), "OK");
    }
    let done = ended(&b, &id).await;
    (done, b, engines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_naming_another_holder_is_not_continued() {
    let redis = Redis::start();
    let foreign = "127.0.0.1:9";
    let (done, _b, engines) = taken_over_tampered(&redis, "checkpoint", |checkpoint| {
        checkpoint["decode"]["kv_transfer_params"]["remote_ctrl"] = json!(foreign);
    })
    .await;
    assert_eq!(done["status"], "failed", "{done}");
    // No decoder was sent to pull from the address Redis named.
    for decoder in &engines[1..] {
        for request in engine_requests(decoder).await {
            assert_ne!(
                request["body"]["kv_transfer_params"]["remote_ctrl"], foreign,
                "{request}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_at_the_last_epoch_is_not_continued() {
    let redis = Redis::start();
    let (done, b, _engines) = taken_over_tampered(&redis, "checkpoint", |checkpoint| {
        checkpoint["decode"]["epoch"] = json!(u64::MAX);
    })
    .await;
    assert_eq!(done["status"], "failed", "{done}");
    assert_still_serves(&b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_read_back_is_held_to_a_clients() {
    let redis = Redis::start();
    let forged = "forged\r\nx-forged: 1";
    let (done, _b, engines) = taken_over_tampered(&redis, "origin", |origin| {
        origin["request_id"] = json!(forged);
    })
    .await;
    // Taken over under an id of its own, as a client's bad id would be.
    assert_eq!(done["status"], "incomplete", "{done}");
    assert_eq!(done["usage"]["output_tokens"], 200, "{done}");
    for decoder in &engines[1..] {
        for request in engine_requests(decoder).await {
            let id = request["request_id"].as_str().unwrap_or_default();
            assert!(!id.contains("forged"), "{request}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_read_back_are_checked_and_every_number_is_a_place() {
    let redis = Redis::start();
    let (a, b, _engines) = replicas_with(&redis, &[], &[]).await;
    let body = json!({"model": "mock", "input": "Read me back", "background": true,
                      "max_output_tokens": 4});
    let (_, text) = create(&a, &body).await;
    let id = id_of(&text);
    let all = reattach(&a, &id, None, usize::MAX).await;
    assert_eq!(all.last().unwrap()["type"], "response.completed");
    let n = all.len() as u64;
    let key = format!("connex:{{{id}}}:events");

    // Past the last number: nothing (on the replica that made it, and
    // through the store on the other).
    for router in [&a, &b] {
        let (status, text) = get_raw(
            router,
            &id,
            "?stream=true&starting_after=18446744073709551615",
        )
        .await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(sse_events(&text), Vec::<Value>::new());
    }

    // An event whose number is not its place (0 at place n): B's reader gets
    // the log once and an error, not the log again and again.
    assert_eq!(redis.events_of(&id), n);
    let entry = format!("0-{}", n + 1);
    let wrong = json!({"type": "response.output_text.delta", "sequence_number": 0}).to_string();
    assert_eq!(redis.cli(&["XADD", &key, &entry, "e", &wrong]), entry);
    let read = reattach(&b, &id, None, 3 * all.len()).await;
    assert_eq!(&read[..all.len()], &all[..]);
    assert_eq!(read.len(), all.len() + 1, "{read:?}");
    assert_eq!(read.last().unwrap()["type"], "error");
    assert_eq!(read.last().unwrap()["code"], "response_store_unavailable");

    // An event whose type would end its `event:` line and forge another (at
    // the next place: a stream never takes an id again).
    assert_eq!(redis.cli(&["XDEL", &key, &entry]), "1");
    let entry = format!("0-{}", n + 2);
    let forged = json!({"type": "x\n\nevent: response.completed\ndata: {\"forged\": true}",
                        "sequence_number": n + 1})
    .to_string();
    assert_eq!(redis.cli(&["XADD", &key, &entry, "e", &forged]), entry);
    let (status, text) = get_raw(&b, &id, "?stream=true").await;
    assert_eq!(status, 200);
    assert!(!text.contains("forged"), "{text}");
    let read = sse_events(&text);
    assert_eq!(&read[..all.len()], &all[..]);
    assert_eq!(read.last().unwrap()["code"], "response_store_unavailable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_whose_numbers_do_not_move_forward_cannot_be_taken_over_forever() {
    use connex_router::{ClientEvent, LogState, RedisSettings, RedisStore};
    let redis = Redis::start();
    let store = RedisStore::new(RedisSettings {
        url: redis.url.clone(),
        password: None,
        ca_file: None,
        prefix: "loop:".into(),
        ttl: Duration::from_secs(60),
        timeout: Duration::from_secs(2),
        lease: Duration::from_secs(60),
        max_bytes: 1 << 20,
        max_response_bytes: 1 << 20,
        fallback_count: 16,
    })
    .unwrap();
    let state = LogState {
        tenant: String::new(),
        response: json!({"status": "in_progress"}),
        done: false,
    };
    let first = ClientEvent::from_value(&json!({"type": "x", "sequence_number": 0}));
    store
        .append(
            "resp_loop",
            "writer",
            &state,
            &[first],
            Some(connex_router::CheckpointWrite::Whole("{}")),
            Some(&json!({})),
        )
        .await
        .unwrap();
    // Entry 0-2 (place 1) says it is event 0.
    let again = json!({"type": "x", "sequence_number": 0}).to_string();
    assert_eq!(
        redis.cli(&["XADD", "loop:{resp_loop}:events", "0-2", "e", &again]),
        "0-2"
    );
    // Bounded here so that the old endless loop fails the test, not hangs it.
    let taken = tokio::time::timeout(Duration::from_secs(20), store.taken("resp_loop"))
        .await
        .expect("taken() returned");
    let err = taken.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("sequence_number"), "{err}");

    // A log far past what its writer may write (the bound, 1 KiB here) is
    // not read whole into a replica's memory.
    let small = RedisStore::new(RedisSettings {
        url: redis.url.clone(),
        password: None,
        ca_file: None,
        prefix: "big:".into(),
        ttl: Duration::from_secs(60),
        timeout: Duration::from_secs(2),
        lease: Duration::from_secs(60),
        max_bytes: 1 << 20,
        max_response_bytes: 1024,
        fallback_count: 16,
    })
    .unwrap();
    let delta = "x".repeat(200);
    let events: Vec<ClientEvent> = (0..2000)
        .map(|n| {
            ClientEvent::from_value(&json!({"type": "x", "sequence_number": n, "delta": delta}))
        })
        .collect();
    small
        .append(
            "resp_big",
            "writer",
            &state,
            &events,
            Some(connex_router::CheckpointWrite::Whole("{}")),
            Some(&json!({})),
        )
        .await
        .unwrap();
    let err = small
        .taken("resp_big")
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("larger than"), "{err}");
}

/// Ids in the running set are read back from Redis: one that cannot be a
/// response's (forged there by whoever can write to Redis: a `}` or `:` in
/// it would name other keys, a long one would go into every key name
/// and log line) is refused before it names a key: never claimed, no lease
/// written for it, dropped from the set; a well-formed one beside it is
/// claimed as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_id_among_the_running_is_refused_before_it_names_a_key() {
    use connex_router::{RedisSettings, RedisStore};
    let redis = Redis::start();
    let store = RedisStore::new(RedisSettings {
        url: redis.url.clone(),
        password: None,
        ca_file: None,
        prefix: "connex:".into(),
        ttl: Duration::from_secs(60),
        timeout: Duration::from_secs(2),
        lease: Duration::from_secs(60),
        max_bytes: 1 << 20,
        max_response_bytes: 1 << 20,
        fallback_count: 16,
    })
    .unwrap();
    let long = "r".repeat(200);
    let forged = ["resp_a}:stored", "resp b", "resp_c:x", long.as_str()];
    for id in forged.iter().chain(&["resp_fine"]) {
        assert_eq!(redis.cli(&["ZADD", "connex:running", "0", id]), "1");
    }
    let won = store.claim_expired("claimer", 16, &[]).await.unwrap();
    assert_eq!(won, vec!["resp_fine".to_string()]);
    let leases: Vec<String> = redis
        .cli(&["--scan", "--pattern", "connex:*lease"])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(leases, vec!["connex:{resp_fine}:lease".to_string()]);
    assert_eq!(
        redis.cli(&["ZRANGE", "connex:running", "0", "-1"]),
        "resp_fine"
    );
}
