//! Router replicas sharing membership through a real etcd: registration,
//! heartbeats, drain and removal through any replica are seen by all; an etcd
//! outage fails no request and membership converges when etcd returns.

use crate::common::*;
use reqwest::Method;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox";

/// A router replica on `etcd` under `prefix`, with a heartbeat TTL.
fn replica(etcd_url: &str, prefix: &str, ttl_s: u64) -> Proc {
    replica_with(etcd_url, prefix, ttl_s, &[])
}

fn replica_with(etcd_url: &str, prefix: &str, ttl_s: u64, extra: &[&str]) -> Proc {
    let ttl_s = ttl_s.to_string();
    let mut flags = vec![
        "--etcd",
        etcd_url,
        "--etcd-prefix",
        prefix,
        "--heartbeat-ttl-s",
        &ttl_s,
    ];
    flags.extend_from_slice(extra);
    router(&flags)
}

/// Waits until the replica has listed etcd's membership.
async fn wait_connected(router: &Proc) {
    eventually(
        Duration::from_secs(10),
        "replica connected to etcd",
        || async { ready(router).await["membership"]["connected"] == true },
    )
    .await;
}

/// id -> state, as a replica's admin API shows them.
async fn states(router: &Proc) -> BTreeMap<String, String> {
    instances(router)
        .await
        .iter()
        .map(|i| {
            (
                i["id"].as_str().unwrap_or_default().to_string(),
                i["state"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

async fn state_of(router: &Proc, id: &str) -> Option<String> {
    states(router).await.get(id).cloned()
}

fn completion(max_tokens: u32) -> Value {
    json!({"model": "mock", "prompt": PROMPT, "max_tokens": max_tokens})
}

/// Sends a completion; returns (status, decoder id).
async fn complete(router: &Proc, max_tokens: u32) -> (u16, Option<String>) {
    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .json(&completion(max_tokens))
        .send()
        .await
        .expect("post");
    let decoder = response
        .headers()
        .get("x-connex-decoder")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let status = response.status().as_u16();
    let _ = response.bytes().await;
    (status, decoder)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_registered_on_a_is_routable_through_b_within_a_second() {
    let etcd = Etcd::start();
    let a = replica(&etcd.url, "/routable", 10);
    let b = replica(&etcd.url, "/routable", 10);
    wait_connected(&a).await;
    wait_connected(&b).await;
    // Engines that do not register themselves: the test registers them on A.
    let prefill = engine(None, "prefill", &[]);
    let decode = engine(None, "decode", &[]);

    // A prefill registers its holder's control address: the router uses a
    // prefill's hold only when the answer names that holder.
    let ctrl = engine_stats(&prefill).await["ctrl"].clone();
    let started = Instant::now();
    for (id, role, url, ctrl) in [
        ("p1", "prefill", &prefill.url, ctrl),
        ("d1", "decode", &decode.url, Value::Null),
    ] {
        let (status, reply) = admin(
            &a,
            Method::POST,
            "/admin/instances",
            Some(&json!({"id": id, "role": role, "url": url, "model": "mock", "ctrl": ctrl})),
        )
        .await;
        assert_eq!(status, 201, "{reply}");
    }
    let (status, decoder) = loop {
        let (status, decoder) = complete(&b, 4).await;
        if status == 200 || started.elapsed() > Duration::from_secs(1) {
            break (status, decoder);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let took = started.elapsed();
    assert_eq!(status, 200, "B could not route within 1 s ({took:?})");
    assert!(took <= Duration::from_secs(1), "took {took:?}");
    assert_eq!(decoder.as_deref(), Some("d1"));
    // Served by the engines A registered, not by anything B knew before.
    assert_eq!(engine_requests(&decode).await.len(), 1);
}

/// Registrations of one new id racing through both replicas: etcd's
/// transaction lets exactly one win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_first_registrations_through_two_replicas_have_one_winner() {
    let etcd = Etcd::start();
    let a = replica(&etcd.url, "/race", 10);
    let b = replica(&etcd.url, "/race", 10);
    wait_connected(&a).await;
    wait_connected(&b).await;
    for round in 0..3 {
        race_first_registrations(&[&a, &b], &format!("contested-{round}"), 16).await;
    }
}

/// etcd's count of leases granted (its own metrics; the name has moved
/// between releases).
async fn leases_granted(etcd: &Etcd) -> f64 {
    let text = client()
        .get(format!("{}/metrics", etcd.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| {
            line.strip_prefix("etcd_debugging_lease_granted_total ")
                .or_else(|| line.strip_prefix("etcd_debugging_server_lease_granted_total "))
        })
        .and_then(|n| n.trim().parse().ok())
        .expect("etcd counts the leases it grants")
}

/// Registrations refused because the id is taken cost etcd no lease. Before,
/// each of them was granted a lease first and had it revoked after: a flood
/// of refused registrations was two etcd writes each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_refused_as_taken_is_granted_no_lease() {
    let etcd = Etcd::start();
    let a = replica(&etcd.url, "/taken", 10);
    wait_connected(&a).await;
    let body = json!({"id": "d0", "role": "decode", "url": "http://127.0.0.1:9", "model": "m"});
    let (status, reply) = post_internal(&a, "/v1/instances", &body, None).await;
    assert!(status < 300, "{reply}");
    let before = leases_granted(&etcd).await;
    for port in 10..30 {
        let body = json!({"id": "d0", "role": "decode",
                          "url": format!("http://127.0.0.1:{port}"), "model": "m"});
        let (status, _) = post_internal(&a, "/v1/instances", &body, None).await;
        assert_eq!(status, 409);
    }
    assert_eq!(leases_granted(&etcd).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_on_b_stops_new_traffic_on_a_and_migrate_reaches_a() {
    let etcd = Etcd::start();
    let a = replica(&etcd.url, "/drain", 10);
    let b = replica(&etcd.url, "/drain", 10);
    let _prefill = engine(Some(&a), "prefill", &[]);
    // 20 ms per token: the stream opened below is still running while we drain.
    let d1 = engine(Some(&a), "decode", &["--decode-us-per-token", "20000"]);
    let d2 = engine(Some(&a), "decode", &["--decode-us-per-token", "20000"]);
    wait_ready(&a, 3).await;
    wait_ready(&b, 3).await;

    // A stream in flight through A on some decoder X.
    let stream = client()
        .post(format!("{}/v1/completions", a.url))
        .json(&json!({"model": "mock", "prompt": PROMPT, "max_tokens": 40, "stream": true}))
        .send()
        .await
        .expect("stream");
    assert_eq!(stream.status().as_u16(), 200);
    let busy = stream.headers()["x-connex-decoder"]
        .to_str()
        .unwrap()
        .to_string();
    let other = [instance_id(&a, &d1).await, instance_id(&a, &d2).await]
        .into_iter()
        .find(|id| *id != busy)
        .unwrap();

    let (status, reply) = admin(
        &b,
        Method::POST,
        &format!("/admin/instances/{busy}/drain"),
        None,
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["state"], "draining");
    let took = eventually(
        Duration::from_secs(1),
        "A sees the drain made on B",
        || async { state_of(&a, &busy).await.as_deref() == Some("draining") },
    )
    .await;
    eprintln!("drain on B reached A in {took:?}");

    for _ in 0..8 {
        let (status, decoder) = complete(&a, 2).await;
        assert_eq!(status, 200);
        assert_eq!(
            decoder.as_deref(),
            Some(other.as_str()),
            "A sent new work to the drained decoder"
        );
    }
    // The in-flight stream on the drained decoder finishes normally.
    let text = stream.text().await.expect("stream body");
    let chunks =
        connex_router::SseParser::default().push(bytes::Bytes::copy_from_slice(text.as_bytes()));
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert_eq!(chunks.last().map(|c| c.as_ref()), Some(&b"[DONE]"[..]));

    // Migrating (drain?migrate=true) made on B reaches A's instance in place, so
    // that A's streams on it learn of it.
    let (status, _) = admin(
        &b,
        Method::POST,
        &format!("/admin/instances/{other}/drain?migrate=true"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(1), "A sees migrating", || async {
        state_of(&a, &other).await.as_deref() == Some("migrating")
    })
    .await;
    // Activate through A is seen by B.
    let (status, _) = admin(
        &a,
        Method::POST,
        &format!("/admin/instances/{busy}/activate"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    eventually(Duration::from_secs(1), "B sees the activation", || async {
        state_of(&b, &busy).await.as_deref() == Some("ready")
    })
    .await;
    let (status, decoder) = complete(&b, 2).await;
    assert_eq!((status, decoder), (200, Some(busy)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_to_any_replica_keep_an_instance_and_it_vanishes_from_both_after_its_ttl() {
    let etcd = Etcd::start();
    let ttl = Duration::from_secs(2);
    // "hb" below has an address where nothing listens: no health probes, so
    // that only heartbeats decide whether it lives.
    let no_probes = ["--health-check-interval-ms", "0"];
    let a = replica_with(&etcd.url, "/ttl", 2, &no_probes);
    let b = replica_with(&etcd.url, "/ttl", 2, &no_probes);
    wait_connected(&a).await;
    wait_connected(&b).await;

    // Registered on A, kept alive only by heartbeats sent to B, for 2 TTLs.
    let (status, added) = admin(
        &a,
        Method::POST,
        "/admin/instances",
        Some(&json!({"id": "hb", "role": "decode", "url": "http://127.0.0.1:9", "model": "m"})),
    )
    .await;
    assert_eq!(status, 201);
    let credential = added["credential"].as_str().unwrap().to_string();
    let until = Instant::now() + 2 * ttl;
    while Instant::now() < until {
        let (status, reply) = post_internal(
            &b,
            "/v1/instances/hb/heartbeat",
            &json!({}),
            Some(&credential),
        )
        .await;
        assert_eq!(status, 200, "{reply}");
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    assert_eq!(state_of(&a, "hb").await.as_deref(), Some("ready"));
    assert_eq!(state_of(&b, "hb").await.as_deref(), Some("ready"));

    // A real engine registered on B, then killed: its heartbeats stop.
    let mut engine = engine(Some(&b), "decode", &["--model", "m"]);
    eventually(Duration::from_secs(5), "A sees the engine", || async {
        states(&a).await.len() == 2
    })
    .await;
    engine.kill();
    let stopped = Instant::now();
    // Heartbeats to "hb" stopped too. Both vanish from both replicas after the
    // TTL (etcd expires a lease within about a second past it).
    let took = eventually(
        ttl + Duration::from_secs(3),
        "both instances gone from both replicas",
        || async { states(&a).await.is_empty() && states(&b).await.is_empty() },
    )
    .await;
    assert!(
        stopped.elapsed() >= ttl / 2,
        "gone after {took:?}, before its TTL could pass"
    );
    // It has to register again: a heartbeat is refused as unknown.
    let (status, _) = post_internal(
        &a,
        "/v1/instances/hb/heartbeat",
        &json!({}),
        Some(&credential),
    )
    .await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_fails_no_request_and_membership_converges() {
    let mut etcd = Etcd::start();
    let a = Arc::new(replica(&etcd.url, "/outage", 3));
    let b = Arc::new(replica(&etcd.url, "/outage", 3));
    let _prefill = engine(Some(&a), "prefill", &[]);
    let _decode = engine(Some(&a), "decode", &[]);
    wait_ready(&a, 2).await;
    wait_ready(&b, 2).await;

    // Traffic through both replicas for the whole test (bounded in count and time).
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for router in [a.clone(), b.clone()] {
        let (stop, done) = (stop.clone(), done.clone());
        clients.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(40);
            for n in 0..2000 {
                if stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                    break;
                }
                let body = json!({"model": "mock", "prompt": PROMPT, "max_tokens": 8, "stream": n % 2 == 0});
                let response = client()
                    .post(format!("{}/v1/completions", router.url))
                    .json(&body)
                    .send()
                    .await;
                match response {
                    Ok(r) if r.status().is_success() => {
                        let text = r.text().await.unwrap_or_default();
                        if text.contains("\"error\"") || !text.contains("\"finish_reason\":\"length\"") {
                            failures.push(text);
                        }
                    }
                    Ok(r) => failures.push(format!("HTTP {}", r.status())),
                    Err(err) => failures.push(err.to_string()),
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
            failures
        }));
    }
    eventually(
        Duration::from_secs(10),
        "requests completing through both replicas",
        || async { done.load(Ordering::Relaxed) >= 10 },
    )
    .await;

    etcd.kill();
    eventually(
        Duration::from_secs(5),
        "A reports its membership stale",
        || async { ready(&a).await["membership"]["stale"] == true },
    )
    .await;
    let text = metrics_text(&b).await;
    assert!(
        text.lines().any(|l| l == "connex_registry_connected 0"),
        "B's metrics do not say etcd is unreachable"
    );
    let before = done.load(Ordering::Relaxed);
    // Writes cannot be made while etcd is away: said plainly, not lost silently.
    let (status, reply) = admin(
        &a,
        Method::POST,
        "/admin/instances",
        Some(&json!({"role": "decode", "url": "http://127.0.0.1:9", "model": "m"})),
    )
    .await;
    assert_eq!(status, 503, "{reply}");
    // An engine that comes up during the outage registers once etcd is back.
    let late = engine(Some(&b), "decode", &[]);
    // The outage lasts 1.5 s: the late engine's first registrations fail.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = done.load(Ordering::Relaxed) - before;
    assert!(during > 0, "no request completed while etcd was down");

    etcd.restart();
    let late_id = late.url.clone();
    eventually(
        Duration::from_secs(10),
        "both replicas reconnect and list the late engine",
        || {
            let (a, b, late) = (a.clone(), b.clone(), late_id.clone());
            async move {
                let (ra, rb) = (ready(&a).await, ready(&b).await);
                let seen = |list: Vec<Value>| {
                    list.iter()
                        .any(|i| i["url"] == late.as_str() && i["state"] == "ready")
                };
                ra["membership"]["connected"] == true
                    && rb["membership"]["connected"] == true
                    && seen(instances(&a).await)
                    && seen(instances(&b).await)
            }
        },
    )
    .await;
    assert_eq!(
        states(&a).await,
        states(&b).await,
        "replicas disagree after the outage"
    );
    assert_eq!(states(&a).await.len(), 3);
    assert_eq!(
        metric(&metrics_text(&a).await, "connex_registry_connected", &[]),
        1.0
    );
    tokio::time::sleep(Duration::from_millis(300)).await;

    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for c in clients {
        failures.extend(c.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} requests failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    eprintln!(
        "{} requests, {during} of them while etcd was down",
        done.load(Ordering::Relaxed)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_past_a_compaction_lists_again_and_converges() {
    let etcd = Etcd::start();
    let path = Proxy::start(&etcd.url).await;
    // A reaches etcd through a path the test can cut; C directly.
    let a = replica(&path.url, "/compact", 30);
    let c = replica(&etcd.url, "/compact", 30);
    wait_connected(&a).await;
    wait_connected(&c).await;
    let register = |id: &'static str| {
        let c = &c;
        async move {
            // A distinct (bare-origin) address per instance.
            let port = match id {
                "keep" => 9,
                "gone" => 10,
                _ => 11,
            };
            let body = json!({"id": id, "role": "decode", "url": format!("http://127.0.0.1:{port}"), "model": "m"});
            let (status, reply) = admin(c, Method::POST, "/admin/instances", Some(&body)).await;
            assert_eq!(status, 201, "{reply}");
        }
    };
    register("keep").await;
    register("gone").await;
    eventually(Duration::from_secs(2), "A sees both", || async {
        states(&a).await.len() == 2
    })
    .await;
    let relists = metric(
        &metrics_text(&a).await,
        "connex_registry_relists_total",
        &[],
    );

    path.set_open(false);
    eventually(
        Duration::from_secs(10),
        "A reports its membership stale",
        || async { ready(&a).await["membership"]["stale"] == true },
    )
    .await;
    // What A misses: a removal, a registration and a drain, then a compaction of
    // that history.
    let (status, _) = admin(&c, Method::DELETE, "/admin/instances/gone", None).await;
    assert_eq!(status, 204);
    register("new").await;
    let (status, _) = admin(&c, Method::POST, "/admin/instances/keep/drain", None).await;
    assert_eq!(status, 200);
    etcd.compact().await;
    // Routing state meanwhile: A still serves from its last view.
    assert_eq!(states(&a).await.len(), 2);

    path.set_open(true);
    let expected = BTreeMap::from([
        ("keep".to_string(), "draining".to_string()),
        ("new".to_string(), "ready".to_string()),
    ]);
    eventually(
        Duration::from_secs(10),
        "A converges on etcd's membership",
        || async {
            states(&a).await == expected && ready(&a).await["membership"]["connected"] == true
        },
    )
    .await;
    assert_eq!(states(&c).await, expected);
    let now = metric(
        &metrics_text(&a).await,
        "connex_registry_relists_total",
        &[],
    );
    assert!(now > relists, "A did not list again ({relists} -> {now})");
}

/// Replicas A and B sharing etcd, a prefill, a decoder `d0` with `d0_flags` and
/// a healthy `d1`, all registered on A. Round-robin over sorted ids sends each
/// fresh replica's first decode to `d0`.
async fn resume_cluster(
    etcd: &Etcd,
    prefix: &str,
    d0_flags: &[&str],
) -> (Proc, Proc, Proc, Proc, Proc) {
    let flags = |ttl: &str| {
        [
            "--etcd",
            etcd.url.as_str(),
            "--etcd-prefix",
            prefix,
            "--heartbeat-ttl-s",
            ttl,
            "--decode-policy",
            "round_robin",
        ]
        .map(str::to_string)
    };
    let a_flags = flags("2");
    let b_flags = flags("2");
    let a = router(&a_flags.iter().map(String::as_str).collect::<Vec<_>>());
    let b = router(&b_flags.iter().map(String::as_str).collect::<Vec<_>>());
    let prefill = engine(Some(&a), "prefill", &[]);
    let mut flags = vec!["--id", "d0"];
    flags.extend_from_slice(d0_flags);
    let d0 = engine(Some(&a), "decode", &flags);
    let d1 = engine(Some(&a), "decode", &["--id", "d1"]);
    wait_ready(&a, 3).await;
    wait_ready(&b, 3).await;
    (a, b, prefill, d0, d1)
}

/// Waits until `engine` has emitted `k` tokens of a running request.
async fn wait_tokens(engine: &Proc, k: usize) {
    eventually(Duration::from_secs(10), "d0 reached its token", || async {
        engine_requests(engine)
            .await
            .iter()
            .any(|r| r["tokens_emitted"].as_u64() >= Some(k as u64))
    })
    .await;
}

/// Streams a completion with token ids; returns (token ids, whole SSE text).
async fn stream_tokens(router: String, max_tokens: usize) -> (Vec<u32>, String) {
    let response = client()
        .post(format!("{router}/v1/completions"))
        .json(
            &json!({"model": "mock", "prompt": PROMPT, "max_tokens": max_tokens,
                      "stream": true, "return_token_ids": true}),
        )
        .send()
        .await
        .expect("stream");
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().await.expect("stream body");
    let chunks: Vec<Value> = connex_router::SseParser::default()
        .push(bytes::Bytes::copy_from_slice(text.as_bytes()))
        .iter()
        .filter_map(|data| serde_json::from_slice(data).ok())
        .collect();
    (streamed_token_ids(&chunks), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_resumed_by_a_after_a_decoder_death_while_b_keeps_serving() {
    use connex_mock_engine::model;
    let etcd = Etcd::start();
    // d0 dies (process exit) after its 6th token; paced so tokens reach A first.
    let (a, b, _prefill, d0, _d1) = resume_cluster(
        &etcd,
        "/resume",
        &[
            "--crash-after-tokens",
            "6",
            "--decode-us-per-token",
            "20000",
        ],
    )
    .await;
    let expected = model::generate(&model::tokenize(PROMPT), 24);

    let on_a = tokio::spawn(stream_tokens(a.url.clone(), 24));
    wait_tokens(&d0, 1).await;
    // B serves its own clients all along, before and after the death.
    let mut served_by_b = 0;
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let (status, reply) = post(
            &b,
            "/v1/completions",
            &json!({"model": "mock", "prompt": PROMPT, "max_tokens": 4, "return_token_ids": true}),
        )
        .await;
        assert_eq!(status, 200, "B failed a request: {reply}");
        assert_eq!(ids(&reply["choices"][0]["token_ids"]), expected[..4]);
        served_by_b += 1;
    }
    let (tokens, text) = on_a.await.unwrap();
    assert_eq!(
        tokens, expected,
        "A's resumed stream is not the uninterrupted one: {text}"
    );
    assert!(!text.contains("\"error\""), "{text}");
    let resumes = metric(&metrics_text(&a).await, "connex_resumes_total", &[]);
    assert!(resumes >= 1.0, "A counted no resume");
    assert!(served_by_b >= 5, "B served only {served_by_b}");
    // The dead decoder leaves both views after its TTL.
    eventually(
        Duration::from_secs(6),
        "d0 gone from both replicas",
        || async { state_of(&a, "d0").await.is_none() && state_of(&b, "d0").await.is_none() },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrate_drain_on_b_moves_a_stream_running_on_a() {
    use connex_mock_engine::model;
    let etcd = Etcd::start();
    // d0 stalls after 4 tokens and would hold the stream until A's stall timeout
    // (10 s by default): only the migration can finish it sooner.
    let (a, b, _prefill, d0, _d1) =
        resume_cluster(&etcd, "/migrate", &["--stall-after-tokens", "4"]).await;
    let expected = model::generate(&model::tokenize(PROMPT), 12);
    let on_a = tokio::spawn(stream_tokens(a.url.clone(), 12));
    wait_tokens(&d0, 4).await;
    let started = Instant::now();
    let (status, reply) = admin(
        &b,
        Method::POST,
        "/admin/instances/d0/drain?migrate=true",
        None,
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    let (tokens, text) = on_a.await.unwrap();
    let took = started.elapsed();
    assert_eq!(tokens, expected, "{text}");
    assert!(
        took < Duration::from_secs(5),
        "the stream moved only after {took:?}"
    );
    let text = metrics_text(&a).await;
    assert!(
        metric(&text, "connex_resumes_total", &["cause=\"migrate\""]) >= 1.0,
        "A did not count a migrate resume"
    );
}

/// Standard base64, for etcd's JSON gateway.
fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(TABLE[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_id_disagrees_with_its_key_is_ignored_and_counted() {
    let etcd = Etcd::start();
    let a = replica(&etcd.url, "/mismatch", 10);
    wait_connected(&a).await;
    let put = |key: &str, id: &str| {
        let record = json!({"id": id, "role": "decode", "url": "http://127.0.0.1:9",
                            "model": "mock", "state": "ready"});
        let body = json!({"key": base64(key.as_bytes()),
                          "value": base64(record.to_string().as_bytes())});
        let url = format!("{}/v3/kv/put", etcd.url);
        async move {
            let status = client()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status();
            assert!(status.is_success(), "etcd put: {status}");
        }
    };
    // A ghost: the key says "ghost", the record claims the id "victim".
    put("/mismatch/instances/ghost", "victim").await;
    put("/mismatch/instances/honest", "honest").await;
    eventually(
        Duration::from_secs(5),
        "the honest record applied",
        || async { state_of(&a, "honest").await.is_some() },
    )
    .await;
    let listed = states(&a).await;
    assert!(!listed.contains_key("victim"), "{listed:?}");
    assert!(!listed.contains_key("ghost"), "{listed:?}");
    let text = metrics_text(&a).await;
    assert!(
        metric(&text, "connex_registry_mismatched_records_total", &[]) >= 1.0,
        "{text}"
    );
}

/// Static instances (`--prefill`/`--decode`) are registered by every replica
/// at start. A replica starting later (a rolling restart, a scale-up) must
/// find them registered and leave them be: replacing them made every replica
/// see a new incarnation and cut the streams on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_starting_with_the_same_static_instances_cuts_no_stream() {
    let etcd = Etcd::start();
    let prefill = engine(None, "prefill", &[]);
    let decode = engine(None, "decode", &["--decode-us-per-token", "20000"]);
    let ctrl = engine_stats(&prefill).await["ctrl"]
        .as_str()
        .unwrap()
        .to_string();
    let prefill_flag = format!("{},{ctrl}", prefill.url);
    let statics = [
        "--prefill",
        prefill_flag.as_str(),
        "--decode",
        decode.url.as_str(),
        "--static-model",
        "mock",
    ];
    let a = replica_with(&etcd.url, "/statics", 10, &statics);
    wait_connected(&a).await;
    wait_ready(&a, 2).await;
    let stream = tokio::spawn({
        let url = a.url.clone();
        async move {
            let body = json!({"model":"mock","prompt":PROMPT,"max_tokens":100,"stream":true,"return_token_ids":true});
            let text = client()
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            sse_events(&text)
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = replica_with(&etcd.url, "/statics", 10, &statics);
    wait_connected(&b).await;
    let chunks = stream.await.unwrap();
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "{chunks:?}"
    );
    assert_eq!(streamed_token_ids(&chunks).len(), 100);
    let text = metrics_text(&a).await;
    let resumes: f64 = text
        .lines()
        .filter(|l| l.starts_with("connex_resumes_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(resumes, 0.0, "the stream was moved: {text}");
    assert_eq!(
        states(&b).await.values().filter(|s| *s == "ready").count(),
        2
    );
}
