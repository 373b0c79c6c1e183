//! The server's lifecycle and limits (issue 13), on real processes: graceful
//! shutdown on SIGTERM, a slowloris client, a body that trickles, the
//! concurrency limit.

use crate::common::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Starts a stream and returns once its response headers are in.
async fn open_stream(router: &Proc, max_tokens: u32) -> reqwest::Response {
    let response = client()
        .post(format!("{}/v1/completions", router.url))
        .json(
            &json!({"model":"mock","prompt":"shutdown test","max_tokens":max_tokens,
                      "stream":true,"return_token_ids":true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response
}

async fn wait_exit(router: &mut Proc, limit: Duration) {
    let started = Instant::now();
    while !router.exited() {
        assert!(
            started.elapsed() < limit,
            "router still running after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_50_streams_finish_and_takes_no_new_connections() {
    let (mut router, [_prefill, _decode]) = pd_cluster(
        &["--shutdown-grace-s", "30"],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "40000"]),
        ],
    )
    .await;
    let mut streams = Vec::new();
    for _ in 0..50 {
        let url = router.url.clone();
        let (opened_tx, opened_rx) = tokio::sync::oneshot::channel();
        streams.push((
            opened_rx,
            tokio::spawn(async move {
                let response = client()
                    .post(format!("{url}/v1/completions"))
                    .json(
                        &json!({"model":"mock","prompt":"shutdown test","max_tokens":40,
                                  "stream":true,"return_token_ids":true}),
                    )
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
                let _ = opened_tx.send(());
                response.text().await.unwrap()
            }),
        ));
    }
    let mut tasks = Vec::new();
    for (opened, task) in streams {
        opened.await.unwrap();
        tasks.push(task);
    }
    router.signal("TERM");
    // New connections are refused at once (the listener is closed).
    let addr = router.url.trim_start_matches("http://").to_string();
    eventually(Duration::from_secs(2), "client listener closed", || {
        let addr = addr.clone();
        async move { std::net::TcpStream::connect(addr).is_err() }
    })
    .await;
    for task in tasks {
        let chunks = sse_events(&task.await.unwrap());
        assert_eq!(chunks.last().unwrap(), "[DONE]");
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "a stream was cut within the grace: {chunks:?}"
        );
        assert_eq!(streamed_token_ids(&chunks).len(), 40);
    }
    wait_exit(&mut router, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_grace_end_with_an_error_event() {
    let (mut router, [prefill, _decode]) = pd_cluster(
        &["--shutdown-grace-s", "1"],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "50000"]),
        ],
    )
    .await;
    let response = open_stream(&router, 400).await;
    // /ready turns 503 at once for a client already connected.
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let probe = client();
    let url = router.url.clone();
    let status = probe
        .get(format!("{url}/ready"))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200);
    let started = Instant::now();
    router.signal("TERM");
    // The signal is delivered asynchronously: probe on the kept-alive
    // connection until the answer is not 200, and note when.
    tokio::spawn(async move {
        loop {
            let reply = probe.get(format!("{url}/ready")).send().await;
            let status = reply.map(|r| r.status().as_u16()).ok();
            if status != Some(200) || started.elapsed() > Duration::from_secs(5) {
                let _ = ready_tx.send((status, started.elapsed()));
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let chunks = sse_events(&response.text().await.unwrap());
    let took = started.elapsed();
    assert!(took < Duration::from_secs(8), "cut after {took:?}");
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let error = chunks
        .iter()
        .find_map(|c| c.get("error"))
        .expect("an error event at the cut");
    assert!(error["message"].as_str().unwrap().contains("shutting down"));
    assert!(streamed_token_ids(&chunks).len() < 400);
    // The kept-alive probe connection was told 503 (or closed), while the
    // stream still flowed: at once, not at the end of the grace.
    let (status, when) = ready_rx.await.unwrap();
    assert_ne!(status, Some(200));
    assert!(
        when < took,
        "/ready still 200 after {when:?}; stream cut at {took:?}"
    );
    wait_exit(&mut router, Duration::from_secs(10)).await;
    // The cut stream's hold was released, not left to its lease.
    eventually(
        Duration::from_secs(5),
        "the prefill's hold released",
        || async { engine_stats(&prefill).await["holds"]["holds"] == 0 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_client_is_cut_at_the_header_read_timeout() {
    let router = router(&["--header-read-timeout-ms", "500"]);
    let addr = router.url.trim_start_matches("http://").to_string();
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 512];
    // Closed (EOF or reset, possibly after a 408), never left hanging.
    loop {
        match slow.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => continue,
        }
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(4), "connection held {took:?}");
    // Others are still served.
    assert_still_serves(&router).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_trickles_past_the_body_read_timeout_gets_408() {
    let router = router(&[
        "--body-read-timeout-ms",
        "500",
        "--max-concurrent-requests",
        "1",
        "--max-queue-wait-ms",
        "0",
    ]);
    let addr = router.url.trim_start_matches("http://").to_string();
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    // Headers in time, then 10 of the 100 bytes the body says it has.
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"model\": ",
    )
    .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&answer).contains("}}") {
        match slow.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"error\""), "{answer}");
    // Its concurrency permit was given back: the one slot serves again.
    assert_still_serves(&router).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_concurrency_limit_get_429_with_retry_after() {
    // No queue: past the limit is 429 at once (tenants.rs tests the queue).
    let (router, [_prefill, _decode]) = pd_cluster(
        &["--max-concurrent-requests", "2", "--max-queue-wait-ms", "0"],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "50000"]),
        ],
    )
    .await;
    let first = open_stream(&router, 60).await;
    let second = open_stream(&router, 60).await;
    let third = client()
        .post(format!("{}/v1/completions", router.url))
        .json(&json!({"model":"mock","prompt":"x","max_tokens":2}))
        .send()
        .await
        .unwrap();
    assert_eq!(third.status(), 429);
    assert!(third.headers().get("retry-after").is_some());
    let body: Value = third.json().await.unwrap();
    assert!(body["error"]["message"].is_string(), "{body}");
    // The probes are not limited; a finished stream frees its slot.
    let models = client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    drop(first);
    let _ = second.text().await.unwrap();
    eventually(Duration::from_secs(5), "a slot is free again", || async {
        post(
            &router,
            "/v1/completions",
            &json!({"model":"mock","prompt":"x","max_tokens":1}),
        )
        .await
        .0 == 200
    })
    .await;
}

/// The events of an SSE body as a client's SSE parser reads them: each
/// frame's `event:` name (none: `message`) and its `data:`, parsed (not
/// JSON, such as `[DONE]`: as its text).
fn sse_frames(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|frame| !frame.trim().is_empty())
        .map(|frame| {
            let mut name = "message".to_string();
            let mut data = String::new();
            for line in frame.lines() {
                if let Some(value) = line.strip_prefix("event:") {
                    name = value.trim().to_string();
                } else if let Some(value) = line.strip_prefix("data:") {
                    data.push_str(value.trim_start());
                }
            }
            (name, event_value(data.as_bytes()))
        })
        .collect()
}

/// Opens a stream on `path` with `body`; returns once its headers are in.
async fn open_on(router: &Proc, path: &str, body: &Value) -> reqwest::Response {
    let response = client()
        .post(format!("{}{path}", router.url))
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_cut_at_the_grace_end_in_their_own_protocol() {
    let (mut router, [_prefill, _decode]) = pd_cluster(
        &["--shutdown-grace-s", "1"],
        [
            ("prefill", &[]),
            ("decode", &["--decode-us-per-token", "50000"]),
        ],
    )
    .await;
    let message = open_on(
        &router,
        "/v1/messages",
        &json!({"model": "mock", "max_tokens": 400, "stream": true,
                "messages": [{"role": "user", "content": "cut me"}]}),
    )
    .await;
    let response = open_on(
        &router,
        "/v1/responses",
        &json!({"model": "mock", "input": "cut me", "max_output_tokens": 400, "stream": true}),
    )
    .await;
    let background = open_on(
        &router,
        "/v1/responses",
        &json!({"model": "mock", "input": "cut me", "max_output_tokens": 400,
                "stream": true, "background": true}),
    )
    .await;
    router.signal("TERM");
    let (message, response, background) = (
        message.text().await.unwrap(),
        response.text().await.unwrap(),
        background.text().await.unwrap(),
    );

    // Anthropic's SDKs dispatch on the event's name and end a stream on
    // `message_stop` or raise on `error`: one of them must end it, with the
    // name its data says, and nothing of OpenAI's shape.
    let frames = sse_frames(&message);
    for (name, data) in &frames {
        assert_eq!(data["type"].as_str(), Some(name.as_str()), "{message}");
    }
    let (last, data) = frames.last().unwrap();
    match last.as_str() {
        "message_stop" => {}
        "error" => {
            assert!(data["error"]["type"].is_string(), "{message}");
            assert!(
                data["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("shutting down"),
                "{message}"
            );
        }
        other => panic!("a message stream ended on `{other}`: {message}"),
    }
    assert!(frames.iter().any(|(name, _)| name == "content_block_delta"));

    // A Responses stream ends as the OpenAI SDK reads one: every event named
    // by its type and numbered on from the last, the last a terminal one.
    let frames = sse_frames(&response);
    let mut numbers = Vec::new();
    for (name, data) in &frames {
        assert_eq!(data["type"].as_str(), Some(name.as_str()), "{response}");
        numbers.push(data["sequence_number"].as_u64().unwrap());
    }
    assert!(numbers.windows(2).all(|w| w[0] < w[1]), "{numbers:?}");
    let (last, data) = frames.last().unwrap();
    assert_eq!(last, "response.failed", "{response}");
    assert_eq!(data["response"]["status"], "failed");
    let (before, error) = &frames[frames.len() - 2];
    assert_eq!(before, "error");
    assert!(error["message"].as_str().unwrap().contains("shutting down"));

    // A background response's follower is told in Responses' `error` event
    // (it reads on with `starting_after` from another replica).
    let frames = sse_frames(&background);
    for (name, data) in &frames {
        assert_eq!(data["type"].as_str(), Some(name.as_str()), "{background}");
    }
    let terminal = [
        "error",
        "response.completed",
        "response.failed",
        "response.incomplete",
    ];
    let (last, _) = frames.last().unwrap();
    assert!(terminal.contains(&last.as_str()), "{background}");
    wait_exit(&mut router, Duration::from_secs(10)).await;
}
