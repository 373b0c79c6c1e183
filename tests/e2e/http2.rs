//! HTTP/2 from clients (`--http2`, h2c with prior knowledge) on real
//! processes: many streams on one connection with the same answers as
//! HTTP/1.1, a reset stream frees its slot and its hold, shutdown lets them
//! finish, neither a client that stops inside the preface nor an idle
//! connection holds a connection slot, and a rapid-reset flood is cut.

// Tests fail loudly on anything unexpected; that is what unwrap is for here.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// A client that speaks only HTTP/2 without TLS, all requests on one connection.
fn h2_client() -> reqwest::Client {
    reqwest::Client::builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model":"mock","prompt":prompt,"max_tokens":max_tokens,"stream":true,
           "return_token_ids":true})
}

/// Streams `body` with `client`; the protocol version and every event.
async fn stream_with(
    client: &reqwest::Client,
    router: &Proc,
    body: &Value,
) -> (reqwest::Version, Vec<Value>) {
    let response = client
        .post(format!("{}/v1/completions", router.url))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let version = response.version();
    (version, sse_events(&response.text().await.unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_share_one_connection_and_answer_as_http1() {
    let router = router(&["--http2"]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let _decode = engine(Some(&router), "decode", &["--decode-us-per-token", "5000"]);
    wait_ready(&router, 2).await;
    let h2 = h2_client();
    let streams: Vec<_> = (0..16)
        .map(|i| {
            let (h2, router_url) = (h2.clone(), router.url.clone());
            tokio::spawn(async move {
                let response = h2
                    .post(format!("{router_url}/v1/completions"))
                    .json(&completion(&format!("prompt {i}"), 24))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200);
                let version = response.version();
                (version, sse_events(&response.text().await.unwrap()))
            })
        })
        .collect();
    for (i, stream) in streams.into_iter().enumerate() {
        let (version, chunks) = stream.await.unwrap();
        assert_eq!(version, reqwest::Version::HTTP_2);
        assert_eq!(chunks.last().unwrap(), "[DONE]", "{chunks:?}");
        // An HTTP/1.1 client on the same router gets the same tokens.
        let (v1, over_h1) =
            stream_with(&client(), &router, &completion(&format!("prompt {i}"), 24)).await;
        assert_eq!(v1, reqwest::Version::HTTP_11);
        let tokens = streamed_token_ids(&chunks);
        assert_eq!(tokens.len(), 24);
        assert_eq!(tokens, streamed_token_ids(&over_h1));
        assert_eq!(streamed_text(&chunks), streamed_text(&over_h1));
    }
    // A non-stream request too.
    let reply = h2
        .post(format!("{}/v1/completions", router.url))
        .json(&json!({"model":"mock","prompt":"whole","max_tokens":3}))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.version(), reqwest::Version::HTTP_2);
    let body: Value = reply.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_flag_an_http2_client_is_not_served() {
    let router = router(&[]);
    let reply = h2_client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await;
    assert!(reply.is_err(), "served HTTP/2 without --http2: {reply:?}");
    // HTTP/1.1 is.
    let reply = client()
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_http2_stream_frees_its_slot_and_its_hold() {
    let router = router(&["--http2", "--max-concurrent-requests", "1"]);
    let prefill = engine(Some(&router), "prefill", &[]);
    let _decode = engine(Some(&router), "decode", &["--decode-us-per-token", "50000"]);
    wait_ready(&router, 2).await;
    let h2 = h2_client();
    let mut response = h2
        .post(format!("{}/v1/completions", router.url))
        .json(&completion("to be reset", 400))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.chunk().await.unwrap().is_some());
    // The one slot is taken: a second request on the same connection is 429.
    let second = h2
        .post(format!("{}/v1/completions", router.url))
        .json(&completion("second", 2))
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 429);
    // Dropping the response resets its stream (RST_STREAM), the connection
    // stays open.
    drop(response);
    eventually(Duration::from_secs(5), "the slot is free again", || async {
        let reply = h2
            .post(format!("{}/v1/completions", router.url))
            .json(&completion("after the reset", 2))
            .send()
            .await
            .unwrap();
        // Read to its end, so that it is not one more client gone.
        reply.status() == 200 && reply.text().await.unwrap().contains("[DONE]")
    })
    .await;
    eventually(
        Duration::from_secs(5),
        "the reset stream's hold released",
        || async { engine_stats(&prefill).await["holds"]["holds"] == 0 },
    )
    .await;
    // Counted as a request whose client went away.
    let text = metrics_text(&router).await;
    assert_eq!(
        metric(
            &text,
            "connex_requests_total",
            &["route=\"/v1/completions\"", "status=\"499\""]
        ),
        1.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_http2_streams_finish() {
    let mut router = router(&["--http2", "--shutdown-grace-s", "30"]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let _decode = engine(Some(&router), "decode", &["--decode-us-per-token", "40000"]);
    wait_ready(&router, 2).await;
    let h2 = h2_client();
    let mut streams = Vec::new();
    for i in 0..10 {
        let response = h2
            .post(format!("{}/v1/completions", router.url))
            .json(&completion(&format!("shutdown {i}"), 30))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        streams.push(tokio::spawn(response.text()));
    }
    router.signal("TERM");
    for stream in streams {
        let chunks = sse_events(&stream.await.unwrap().unwrap());
        assert_eq!(chunks.last().unwrap(), "[DONE]");
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "a stream was cut within the grace: {chunks:?}"
        );
        assert_eq!(streamed_token_ids(&chunks).len(), 30);
    }
    let started = Instant::now();
    while !router.exited() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "router still running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Connects to the router, sends `bytes`, and reads until the router closes
/// the connection; how long that took (at most 10 s). When `answer_pings`,
/// it is a live HTTP/2 peer with nothing to ask: it acknowledges the
/// router's SETTINGS and PINGs, so only an idle timeout closes it.
fn held_for(router: &Proc, bytes: &[u8], answer_pings: bool) -> Duration {
    let addr = router.url.trim_start_matches("http://").to_string();
    let mut socket = std::net::TcpStream::connect(&addr).unwrap();
    socket.write_all(bytes).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let started = Instant::now();
    let mut pending = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match socket.read(&mut buf) {
            Ok(0) | Err(_) => return started.elapsed(),
            Ok(_) if started.elapsed() > Duration::from_secs(10) => return started.elapsed(),
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
        // Whole frames: a 9-byte header (24-bit length, type, flags, stream).
        while answer_pings && pending.len() >= 9 {
            let len = usize::from(pending[0]) << 16
                | usize::from(pending[1]) << 8
                | usize::from(pending[2]);
            if pending.len() < 9 + len {
                break;
            }
            let frame: Vec<u8> = pending.drain(..9 + len).collect();
            let (kind, ack) = (frame[3], frame[4] & 1 == 1);
            match (kind, ack) {
                // SETTINGS: acknowledged with an empty SETTINGS ACK.
                (4, false) => socket.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).unwrap(),
                // PING: the same 8 bytes back with ACK.
                (6, false) => {
                    let mut pong = frame.clone();
                    pong[4] = 1;
                    socket.write_all(&pong).unwrap();
                }
                _ => {}
            }
        }
    }
}

/// RFC 9113 3.4: the client preface, then an empty SETTINGS frame.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_connections_that_stall_or_idle_are_closed() {
    let router = router(&[
        "--http2",
        "--header-read-timeout-ms",
        "500",
        "--http2-idle-timeout-s",
        "1",
    ]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let _decode = engine(Some(&router), "decode", &["--decode-us-per-token", "50000"]);
    wait_ready(&router, 2).await;
    // Stops inside the preface: which protocol it speaks is never told.
    let took = held_for(&router, &PREFACE[..10], false);
    assert!(
        took < Duration::from_secs(4),
        "partial preface held {took:?}"
    );
    // A live peer that asks nothing: closed at the idle timeout.
    let took = held_for(&router, PREFACE, true);
    assert!(
        took < Duration::from_secs(5),
        "idle connection held {took:?}"
    );
    // A stream longer than the idle timeout is not idle.
    let h2 = h2_client();
    let (_, chunks) = stream_with(&h2, &router, &completion("longer than idle", 40)).await;
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    assert_eq!(streamed_token_ids(&chunks).len(), 40);
    // Others are still served, over both protocols.
    let reply = h2
        .get(format!("{}/v1/models", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    let (status, _) = post(
        &router,
        "/v1/completions",
        &json!({"model":"nope","prompt":"x","max_tokens":1}),
    )
    .await;
    assert_eq!(status, 404);
}

/// One HTTP/2 frame: a 9-byte header (24-bit length, type, flags, stream id)
/// and its payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut frame = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rapid_reset_flood_is_cut_and_costs_no_permit() {
    let router = router(&["--http2", "--max-concurrent-requests", "4"]);
    let _prefill = engine(Some(&router), "prefill", &[]);
    let _decode = engine(Some(&router), "decode", &[]);
    wait_ready(&router, 2).await;
    // HEADERS (HPACK: :method GET, :scheme http, :path /v1/models, :authority
    // x; END_STREAM and END_HEADERS) then RST_STREAM (CANCEL), 500 times.
    let mut flood = PREFACE.to_vec();
    let mut headers = vec![0x82, 0x86, 0x44, 10];
    headers.extend_from_slice(b"/v1/models");
    headers.extend_from_slice(&[0x41, 1, b'x']);
    for i in 0..500u32 {
        let stream = 2 * i + 1;
        flood.extend(frame(1, 0x5, stream, &headers));
        flood.extend(frame(3, 0, stream, &8u32.to_be_bytes()));
    }
    let addr = router.url.trim_start_matches("http://").to_string();
    let mut socket = std::net::TcpStream::connect(&addr).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // The router may close before the whole flood is written.
    let _ = socket.write_all(&flood);
    let mut answer = Vec::new();
    let _ = socket.read_to_end(&mut answer);
    // Its frames: a GOAWAY (type 7) with ENHANCE_YOUR_CALM (0xb), the code
    // for too many resets (a malformed request would get PROTOCOL_ERROR or
    // COMPRESSION_ERROR).
    let mut rest = &answer[..];
    let mut goaway = None;
    while rest.len() >= 9 {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let payload = &rest[9..(9 + len).min(rest.len())];
        if rest[3] == 7 && payload.len() >= 8 {
            goaway = Some(payload[7]);
        }
        rest = &rest[(9 + len).min(rest.len())..];
    }
    assert_eq!(goaway, Some(0xb), "{} bytes back", answer.len());
    // No permit was leaked: all four still serve streams at once.
    let h2 = h2_client();
    let streams: Vec<_> = (0..4)
        .map(|i| {
            let (h2, url) = (h2.clone(), router.url.clone());
            tokio::spawn(async move {
                h2.post(format!("{url}/v1/completions"))
                    .json(&completion(&format!("after the flood {i}"), 8))
                    .send()
                    .await
                    .unwrap()
                    .status()
            })
        })
        .collect();
    for stream in streams {
        assert_eq!(stream.await.unwrap(), 200);
    }
}
