//! HTTP/2 from clients (`--http2`, h2c with prior knowledge) on real
//! processes: many streams on one connection with the same answers as
//! HTTP/1.1 (the internal listener stays HTTP/1.1), a reset stream frees its
//! slot and its hold, shutdown lets streams finish within the grace and cuts
//! them after it, a client that stops inside the preface and an idle
//! connection are closed while a long stream keeps its connection, and a
//! rapid-reset flood is cut. The raw-socket tests drive HTTP/2 frames by hand.

use crate::common::*;
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

/// GETs the client route `/v1/models` from the router at `url` with `client`.
async fn models(client: &reqwest::Client, url: &str) -> reqwest::Result<reqwest::Response> {
    client.get(format!("{url}/v1/models")).send().await
}

/// Streams one completion per prompt at once on `h2`; each answer's status,
/// protocol version and body, in the prompts' order.
async fn at_once(
    h2: &reqwest::Client,
    router: &Proc,
    prompts: &[String],
    max_tokens: u32,
) -> Vec<(u16, reqwest::Version, String)> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let request = h2
                .post(format!("{}/v1/completions", router.url))
                .json(&completion(prompt, max_tokens));
            tokio::spawn(async move {
                let response = request.send().await.unwrap();
                let (status, version) = (response.status().as_u16(), response.version());
                (status, version, response.text().await.unwrap())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for stream in streams {
        answers.push(stream.await.unwrap());
    }
    answers
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
    let (router, [_prefill, _decode]) =
        http2_cluster(&[], &["--decode-us-per-token", "5000"]).await;
    let h2 = h2_client();
    let prompts: Vec<String> = (0..16).map(|i| format!("prompt {i}")).collect();
    for (prompt, (status, version, text)) in prompts
        .iter()
        .zip(at_once(&h2, &router, &prompts, 24).await)
    {
        assert_eq!((status, version), (200, reqwest::Version::HTTP_2));
        let chunks = sse_events(&text);
        assert_eq!(chunks.last().unwrap(), "[DONE]", "{chunks:?}");
        // An HTTP/1.1 client on the same router gets the same tokens.
        let (v1, over_h1) = stream_with(&client(), &router, &completion(prompt, 24)).await;
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
    // A whole answer says its length, as over HTTP/1.1.
    assert!(reply.headers().get("content-length").is_some(), "{reply:?}");
    let body: Value = reply.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_flag_an_http2_client_is_not_served() {
    let router = router(&[]);
    let reply = models(&h2_client(), &router.url).await;
    assert!(reply.is_err(), "served HTTP/2 without --http2: {reply:?}");
    // HTTP/1.1 is.
    assert_eq!(models(&client(), &router.url).await.unwrap().status(), 200);
    // With the flag, the internal listener (registration, admin) still
    // speaks HTTP/1.1 only.
    let router = router_with_http2(&[]);
    let reply = h2_client()
        .get(format!("{}/metrics", router.internal))
        .send()
        .await;
    assert!(reply.is_err(), "internal listener served HTTP/2: {reply:?}");
    assert_eq!(
        models(&h2_client(), &router.url).await.unwrap().status(),
        200
    );
}

/// A router's flags: `--http2` and `extra`.
fn http2_flags<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [&["--http2"], extra].concat()
}

/// A router with `--http2` and `extra`.
fn router_with_http2(extra: &[&str]) -> Proc {
    router(&http2_flags(extra))
}

/// A router with `--http2` and `extra` (as [`router_with_http2`]), with a
/// prefill and a decoder (`decode_flags`), both registered and ready.
async fn http2_cluster(extra: &[&str], decode_flags: &[&str]) -> (Proc, [Proc; 2]) {
    pd_cluster(
        &http2_flags(extra),
        [("prefill", &[]), ("decode", decode_flags)],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_http2_stream_frees_its_slot_and_its_hold() {
    let (router, [prefill, _decode]) = http2_cluster(
        &["--max-concurrent-requests", "1", "--max-queue-wait-ms", "0"],
        &["--decode-us-per-token", "50000"],
    )
    .await;
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
    let (mut router, [_prefill, _decode]) = http2_cluster(
        &["--shutdown-grace-s", "30"],
        &["--decode-us-per-token", "40000"],
    )
    .await;
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

/// One HTTP/2 frame: a 9-byte header (24-bit length, type, flags, stream id)
/// and its payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut frame = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// Frame types and flags used here (RFC 9113 6).
const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

/// RFC 9113 3.4: the client preface, then an empty SETTINGS frame.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// A hand-driven HTTP/2 client on a raw socket: it sends what a test says and
/// reads the router's frames, acknowledging its SETTINGS and PINGs as a live
/// peer does (so that only what the test is about closes the connection).
struct RawPeer {
    socket: std::net::TcpStream,
    pending: Vec<u8>,
    started: Instant,
}

impl RawPeer {
    fn connect(router: &Proc, first: &[u8]) -> Self {
        let addr = router.url.trim_start_matches("http://").to_string();
        let mut socket = std::net::TcpStream::connect(&addr).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        // The router may close before all of it is written.
        let _ = socket.write_all(first);
        Self {
            socket,
            pending: Vec::new(),
            started: Instant::now(),
        }
    }

    /// The next frame (type, flags, stream, payload), acknowledging SETTINGS
    /// and PINGs on the way; `None` once the router has closed the connection
    /// or after 10 s.
    fn next(&mut self, answer_pings: bool) -> Option<(u8, u8, u32, Vec<u8>)> {
        loop {
            if self.pending.len() >= 9 {
                let len = usize::from(self.pending[0]) << 16
                    | usize::from(self.pending[1]) << 8
                    | usize::from(self.pending[2]);
                if self.pending.len() >= 9 + len {
                    let raw: Vec<u8> = self.pending.drain(..9 + len).collect();
                    let (kind, flags) = (raw[3], raw[4]);
                    let stream = u32::from_be_bytes([raw[5], raw[6], raw[7], raw[8]]) & 0x7fff_ffff;
                    if answer_pings && kind == SETTINGS && flags & 1 == 0 {
                        let _ = self.socket.write_all(&frame(SETTINGS, 1, 0, &[]));
                    }
                    if answer_pings && kind == PING && flags & 1 == 0 {
                        let _ = self.socket.write_all(&frame(PING, 1, 0, &raw[9..]));
                    }
                    return Some((kind, flags, stream, raw[9..].to_vec()));
                }
            }
            if self.started.elapsed() > Duration::from_secs(10) {
                return None;
            }
            let mut buf = [0u8; 4096];
            match self.socket.read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(err) if err.kind() == std::io::ErrorKind::TimedOut => continue,
                Err(_) => return None,
            }
        }
    }

    /// Reads until the router closes the connection (at most 10 s); how long
    /// that took.
    fn held_for(&mut self, answer_pings: bool) -> Duration {
        while self.next(answer_pings).is_some() {}
        self.started.elapsed()
    }
}

/// HPACK (RFC 7541) for a request's pseudo-headers: `:method` (static index
/// 2 GET, 3 POST), `:scheme http`, `:path` and `:authority x` as literals.
fn request_headers(post: bool, path: &str) -> Vec<u8> {
    let mut block = vec![if post { 0x83 } else { 0x82 }, 0x86, 0x04, path.len() as u8];
    block.extend_from_slice(path.as_bytes());
    block.extend_from_slice(&[0x01, 1, b'x']);
    if post {
        block.push(0x0f);
        block.push(0x10); // content-type (static index 31)
        block.push(16);
        block.extend_from_slice(b"application/json");
    }
    block
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_connections_that_stall_or_idle_are_closed() {
    let router = router_with_http2(&[
        "--header-read-timeout-ms",
        "500",
        "--http2-idle-timeout-s",
        "1",
    ]);
    // Stops inside the preface: which protocol it speaks is never told.
    let took = RawPeer::connect(&router, &PREFACE[..10]).held_for(false);
    assert!(
        took < Duration::from_secs(4),
        "partial preface held {took:?}"
    );
    // A live peer that asks nothing: closed at the idle timeout.
    let took = RawPeer::connect(&router, PREFACE).held_for(true);
    assert!(
        took < Duration::from_secs(5),
        "idle connection held {took:?}"
    );
    // Others are still served, over both protocols.
    assert_eq!(
        models(&h2_client(), &router.url).await.unwrap().status(),
        200
    );
    assert_still_serves(&router).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_idle_timeout_keeps_its_connection() {
    let (router, [_prefill, _decode]) = http2_cluster(
        &["--http2-idle-timeout-s", "1"],
        &["--decode-us-per-token", "50000"],
    )
    .await;
    // One POST of ~2.5 s on stream 1; the connection must not be told to go
    // away (GOAWAY) before that stream has ended.
    let body = serde_json::to_vec(&completion("longer than idle", 50)).unwrap();
    let mut first = PREFACE.to_vec();
    first.extend(frame(
        HEADERS,
        END_HEADERS,
        1,
        &request_headers(true, "/v1/completions"),
    ));
    first.extend(frame(DATA, END_STREAM, 1, &body));
    let mut peer = RawPeer::connect(&router, &first);
    let (mut text, mut ended) = (Vec::new(), false);
    while let Some((kind, flags, stream, payload)) = peer.next(true) {
        assert_ne!(kind, GOAWAY, "told to go away with a stream in flight");
        assert_ne!(kind, RST_STREAM, "stream reset");
        if kind == DATA && stream == 1 {
            text.extend_from_slice(&payload);
            if flags & END_STREAM != 0 {
                ended = true;
                break;
            }
        }
    }
    assert!(
        ended,
        "the stream did not end: {}",
        String::from_utf8_lossy(&text)
    );
    let chunks = sse_events(&String::from_utf8_lossy(&text));
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    assert_eq!(streamed_token_ids(&chunks).len(), 50);
    // Then, idle, it is closed.
    let took = peer.held_for(true);
    assert!(
        took < Duration::from_secs(9),
        "idle connection held {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_past_the_grace_end_with_an_error_event() {
    let (router, [_prefill, _decode]) = http2_cluster(
        &["--shutdown-grace-s", "1"],
        &["--decode-us-per-token", "50000"],
    )
    .await;
    let response = h2_client()
        .post(format!("{}/v1/completions", router.url))
        .json(&completion("cut at the grace", 400))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    router.signal("TERM");
    let chunks = sse_events(&response.text().await.unwrap());
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let error = chunks
        .iter()
        .find_map(|c| c.get("error"))
        .expect("an error event at the cut");
    assert!(error["message"].as_str().unwrap().contains("shutting down"));
    assert!(streamed_token_ids(&chunks).len() < 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rapid_reset_flood_is_cut_and_costs_no_permit() {
    // No queue: a leaked slot shows as a 429, not as a wait.
    let (router, [_prefill, _decode]) = http2_cluster(
        &["--max-concurrent-requests", "4", "--max-queue-wait-ms", "0"],
        &[],
    )
    .await;
    // Completions requests (gated by the concurrency limit), each HEADERS
    // with no body yet then RST_STREAM (CANCEL), 500 times.
    let mut flood = PREFACE.to_vec();
    let headers = request_headers(true, "/v1/completions");
    for i in 0..500u32 {
        let stream = 2 * i + 1;
        flood.extend(frame(HEADERS, END_HEADERS, stream, &headers));
        flood.extend(frame(RST_STREAM, 0, stream, &8u32.to_be_bytes()));
    }
    let mut peer = RawPeer::connect(&router, &flood);
    // A GOAWAY with ENHANCE_YOUR_CALM (0xb), the code for too many resets
    // (a malformed request would get PROTOCOL_ERROR or COMPRESSION_ERROR).
    let mut goaway = None;
    while let Some((kind, _, _, payload)) = peer.next(false) {
        if kind == GOAWAY && payload.len() >= 8 {
            goaway = Some(payload[7]);
        }
    }
    assert_eq!(goaway, Some(0xb));
    // No permit was leaked by the streams that reached the router before the
    // cut: all four still serve streams at once.
    let prompts: Vec<String> = (0..4).map(|i| format!("after the flood {i}")).collect();
    for (status, _, text) in at_once(&h2_client(), &router, &prompts, 8).await {
        assert_eq!(status, 200, "{text}");
        assert!(text.contains("[DONE]"));
    }
}
