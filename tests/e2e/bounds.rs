//! End-to-end bounds and fault detection on the request path, on real
//! processes: a decoder that never answers, one that trickles, one that breaks
//! the protocol, a 1 GiB error body, decoders killed and replaced under load,
//! and a burst that overflows a decoder's accept backlog. Each fails on a router
//! without the matching timeout, bound or detection rule.

use crate::common::*;
use connex_mock_engine::model;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const PROMPT: &str = "Bounded, always";

/// A streaming completions request of `tokens` tokens for `prompt`.
fn body(prompt: &str, tokens: usize) -> Value {
    json!({"model":"mock","prompt":prompt,"max_tokens":tokens,"stream":true,"return_token_ids":true})
}

/// Streams `prompt` through `router` and checks the client got exactly the
/// tokens of an uninterrupted run, and no chunk the request does not have.
async fn assert_token_exact(router: &Proc, prompt: &str, tokens: usize) {
    let chunks = stream(router, "/v1/completions", &body(prompt, tokens)).await;
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "{prompt}: {chunks:?}"
    );
    assert!(
        chunks
            .iter()
            .filter_map(|c| c["choices"].as_array())
            .flatten()
            .all(|c| c["index"] == 0),
        "a choice the request does not have reached the client: {chunks:?}"
    );
    assert_eq!(chunks.last(), Some(&json!("[DONE]")));
    assert_eq!(
        streamed_token_ids(&chunks),
        model::generate(&model::tokenize(prompt), tokens),
        "{prompt}"
    );
}

/// A router with a prefill, a faulty decoder `d0` (`faults`) and a healthy
/// `d1`; round-robin sends the first request to `d0`.
async fn cluster(router_flags: &[&str], faults: &[&str]) -> (Proc, [Proc; 3]) {
    failover_cluster(router_flags, faults, &[]).await
}

fn resumes(text: &str, cause: &str) -> f64 {
    metric(
        text,
        "connex_resumes_total",
        &[&format!("cause=\"{cause}\"")],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_that_accepts_and_never_answers_is_resumed() {
    let (router, _engines) = cluster(
        &["--decode-open-timeout-ms", "500"],
        &["--hang-before-headers"],
    )
    .await;
    assert_token_exact(&router, PROMPT, 8).await;
    let text = metrics_text(&router).await;
    assert_eq!(resumes(&text, "no_headers"), 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_decoder_is_cut_at_the_stall_timeout() {
    let (router, _engines) = cluster(
        &["--stall-timeout-ms", "500"],
        &["--trickle-after-tokens", "3"],
    )
    .await;
    let started = Instant::now();
    assert_token_exact(&router, PROMPT, 8).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    let text = metrics_text(&router).await;
    assert_eq!(resumes(&text, "stall"), 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_violating_chunk_is_never_relayed() {
    // d0 decodes slowly: a fast mock finished the request (and released its
    // hold) before the router had read the bad chunk, so the resume found the
    // hold gone, re-prefilled and could land on d0 again (2 protocol resumes).
    let (router, _engines) = cluster(
        &[],
        &[
            "--bad-chunk-after-tokens",
            "3",
            "--decode-us-per-token",
            "50000",
        ],
    )
    .await;
    assert_token_exact(&router, PROMPT, 8).await;
    let text = metrics_text(&router).await;
    assert_eq!(resumes(&text, "protocol"), 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1_gib_error_body_reaches_the_client_as_a_bounded_openai_error() {
    let (router, [_prefill, _decoder]) = pd_cluster(
        &[],
        [
            (
                "prefill",
                &["--fail-status", "400", "--fail-body-bytes", "1073741824"],
            ),
            ("decode", &[]),
        ],
    )
    .await;
    let started = Instant::now();
    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .json(&json!({"model":"mock","prompt":PROMPT,"max_tokens":4}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400, "the engine's status");
    let bytes = response.bytes().await.unwrap();
    assert!(bytes.len() < 16 * 1024, "bounded: {} bytes", bytes.len());
    let error: Value = serde_json::from_slice(&bytes).expect("an OpenAI error body");
    assert_eq!(error["error"]["code"], 400);
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("xxxx"));
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// The issue's churn: 48 greedy streams while a decoder is SIGKILLed and
/// replaced (by a new one, registered first) every half second or so, 4 live
/// decoders at any time. Killed decoders stay listed until their connection is
/// refused, a probe or the TTL catches up; connects that fail on them are not
/// resumes, so no stream runs out of `--max-resumes`.
///
/// The cadence follows the streams' progress, not the wall clock: a kill waits
/// until every live stream has received `TOKENS / 3` more tokens since the
/// last one, so no stream lives through more than 3 kills (each a real resume)
/// however slow the machine is. A wall-clock cadence let a stream slowed by a
/// loaded CI machine be hit by 4 kills, which `--max-resumes 3` rightly fails.
/// Streams start staggered so that kills go on for the whole run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_loses_no_stream_while_a_live_decoder_exists() {
    const STREAMS: usize = 48;
    const TOKENS: usize = 48;
    const TOKENS_BETWEEN_KILLS: usize = TOKENS / 3 + 1;
    let flags = |id: &str| {
        vec![
            "--id".to_string(),
            id.to_string(),
            "--decode-us-per-token".to_string(),
            "40000".to_string(),
        ]
    };
    let (router, prefill, mut decoders) = chaos_cluster(
        &["--heartbeat-ttl-s", "3", "--max-resumes", "3"],
        (0..4).map(|i| flags(&format!("d{i}"))),
    )
    .await;
    let start = |id: String| {
        let flags = flags(&id);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        engine(Some(&router), "decode", &flags)
    };
    let streams = TrackedStreams::start(
        &router,
        (0..STREAMS)
            .map(|i| {
                let prompt = format!("churn stream {i}");
                let request = body(&prompt, TOKENS);
                (prompt, request)
            })
            .collect(),
        Duration::from_millis(100),
    );
    let mut rng_state: u64 = 20261203;
    let mut next = 4;
    let mut kills = 0;
    let mut at_last_kill = streams.live();
    while !streams.all_finished() && kills < 30 {
        // Every stream live at the last kill has moved on by
        // TOKENS_BETWEEN_KILLS tokens since, or ended.
        streams.moved_on(&at_last_kill, TOKENS_BETWEEN_KILLS).await;
        if streams.all_finished() {
            break;
        }
        // The replacement first: 4 live decoders at any time.
        let replacement = start(format!("d{next}"));
        next += 1;
        let id = format!("d{}", next - 1);
        eventually(
            Duration::from_secs(10),
            "the replacement registered",
            || async {
                instances(&router)
                    .await
                    .iter()
                    .any(|i| i["id"] == id.as_str() && i["state"] == "ready")
            },
        )
        .await;
        rng_state = rng_state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let victim = (rng_state >> 33) as usize % decoders.len();
        at_last_kill = streams.live();
        decoders[victim].kill();
        decoders[victim] = replacement;
        kills += 1;
    }
    assert!(kills >= 3, "the streams ended before the churn began");
    for (prompt, chunks) in streams.results().await {
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "{prompt} after {kills} kills: {chunks:?}"
        );
        assert_eq!(
            streamed_token_ids(&chunks),
            model::generate(&model::tokenize(&prompt), TOKENS),
            "{prompt}"
        );
    }
    let text = metrics_text(&router).await;
    assert_eq!(
        metric(&text, "connex_requests_failed_after_resume_total", &[]),
        0.0,
        "{text}"
    );
    drop(prefill);
}

/// A TCP proxy in front of a decoder that serves the first `serve` connections
/// and then stops accepting, with a listen backlog of 1: later connects fill
/// the backlog and then time out, as a busy decoder's would, while the streams
/// already on it flow on.
async fn saturating_proxy(target: std::net::SocketAddr, serve: usize) -> String {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    let listener = socket.listen(1).unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        for _ in 0..serve {
            let (mut inbound, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut outbound = tokio::net::TcpStream::connect(target).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
        // Keep the listener (and its full backlog) open, accepting nothing.
        held.push(listener);
        std::future::pending::<()>().await;
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accept_backlog_burst_costs_only_the_requests_that_could_not_connect() {
    const FLOWING: usize = 4;
    const BURST: usize = 24;
    const TOKENS: usize = 40;
    let router = router(&[
        "--connect-timeout-ms",
        "300",
        "--decode-open-timeout-ms",
        "1000",
        "--health-check-interval-ms",
        "0",
        "--heartbeat-ttl-s",
        "60",
        "--decode-policy",
        "least_loaded",
    ]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    // d0 sits behind the proxy (registered by hand with the proxy's URL).
    let d0 = engine(None, "decode", &["--decode-us-per-token", "50000"]);
    let target = d0.url.trim_start_matches("http://").parse().unwrap();
    let proxy = saturating_proxy(target, FLOWING).await;
    let registered = client()
        .post(format!("{}/v1/instances", router.internal))
        .json(&json!({"role":"decode","url":proxy,"model":"mock","id":"d0"}))
        .send()
        .await
        .unwrap();
    assert_eq!(registered.status().as_u16(), 201);
    wait_ready(&router, 2).await;

    // FLOWING streams on d0, the only decoder, fill its accepted connections.
    let spawn = |i: usize| {
        let url = router.url.clone();
        tokio::spawn(async move {
            let prompt = format!("burst stream {i}");
            let text = client()
                .post(format!("{url}/v1/completions"))
                .json(&body(&prompt, TOKENS))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let chunks = sse_events(&text);
            (prompt, chunks)
        })
    };
    let mut streams: Vec<_> = (0..FLOWING).map(spawn).collect();
    eventually(
        Duration::from_secs(10),
        "the first streams flow",
        || async {
            journal(&router, false)
                .await
                .iter()
                .filter(|e| e["generated_tokens"].as_u64() > Some(0))
                .count()
                >= FLOWING
        },
    )
    .await;
    // Then a second decoder and a burst: d0 accepts nothing more.
    let _d1 = engine(Some(&router), "decode", &["--id", "d1"]);
    wait_ready(&router, 3).await;
    streams.extend((FLOWING..FLOWING + BURST).map(spawn));
    for stream in streams {
        let (prompt, chunks) = stream.await.unwrap();
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "{prompt}: {chunks:?}"
        );
        assert_eq!(
            streamed_token_ids(&chunks),
            model::generate(&model::tokenize(&prompt), TOKENS),
            "{prompt}"
        );
    }
    let text = metrics_text(&router).await;
    // The burst did overflow d0: some connects to it failed.
    assert!(
        metric(
            &text,
            "connex_upstream_errors_total",
            &["instance=\"d0\"", "kind=\"connect\""]
        ) >= 1.0,
        "{text}"
    );
    // The streams flowing on d0 were never moved: a connect timeout is not
    // evidence that d0 is gone.
    assert_eq!(resumes(&text, "dead"), 0.0, "{text}");
    // Only requests the kernel queued on d0's full backlog (never answered)
    // cost a resume; the rest went elsewhere without one.
    assert!(metric(&text, "connex_resumes_total", &[]) <= 2.0, "{text}");
}

/// The router process's peak resident memory (`VmHWM`), in bytes.
fn peak_rss(router: &Proc) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", router.pid())).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// A completions body whose prompt is `ids` token ids (about 2 bytes each as
/// JSON): the shape that took a router from 11 MB to 2.7 GB with four of them.
fn id_prompt_body(model: &str, ids: usize) -> Vec<u8> {
    let mut body = format!("{{\"model\":\"{model}\",\"max_tokens\":4,\"prompt\":[").into_bytes();
    for i in 0..ids {
        if i > 0 {
            body.push(b',');
        }
        body.push(b'0' + (i % 10) as u8);
    }
    body.extend_from_slice(b"]}");
    body
}

/// What a router may grow by, beyond the bodies it holds, while it serves a
/// few requests at once: its runtime's worker stacks and buffers, the
/// connections, the allocator's segments. Measured at 5-6 MiB in the two
/// tests below on a debug build (2026-12-07); the bound leaves room for a
/// busier host.
const ROUTER_WORKING_SET: u64 = 24 << 20;

/// The most a router may grow by while it holds `bodies` bytes of request
/// bodies: each held once (issue 40: at most ~1.2x their size while
/// admitted), plus [`ROUTER_WORKING_SET`].
fn held_once(bodies: u64) -> u64 {
    bodies + bodies / 5 + ROUTER_WORKING_SET
}

/// Sends `bodies` at once, each to its path, with a client patient enough
/// for a debug build reading and parsing them beside the rest of the suite
/// (it measures memory, not time: `client()`'s 30 s was too short for 120 MB
/// on two busy cores, 2026-12-06); the status and text of each answer.
async fn send_at_once(router: &Proc, bodies: Vec<(&'static str, Vec<u8>)>) -> Vec<(u16, String)> {
    let patient = reqwest::Client::builder()
        .timeout(Duration::from_secs(180))
        .build()
        .unwrap();
    let sends = bodies.into_iter().map(|(path, body)| {
        let url = format!("{}{path}", router.url);
        let patient = patient.clone();
        async move {
            let reply = patient
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = reply.status().as_u16();
            (status, reply.text().await.unwrap())
        }
    });
    futures_util::future::join_all(sends).await
}

/// Large bodies cost the router their size, once: a prompt of token ids or
/// a long chat history is kept as its text (never a tree of JSON values, the
/// old router's 32 bytes a token id), as a slice of the bytes read (not a
/// copy of them: 134 MiB for these bodies before, 119 MiB after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_request_bodies_cost_about_their_size() {
    let router = router(&[]);
    let base = peak_rss(&router);
    // 3 x 30 MB of token ids, and a 30 MB history of a million messages,
    // at once; the model is not served, so each is read, parsed and
    // validated whole, then refused.
    let ids = id_prompt_body("unserved", 15_000_000);
    let mut messages = b"{\"model\":\"unserved\",\"messages\":[".to_vec();
    for i in 0..1_000_000 {
        if i > 0 {
            messages.push(b',');
        }
        messages.extend_from_slice(b"{\"role\":\"user\",\"content\":\"a\"}");
    }
    messages.extend_from_slice(b"]}");
    let total = (3 * ids.len() + messages.len()) as u64;
    let replies = send_at_once(
        &router,
        vec![
            ("/v1/completions", ids.clone()),
            ("/v1/completions", ids.clone()),
            ("/v1/completions", ids),
            ("/v1/chat/completions", messages),
        ],
    )
    .await;
    for (status, text) in &replies {
        assert_eq!(*status, 404, "{text}");
        assert!(text.contains("`unserved` does not exist"), "{text}");
    }
    let grown = peak_rss(&router).saturating_sub(base);
    eprintln!(
        "the router grew by {} MiB for {} MiB of bodies",
        grown >> 20,
        total >> 20
    );
    assert!(
        grown < held_once(total),
        "the router grew by {} MiB for {} MiB of bodies (at most {} MiB)",
        grown >> 20,
        total >> 20,
        held_once(total) >> 20
    );
}

/// A completions body of `bytes` bytes whose large field reaches the engines
/// untouched: a JSON schema for structured output (`response_format`), its
/// description `bytes` long, beside a short prompt.
fn schema_body(prompt: &str, bytes: usize) -> Vec<u8> {
    let mut body = json!({"model": "mock", "prompt": prompt, "max_tokens": 4,
        "return_token_ids": true})
    .to_string()
    .into_bytes();
    body.pop();
    body.extend_from_slice(br#","response_format":{"type":"json_schema","json_schema":{"name":"big","schema":{"type":"string","description":""#);
    body.resize(body.len() + bytes, b'd');
    body.extend_from_slice(b"\"}}}}");
    body
}

/// A large body served through prefill and decode is held once: the prefill
/// and the decoder are sent the router's few changed fields around the
/// client's own bytes, not copies of them (four 30 MB bodies took a router
/// 290 MiB, 2.3x, when the body was kept and copied for each call). Each
/// engine got the client's large field whole, and each client its tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_is_held_once_through_prefill_and_decode() {
    const BODIES: usize = 4;
    // A decoder answers once it has read and parsed its 30 MB body, which
    // took the debug mock longer than the default `--decode-open-timeout`
    // (10 s) beside the rest of the suite: the router then resumed the
    // request, a fifth call. The decoder gets as long as the clients (the
    // prefill's bound for its whole call is 600 s): this test measures
    // memory, not speed.
    let router = router(&["--decode-open-timeout", "180s"]);
    // The engines record the 30 MB field as its length: their /mock/stats
    // would be 120 MB each, longer to serve and parse under load than a
    // client waits.
    let records = ["--max-records", "8", "--max-recorded-string", "4096"];
    let prefill = engine(Some(&router), "prefill", &records);
    let decoder = engine(Some(&router), "decode", &records);
    wait_ready(&router, 2).await;
    let base = peak_rss(&router);
    let bodies: Vec<(&'static str, Vec<u8>)> = (0..BODIES)
        .map(|i| {
            (
                "/v1/completions",
                schema_body(&format!("held once {i}"), 30_000_000),
            )
        })
        .collect();
    let total: u64 = bodies.iter().map(|(_, b)| b.len() as u64).sum();
    let replies = send_at_once(&router, bodies).await;
    for (i, (status, text)) in replies.iter().enumerate() {
        assert_eq!(*status, 200, "{}", &text[..text.len().min(500)]);
        let answer: Value = serde_json::from_str(text).unwrap();
        let prompt = format!("held once {i}");
        assert_eq!(
            answer["choices"][0]["token_ids"],
            json!(model::generate(&model::tokenize(&prompt), 4)),
            "{prompt}"
        );
    }
    let grown = peak_rss(&router).saturating_sub(base);
    eprintln!(
        "the router grew by {} MiB for {} MiB of bodies",
        grown >> 20,
        total >> 20
    );
    // Each engine had every body with its schema whole.
    for engine in [&prefill, &decoder] {
        let requests = engine_generations(engine).await;
        assert_eq!(requests.len(), BODIES, "{}", engine.url);
        for request in &requests {
            let schema = &request["body"]["response_format"]["json_schema"]["schema"];
            assert_eq!(schema["description"], "<30000000 bytes>");
        }
    }
    assert!(
        grown < held_once(total),
        "the router grew by {} MiB for {} MiB of bodies (at most {} MiB)",
        grown >> 20,
        total >> 20,
        held_once(total) >> 20
    );
}

/// Past `--max-inflight-body-bytes`, a request is refused with 503 and
/// Retry-After before its body is read; the budget comes back as requests end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_body_budget_refuses_past_it_and_comes_back() {
    use tokio::io::AsyncWriteExt;
    let router = router(&["--max-inflight-body-bytes", "50000000"]);
    let addr = router.url.trim_start_matches("http://").to_string();
    // Two clients that declare 20 MB and trickle it: 40 MB of the budget held.
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 20000000\r\n\r\n{\"model\":";
        stream.write_all(head.as_bytes()).await.unwrap();
        slow.push(stream);
    }
    // The answer to a request that declares 16 MB: only its head is sent
    // (a refused client never gets to send the rest).
    let declare = || {
        let addr = addr.clone();
        async move {
            use tokio::io::AsyncReadExt;
            let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 16000000\r\n\r\n";
            stream.write_all(head.as_bytes()).await.unwrap();
            let mut answer = vec![0; 4096];
            let read = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut answer)).await;
            match read {
                Ok(Ok(n)) => String::from_utf8_lossy(&answer[..n]).to_string(),
                // Waiting for the body: admitted.
                _ => String::new(),
            }
        }
    };
    // The slow clients' heads are in: they hold 40 MB.
    eventually(
        Duration::from_secs(20),
        "the slow bodies to hold the budget",
        || async {
            let text = metrics_text(&router).await;
            metric(&text, "connex_request_body_bytes_in_flight", &[]) == 40_000_000.0
        },
    )
    .await;
    let answer = declare().await.to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1\r\n"), "{answer}");
    assert!(
        answer.contains("bytes of request bodies in flight"),
        "{answer}"
    );
    // The clients give up: their share comes back.
    drop(slow);
    let body = id_prompt_body("unserved", 8_000_000);
    eventually(Duration::from_secs(20), "the budget to come back", || {
        let url = format!("{}/v1/completions", router.url);
        let body = body.clone();
        async move {
            let reply = client()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            reply.status() == 404
        }
    })
    .await;
}

/// A decoder that answers a token and then text without tokens, without end,
/// is a failed decoder: what it may send is bounded by the tokens it sent,
/// the request resumes elsewhere, and the router does not grow with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_flooding_text_without_tokens_is_cut_and_resumed() {
    let (router, _engines) = cluster(&[], &["--text-flood-after-tokens", "1"]).await;
    let base = peak_rss(&router);
    assert_token_exact(&router, PROMPT, 16).await;
    let text = metrics_text(&router).await;
    assert_eq!(resumes(&text, "protocol"), 1.0, "{text}");
    // It was cut after (1 + 8) x 16 KiB, not the 200 MB the old router relayed.
    let grown = peak_rss(&router).saturating_sub(base);
    assert!(grown < 64 << 20, "the router grew by {} MiB", grown >> 20);
}

/// A long prompt is no flood: the decoder's first chunk echoes the prompt's
/// token ids (hundreds of KiB for tens of thousands of tokens), which the
/// bound on bytes a token allows for. Before, a prompt past ~35k tokens on
/// the mocks was cut as a flooding decoder and resumed, again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompts_echoed_ids_are_not_a_flood() {
    let (router, _engines) = cluster(&[], &[]).await;
    let prompt: String = (0..40_000).map(|i| format!("w{i} ")).collect();
    assert_token_exact(&router, &prompt, 4).await;
    let text = metrics_text(&router).await;
    assert_eq!(resumes(&text, "protocol"), 0.0, "{text}");
}
