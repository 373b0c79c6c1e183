//! A shared endpoint (issue 32): client keys on every client route, tenants
//! with their own limits, fair admission past the router's slots, and a
//! tenants file reloaded under load. Part of the security binary (keys are
//! its edge), on real processes.

use crate::common::*;
use connex_router::{route_table, Listener};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEY_A: &str = "sk-tenant-a-0001";
const KEY_B: &str = "sk-tenant-b-0001";

/// A tenants file in a directory of the test's own.
struct TenantsFile {
    path: PathBuf,
}

impl TenantsFile {
    fn new(text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "connex-tenants-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let file = Self {
            path: dir.join("tenants.toml"),
        };
        file.write(text);
        file
    }

    /// Replaced whole, as a Secret's update or an editor's save would.
    fn write(&self, text: &str) {
        let next = self.path.with_extension("next");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, &self.path).unwrap();
    }

    fn arg(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }
}

impl Drop for TenantsFile {
    fn drop(&mut self) {
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn completion(max_tokens: u32, stream: bool) -> Value {
    json!({"model":"mock","prompt":"tenant test","max_tokens":max_tokens,"stream":stream})
}

async fn post_as(router: &Proc, key: Option<&str>, body: &Value) -> reqwest::Response {
    let mut request = client()
        .post(format!("{}/v1/completions", router.url))
        .json(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await.unwrap()
}

/// A router with `extra` flags, one mock prefill and one mock decoder whose
/// tokens take `decode_us` each.
async fn cluster(extra: &[&str], decode_us: &str) -> (Proc, Proc, Proc) {
    let decoder: &[&str] = &["--decode-us-per-token", decode_us];
    let (router, [prefill, decode]) =
        pd_cluster(extra, [("prefill", &[]), ("decode", decoder)]).await;
    (router, prefill, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_route_but_the_probes_takes_the_key() {
    let (router, _prefill, _decode) = cluster(&["--api-key", KEY_A], "0").await;
    let routes: Vec<_> = route_table()
        .into_iter()
        .filter(|(_, _, listener)| *listener == Listener::Client)
        .collect();
    assert!(routes.len() >= 5, "{routes:?}");
    let body = json!({"model":"mock","prompt":"x","max_tokens":2,
                      "messages":[{"role":"user","content":"x"}]});
    for (method, path, _) in routes {
        let call = |key: Option<(&'static str, String)>| {
            let mut request = client().request(method.clone(), format!("{}{path}", router.url));
            if method == reqwest::Method::POST {
                request = request.json(&body);
            }
            if let Some((header, value)) = key {
                request = request.header(header, value);
            }
            request.send()
        };
        let open = ["/health", "/ready"].contains(&path);
        for key in [
            None,
            Some(("authorization", "Bearer sk-wrong-key-0001".to_string())),
            Some(("authorization", format!("Bearer {KEY_A}x"))),
            Some(("authorization", KEY_A.to_string())),
        ] {
            let response = call(key.clone()).await.unwrap();
            if open {
                assert_eq!(response.status(), 200, "{path} is a probe");
                continue;
            }
            assert_eq!(response.status(), 401, "{method} {path} with {key:?}");
            let error: Value = response.json().await.unwrap();
            assert_eq!(error["error"]["type"], "authentication_error", "{error}");
        }
        for header in [
            ("authorization", format!("Bearer {KEY_A}")),
            ("x-api-key", KEY_A.to_string()),
        ] {
            let status = call(Some(header)).await.unwrap().status();
            assert_ne!(status, 401, "{method} {path} with the key");
            if ["/v1/completions", "/v1/chat/completions", "/v1/models"].contains(&path) {
                assert_eq!(status, 200, "{method} {path}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_is_ever_logged() {
    let (router, logs) = router_logged(&["--api-key", KEY_A, "--log-level", "debug"]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let _decode = engine(Some(&router), "decode", &[]);
    wait_ready(&router, 2).await;
    let served = post_as(&router, Some(KEY_A), &completion(2, false)).await;
    assert_eq!(served.status(), 200);
    let refused = post_as(&router, Some("sk-guessed-key-01"), &completion(2, false)).await;
    assert_eq!(refused.status(), 401);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let lines = logs.lines();
    assert!(
        lines.iter().any(|l| l.contains("tenant")),
        "access line names the tenant"
    );
    for line in lines {
        assert!(
            !line.contains(KEY_A) && !line.contains("sk-guessed"),
            "a key in the logs: {line}"
        );
    }
}

/// Two tenants whose clients keep `workers` requests each waiting: returns
/// how many each got served until `total` were.
async fn served_under_contention(router: &Proc, workers: usize, total: usize) -> (usize, usize) {
    let done = Arc::new(AtomicBool::new(false));
    let counts = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let mut tasks = tokio::task::JoinSet::new();
    for (tenant, key) in [(0, KEY_A), (1, KEY_B)] {
        for _ in 0..workers {
            let (done, counts, url) = (done.clone(), counts.clone(), router.url.clone());
            tasks.spawn(async move {
                let client = client();
                while !done.load(Ordering::Relaxed) {
                    let response = client
                        .post(format!("{url}/v1/completions"))
                        .bearer_auth(key)
                        .json(&completion(4, false))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(response.status(), 200);
                    let _ = response.bytes().await;
                    if done.load(Ordering::Relaxed) {
                        return;
                    }
                    let served = counts[tenant].fetch_add(1, Ordering::Relaxed) + 1;
                    if served + counts[1 - tenant].load(Ordering::Relaxed) >= total {
                        done.store(true, Ordering::Relaxed);
                    }
                }
            });
        }
    }
    while tasks.join_next().await.is_some() {}
    (
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_weighted_three_to_one_are_served_three_to_one() {
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\nweight = 3\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\nweight = 1\n"
    ));
    // Two slots, each request ~4 tokens of 2 ms on one decoder: both
    // tenants keep 8 waiting all the time.
    let (router, _prefill, _decode) = cluster(
        &[
            "--tenants-file",
            &file.arg(),
            "--max-concurrent-requests",
            "2",
        ],
        "2000",
    )
    .await;
    let (a, b) = served_under_contention(&router, 8, 320).await;
    let ratio = a as f64 / b.max(1) as f64;
    assert!(
        (2.2..=3.8).contains(&ratio),
        "a {a}, b {b}: ratio {ratio:.2}"
    );
    // Both waited: the queue-time histogram has their samples.
    let text = metrics_text(&router).await;
    for tenant in ["a", "b"] {
        let admitted = metric(
            &text,
            "connex_tenant_requests_total",
            &[&format!("tenant=\"{tenant}\"")],
        );
        assert!(admitted >= 50.0, "{tenant}: {admitted}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_max_concurrent_gets_429_while_the_other_is_served() {
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\nmax_concurrent = 2\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
    ));
    let (router, _prefill, _decode) = cluster(&["--tenants-file", &file.arg()], "20000").await;
    let first = post_as(&router, Some(KEY_A), &completion(100, true)).await;
    let second = post_as(&router, Some(KEY_A), &completion(100, true)).await;
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    let started = Instant::now();
    let third = post_as(&router, Some(KEY_A), &completion(2, false)).await;
    assert_eq!(third.status(), 429);
    assert!(third.headers().get("retry-after").is_some());
    let error: Value = third.json().await.unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_error", "{error}");
    assert!(started.elapsed() < Duration::from_secs(2), "429 at once");
    // The other tenant is served at once, beside a's two streams.
    let started = Instant::now();
    let other = post_as(&router, Some(KEY_B), &completion(2, false)).await;
    assert_eq!(other.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // A stream that ends gives its place back.
    drop(first);
    eventually(
        Duration::from_secs(5),
        "a is under its limit again",
        || async {
            post_as(&router, Some(KEY_A), &completion(2, false))
                .await
                .status()
                == 200
        },
    )
    .await;
    let text = metrics_text(&router).await;
    let rejected = metric(
        &text,
        "connex_tenant_rejections_total",
        &["tenant=\"a\"", "reason=\"max_concurrent\""],
    );
    assert!(rejected >= 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_minute_are_enforced_from_usage() {
    // 60 tokens a minute: one a second comes back.
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\ntokens_per_minute = 60\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
    ));
    let (router, _prefill, _decode) = cluster(&["--tenants-file", &file.arg()], "0").await;
    // 80 completion tokens: more than the minute's 60, settled from usage.
    let big = post_as(&router, Some(KEY_A), &completion(80, false)).await;
    assert_eq!(big.status(), 200);
    let usage: Value = big.json().await.unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 80);
    // The settlement runs as the response ends, just after its last byte.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let next = post_as(&router, Some(KEY_A), &completion(1, false)).await;
    assert_eq!(next.status(), 429);
    let retry: u64 = next.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // 20-odd tokens of debt at one a second.
    assert!((15..=60).contains(&retry), "retry after {retry}");
    let error: Value = next.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens per minute"),
        "{error}"
    );
    // The other tenant is not charged for it.
    assert_eq!(
        post_as(&router, Some(KEY_B), &completion(80, false))
            .await
            .status(),
        200
    );
    let text = metrics_text(&router).await;
    let completion_tokens = metric(
        &text,
        "connex_tenant_tokens_total",
        &["tenant=\"a\"", "kind=\"completion\""],
    );
    assert_eq!(completion_tokens, 80.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_applies_without_dropping_a_stream() {
    let file = TenantsFile::new(&format!("[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n"));
    let (router, _prefill, _decode) = cluster(&["--tenants-file", &file.arg()], "20000").await;
    // 300 tokens of 20 ms: the stream spans both reloads.
    let mut body = completion(300, true);
    body["return_token_ids"] = json!(true);
    let stream = post_as(&router, Some(KEY_A), &body).await;
    assert_eq!(stream.status(), 200);
    // a's key is rotated, b arrives; the change is picked up without a signal.
    file.write(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"sk-tenant-a-0002\"]\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
    ));
    eventually(Duration::from_secs(10), "the new file applies", || async {
        post_as(&router, Some(KEY_B), &completion(1, false))
            .await
            .status()
            == 200
    })
    .await;
    assert_eq!(
        post_as(&router, Some(KEY_A), &completion(1, false))
            .await
            .status(),
        401
    );
    // A bad file is refused on SIGHUP: the tenants in force stay.
    file.write("[[tenant]]\nname = \"a\"\nkeys = [\"short\"]\n");
    router.signal("HUP");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        post_as(&router, Some(KEY_B), &completion(1, false))
            .await
            .status(),
        200
    );
    // The stream admitted under the old key ran to its end.
    let text = stream.text().await.unwrap();
    let chunks = sse_events(&text);
    assert!(text.contains("[DONE]"), "{text}");
    assert_eq!(streamed_token_ids(&chunks).len(), 300, "{text}");
    assert!(!text.contains("\"error\""), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_is_its_tenants_alone() {
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
    ));
    let (router, _prefill, _decode) = cluster(&["--tenants-file", &file.arg()], "0").await;
    let created: Value = client()
        .post(format!("{}/v1/responses", router.url))
        .bearer_auth(KEY_A)
        .json(&json!({"model": "mock", "input": "a's secret question", "max_output_tokens": 3}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["id"].as_str().unwrap();
    let url = format!("{}/v1/responses/{id}", router.url);
    // Another tenant cannot read, continue or delete it: not found.
    let read = client().get(&url).bearer_auth(KEY_B).send().await.unwrap();
    assert_eq!(read.status(), 404);
    let continued = client()
        .post(format!("{}/v1/responses", router.url))
        .bearer_auth(KEY_B)
        .json(&json!({"model": "mock", "input": "and?", "previous_response_id": id}))
        .send()
        .await
        .unwrap();
    assert_eq!(continued.status(), 404);
    let deleted = client()
        .delete(&url)
        .bearer_auth(KEY_B)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 404);
    // Its own tenant can.
    let read = client().get(&url).bearer_auth(KEY_A).send().await.unwrap();
    assert_eq!(read.status(), 200);
    let again: Value = read.json().await.unwrap();
    assert_eq!(again["id"], created["id"]);
}

/// Every generation request `engines` recorded whose body carries `marker`
/// (in its prompt or messages), with its path; `marker` empty: every one.
async fn recorded_with(engines: &[&Proc], marker: &str) -> Vec<(String, Value)> {
    let mut found = Vec::new();
    for engine in engines {
        for record in engine_requests(engine).await {
            let path = record["path"].as_str().unwrap();
            let generation = path.ends_with("completions") || path == "/inference/v1/generate";
            let body = &record["body"];
            if generation && body.to_string().contains(marker) {
                found.push((record["path"].as_str().unwrap().to_string(), body.clone()));
            }
        }
    }
    found
}

async fn post_path_as(router: &Proc, key: &str, path: &str, body: &Value) -> (u16, String) {
    let response = client()
        .post(format!("{}{path}", router.url))
        .bearer_auth(key)
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_priority_never_jumps_a_prioritized_tenant() {
    // a is ranked before everyone (lower first); b has no priority of its own.
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\npriority = -5\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
    ));
    let (router, prefill, decode) = cluster(&["--tenants-file", &file.arg()], "0").await;
    // (key, what the client asks, what the engines may get).
    let cases = [
        (KEY_B, json!(i32::MIN), 0),
        (KEY_B, json!(-5), 0),
        (KEY_B, json!(7), 7),
        (KEY_A, json!(-100), -5),
        (KEY_A, json!(3), 3),
    ];
    for (i, (key, asked, sent)) in cases.iter().enumerate() {
        let marker = format!("priority case {i}");
        let body = json!({"model": "mock", "prompt": marker, "max_tokens": 2,
                          "priority": asked});
        let (status, text) = post_path_as(&router, key, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{text}");
        let records = recorded_with(&[&prefill, &decode], &marker).await;
        assert_eq!(records.len(), 2, "prefill and decode: {records:?}");
        for (path, body) in records {
            assert_eq!(body["priority"], json!(sent), "case {i} at {path}");
        }
    }
    // Not a number: refused, never passed on.
    let body = json!({"model": "mock", "prompt": "x", "max_tokens": 2, "priority": "high"});
    let (status, text) = post_path_as(&router, KEY_B, "/v1/completions", &body).await;
    assert_eq!(status, 400, "{text}");

    // The passed-through routes (embeddings, pooling, score, rerank) too:
    // the body goes as sent, its `priority` bounded (or the tenant's put in).
    let passed = [
        (KEY_B, Some(json!(i32::MIN)), Some(0)),
        (KEY_B, None, None),
        (KEY_A, Some(json!(-100)), Some(-5)),
        (KEY_A, None, Some(-5)),
    ];
    for (i, (key, asked, sent)) in passed.iter().enumerate() {
        let marker = format!("embedded case {i}");
        let mut body = json!({"model": "mock", "input": marker});
        if let Some(asked) = asked {
            body["priority"] = asked.clone();
        }
        let (status, text) = post_path_as(&router, key, "/v1/embeddings", &body).await;
        assert_eq!(status, 200, "{text}");
        let mut seen = Vec::new();
        for engine in [&prefill, &decode] {
            for record in engine_requests(engine).await {
                if record["path"] == "/v1/embeddings" && record["body"]["input"] == marker {
                    seen.push(record["body"].clone());
                }
            }
        }
        assert_eq!(seen.len(), 1, "case {i}: {seen:?}");
        assert_eq!(
            seen[0].get("priority").cloned(),
            sent.map(|p| json!(p)),
            "case {i}"
        );
        assert_eq!(seen[0]["input"], marker, "the rest as sent");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_is_charged_by_its_bytes() {
    // 60 tokens a minute each; a body of about 4,000 bytes is about 1,000
    // tokens.
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\ntokens_per_minute = 60\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\ntokens_per_minute = 60\n"
    ));
    let (router, _prefill, _decode) = cluster(&["--tenants-file", &file.arg()], "50000").await;
    let body = serde_json::to_vec(&json!({"model": "mock", "prompt": "word ".repeat(800),
                                          "max_tokens": 40, "stream": true}))
    .unwrap();
    // Sent in pieces, without a Content-Length (chunked).
    let chunked = |path: &str, key: &str, body: &[u8]| {
        let pieces: Vec<Result<Vec<u8>, std::io::Error>> =
            body.chunks(512).map(|c| Ok(c.to_vec())).collect();
        client()
            .post(format!("{}{path}", router.url))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                pieces,
            )))
            .send()
    };
    let streaming = chunked("/v1/completions", KEY_A, &body).await.unwrap();
    assert_eq!(streaming.status(), 200);
    assert!(streaming.headers().get("content-length").is_none());
    // While it runs, its bytes are charged: the tenant's minute is spent.
    let next = post_as(&router, Some(KEY_A), &completion(1, false)).await;
    assert_eq!(
        next.status(),
        429,
        "the chunked body was charged as one token"
    );
    let error: Value = next.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tokens per minute"),
        "{error}"
    );
    drop(streaming);
    // A passed-through route's body too (it has no usage to settle from).
    let embed =
        serde_json::to_vec(&json!({"model": "mock", "input": "word ".repeat(800)})).unwrap();
    let embedded = chunked("/v1/embeddings", KEY_B, &embed).await.unwrap();
    assert_eq!(embedded.status(), 200);
    let small = json!({"model": "mock", "input": "x"});
    let next = client()
        .post(format!("{}/v1/embeddings", router.url))
        .bearer_auth(KEY_B)
        .json(&small)
        .send()
        .await
        .unwrap();
    assert_eq!(
        next.status(),
        429,
        "the chunked body was charged as one token"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_isolated_tenant_has_its_own_cache_salt_at_every_engine() {
    let key_s = "sk-tenant-s-0001";
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\nkv_cache = \"isolated\"\n\n\
         [[tenant]]\nname = \"s\"\nkeys = [\"{key_s}\"]\nkv_cache = \"shared\"\n"
    ));
    let (router, prefill, decode) = cluster(&["--tenants-file", &file.arg()], "0").await;
    let engines = [&prefill, &decode];
    // (key, route, the client's own salt, the salt the engines may get).
    let cases: [(&str, &str, Option<&str>, Option<&str>); 7] = [
        (KEY_A, "/v1/completions", None, Some("tenant:a")),
        (KEY_B, "/v1/completions", None, Some("tenant:b")),
        // A client cannot leave its tenant's cache for another's.
        (
            KEY_B,
            "/v1/completions",
            Some("tenant:a"),
            Some("tenant:b|tenant:a"),
        ),
        (KEY_A, "/v1/chat/completions", None, Some("tenant:a")),
        // A sharing tenant's requests carry none, and its client cannot
        // name an isolated tenant's.
        (key_s, "/v1/completions", None, None),
        (
            key_s,
            "/v1/chat/completions",
            Some("tenant:a"),
            Some("client|tenant:a"),
        ),
        (KEY_A, "/v1/responses", None, Some("tenant:a")),
    ];
    for (i, (key, path, asked, sent)) in cases.iter().enumerate() {
        let marker = format!("salt case {i}");
        let mut body = match *path {
            "/v1/completions" => json!({"model": "mock", "prompt": marker, "max_tokens": 2}),
            "/v1/responses" => json!({"model": "mock", "input": marker, "max_output_tokens": 2}),
            _ => json!({"model": "mock", "max_tokens": 2,
                        "messages": [{"role": "user", "content": marker}]}),
        };
        if let Some(asked) = asked {
            body["cache_salt"] = json!(asked);
        }
        let (status, text) = post_path_as(&router, key, path, &body).await;
        assert_eq!(status, 200, "{text}");
        let records = recorded_with(&engines, &marker).await;
        assert_eq!(records.len(), 2, "prefill and decode: {records:?}");
        for (at, body) in records {
            assert_eq!(
                body.get("cache_salt").and_then(Value::as_str),
                *sent,
                "case {i} at {at}"
            );
        }
    }
    // A salt vLLM would refuse (its forbidden characters, or past its 128
    // characters once under the tenant's) is refused here, before any
    // engine sees the request.
    for (i, asked) in ["a/b".to_string(), "x".repeat(120)].iter().enumerate() {
        let marker = format!("refused salt {i}");
        let body = json!({"model": "mock", "prompt": marker, "max_tokens": 2,
                          "cache_salt": asked});
        let (status, text) = post_path_as(&router, KEY_A, "/v1/completions", &body).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("cache_salt"), "{text}");
        assert!(recorded_with(&engines, &marker).await.is_empty());
    }
    // Messages too.
    let body = json!({"model": "mock", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "salt messages"}]});
    let (status, text) = post_path_as(&router, KEY_A, "/v1/messages", &body).await;
    assert_eq!(status, 200, "{text}");
    for (at, body) in recorded_with(&engines, "salt messages").await {
        assert_eq!(body["cache_salt"], "tenant:a", "{at}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_chat_keeps_its_tenants_cache_salt() {
    let file = TenantsFile::new(&format!("[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n"));
    // d0 crashes after 10 tokens; d1 continues through vLLM's tokens API.
    let crashing = [
        "--crash-after-tokens",
        "10",
        "--decode-us-per-token",
        "1000",
    ];
    let (router, [prefill, _d0, d1]) =
        scale_out_cluster(&["--tenants-file", &file.arg()], &crashing).await;
    let body = json!({"model": "mock", "max_tokens": 30, "stream": true,
                      "messages": [{"role": "user", "content": "salt resumed"}]});
    let (status, text) = post_path_as(&router, KEY_A, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let chunks = sse_events(&text);
    assert!(chunks.iter().all(|c| c.get("error").is_none()), "{text}");
    // d1 saw only this request: its continuation, by token ids.
    let continued: Vec<(String, Value)> = recorded_with(&[&d1], "").await;
    assert!(
        continued
            .iter()
            .any(|(at, _)| at == "/inference/v1/generate"),
        "the second decoder continued the chat: {continued:?}"
    );
    for (at, body) in continued
        .iter()
        .chain(&recorded_with(&[&prefill], "salt resumed").await)
    {
        assert_eq!(body["cache_salt"], "tenant:a", "{at}");
    }
}

/// Blocks the router has indexed for `engine`.
async fn indexed_blocks(router: &Proc, engine: &Proc) -> u64 {
    instances(router)
        .await
        .iter()
        .find(|i| i["url"] == engine.url.as_str())
        .and_then(|i| i["prefix_index_blocks"].as_u64())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_cached_prefix_neither_serves_nor_draws_another_tenant() {
    let (key_s, key_t) = ("sk-tenant-s-0001", "sk-tenant-t-0001");
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n\n\
         [[tenant]]\nname = \"s\"\nkeys = [\"{key_s}\"]\nkv_cache = \"shared\"\n\n\
         [[tenant]]\nname = \"t\"\nkeys = [\"{key_t}\"]\nkv_cache = \"shared\"\n"
    ));
    // Two prefills with prefix caches (blocks of 16 byte-tokens) reporting KV
    // events, chosen by cached prefix.
    let cache: &[&str] = &["--prefix-cache-blocks", "4096", "--block-size", "16"];
    let (router, [p0, p1, _decode]) = pd_cluster(
        &[
            "--tenants-file",
            &file.arg(),
            "--prefill-policy",
            "cache_aware",
        ],
        [("prefill", cache), ("prefill", cache), ("decode", &[])],
    )
    .await;
    // A system prompt of 512 byte-tokens (32 blocks) every request shares.
    let system: String = (0..64).map(|i| format!("rule{i:03} ")).collect();
    let chat = |user: &str| {
        json!({"model": "mock", "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}]})
    };
    let cache_decisions = || async {
        metric(
            &metrics_text(&router).await,
            "connex_routing_decisions_total",
            &["phase=\"prefill\"", "reason=\"cache\""],
        )
    };
    // The prompt tokens the prefill that served `marker` computed itself.
    let computed = |marker: &'static str| {
        let engines = [&p0, &p1];
        async move {
            let records = recorded_with(&engines, marker).await;
            assert_eq!(records.len(), 1, "{records:?}");
            let mut found = None;
            for engine in engines {
                for record in engine_generations(engine).await {
                    if record["body"].to_string().contains(marker) {
                        found = Some(record["computed_prompt_tokens"].as_u64().unwrap());
                    }
                }
            }
            found.unwrap()
        }
    };
    // Tenant a's prompt, indexed under its salt on the prefill that ran it.
    let (status, text) =
        post_path_as(&router, KEY_A, "/v1/chat/completions", &chat("a first")).await;
    assert_eq!(status, 200, "{text}");
    let holder = if recorded_with(&[&p0], "a first").await.is_empty() {
        &p1
    } else {
        &p0
    };
    eventually(
        Duration::from_secs(5),
        "tenant a's blocks are indexed",
        || async { indexed_blocks(&router, holder).await >= 32 },
    )
    .await;
    // a's next prompt is drawn to them and served from them.
    let (status, text) =
        post_path_as(&router, KEY_A, "/v1/chat/completions", &chat("a again")).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(recorded_with(&[holder], "a again").await.len(), 1);
    assert!(computed("a again").await < 100);
    assert_eq!(cache_decisions().await, 1.0);
    // b's same prompt is neither drawn to a's prefix nor served from it.
    let (status, text) =
        post_path_as(&router, KEY_B, "/v1/chat/completions", &chat("b first")).await;
    assert_eq!(status, 200, "{text}");
    assert!(computed("b first").await >= 512, "b hit tenant a's cache");
    assert_eq!(cache_decisions().await, 1.0, "b was drawn to a's prefix");
    // Tenants that share on purpose share: t is served from s's prefix.
    let indexed =
        || async { indexed_blocks(&router, &p0).await + indexed_blocks(&router, &p1).await };
    eventually(
        Duration::from_secs(5),
        "tenant b's blocks are indexed",
        || async { indexed().await >= 64 },
    )
    .await;
    let before_s = indexed().await;
    let (status, text) =
        post_path_as(&router, key_s, "/v1/chat/completions", &chat("s first")).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        computed("s first").await >= 512,
        "s hit an isolated tenant's cache"
    );
    let before = cache_decisions().await;
    eventually(
        Duration::from_secs(5),
        "tenant s's blocks are indexed",
        || async { indexed().await >= before_s + 32 },
    )
    .await;
    let (status, text) =
        post_path_as(&router, key_t, "/v1/chat/completions", &chat("t first")).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        computed("t first").await < 100,
        "t did not share s's prefix"
    );
    assert_eq!(cache_decisions().await, before + 1.0);
}

/// `POST /v1/responses` as the tenant of `key`: its status and JSON.
async fn respond_as(router: &Proc, key: &str, body: &Value) -> (u16, Value) {
    let response = client()
        .post(format!("{}/v1/responses", router.url))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

async fn read_as(router: &Proc, key: &str, id: &str) -> u16 {
    client()
        .get(format!("{}/v1/responses/{id}", router.url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_stored_responses_never_evict_anothers() {
    // Issue 40, measured: tenant a storing 10,050 responses made tenant b's
    // one stored response 404 (the oldest went first, whoever's). Here the
    // store holds 8: b keeps 2 of its own (its file says), a fills the rest.
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\nmax_stored_responses = 2\n"
    ));
    let flags = ["--tenants-file", &file.arg(), "--max-stored-responses", "8"];
    let (router, _prefill, _decode) = cluster(&flags, "0").await;
    let body = json!({"model": "mock", "input": "keep me", "max_output_tokens": 1});
    let mut b = Vec::new();
    for _ in 0..3 {
        let (status, created) = respond_as(&router, KEY_B, &body).await;
        assert_eq!(status, 200, "{created}");
        b.push(created["id"].as_str().unwrap().to_string());
    }
    // Past b's own bound, its own oldest went.
    assert_eq!(read_as(&router, KEY_B, &b[0]).await, 404);
    let mut a = Vec::new();
    for _ in 0..20 {
        let (status, created) = respond_as(&router, KEY_A, &body).await;
        assert_eq!(status, 200, "{created}");
        a.push(created["id"].as_str().unwrap().to_string());
    }
    for id in &b[1..] {
        assert_eq!(read_as(&router, KEY_B, id).await, 200, "b's {id} stays");
    }
    // a gave up its own oldest to stay within the store.
    assert_eq!(read_as(&router, KEY_A, &a[0]).await, 404);
    assert_eq!(read_as(&router, KEY_A, &a[19]).await, 200);
    let kept = futures_util::future::join_all(a.iter().map(|id| read_as(&router, KEY_A, id)))
        .await
        .into_iter()
        .filter(|status| *status == 200)
        .count();
    assert_eq!(kept, 6, "the store's 8, less b's 2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_cannot_take_every_background_slot() {
    // Issue 40: one tenant could hold all of the router's background slots.
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\nmax_background_responses = 2\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
    ));
    let flags = [
        "--tenants-file",
        &file.arg(),
        "--max-background-responses",
        "3",
    ];
    // 200 tokens at 20 ms: each runs for about 4 s.
    let (router, _prefill, _decode) = cluster(&flags, "20000").await;
    let body = json!({"model": "mock", "input": "long", "background": true,
                      "max_output_tokens": 200});
    for _ in 0..2 {
        let (status, created) = respond_as(&router, KEY_A, &body).await;
        assert_eq!(status, 200, "{created}");
        assert_ne!(created["status"], "completed", "still running: {created}");
    }
    let (status, refused) = respond_as(&router, KEY_A, &body).await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["type"], "rate_limit_error", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tenant `a`"),
        "{refused}"
    );
    // b still gets the router's last slot.
    let (status, created) = respond_as(&router, KEY_B, &body).await;
    assert_eq!(status, 200, "{created}");
    let text = metrics_text(&router).await;
    let rejected = metric(
        &text,
        "connex_tenant_rejections_total",
        &["tenant=\"a\"", "reason=\"max_background_responses\""],
    );
    assert_eq!(rejected, 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_responses_are_admitted_like_requests() {
    // Issue 40: GET, DELETE and cancel under /v1/responses/{id} took no slot
    // and no tenant limit: a flood of readers held the router for nothing.
    let file = TenantsFile::new(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\nmax_concurrent = 3\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n"
    ));
    let (router, _prefill, _decode) = cluster(&["--tenants-file", &file.arg()], "20000").await;
    // A background generation holds one of a's three.
    let body = json!({"model": "mock", "input": "long", "background": true,
                      "max_output_tokens": 300});
    let (status, created) = respond_as(&router, KEY_A, &body).await;
    assert_eq!(status, 200, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let follow = || {
        client()
            .get(format!("{}/v1/responses/{id}?stream=true", router.url))
            .bearer_auth(KEY_A)
            .send()
    };
    // Two readers following it hold the other two.
    let first = follow().await.unwrap();
    let second = follow().await.unwrap();
    assert_eq!(
        (first.status().as_u16(), second.status().as_u16()),
        (200, 200)
    );
    // The next read of a's, of any kind, is refused at once.
    let third = follow().await.unwrap();
    assert_eq!(third.status(), 429);
    let error: Value = third.json().await.unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_error", "{error}");
    assert_eq!(read_as(&router, KEY_A, &id).await, 429);
    // b is not held by a's readers.
    let (status, other) = respond_as(
        &router,
        KEY_B,
        &json!({"model": "mock", "input": "x", "max_output_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{other}");
    assert_eq!(
        read_as(&router, KEY_B, other["id"].as_str().unwrap()).await,
        200
    );
    // A reader that leaves gives its place back.
    drop(first);
    eventually(Duration::from_secs(5), "a may read again", || async {
        read_as(&router, KEY_A, &id).await == 200
    })
    .await;
    let text = metrics_text(&router).await;
    let rejected = metric(
        &text,
        "connex_tenant_rejections_total",
        &["tenant=\"a\"", "reason=\"max_concurrent\""],
    );
    assert!(rejected >= 2.0, "{text}");
}
