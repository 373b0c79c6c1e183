//! `connex-loadgen`: sends `--requests` requests at `--concurrency` to one URL
//! (closed loop, bounded in count and by `--timeout-s`) and prints one JSON line:
//! requests/s, p50 and p99 latency, p50 time to first token (streams), and the
//! errors seen.
//!
//! With `--prefill-url` it is its own P/D router, the zero-router limit: each
//! request goes to the prefill (`max_tokens: 1`, `do_remote_decode`), then to
//! `--url` (a decoder) with the `kv_transfer_params` the prefill answered.

use clap::Parser;
use futures_util::StreamExt;
use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Parser)]
struct Args {
    /// Full URL, e.g. http://127.0.0.1:8000/v1/completions.
    #[arg(long)]
    url: String,
    #[arg(long, default_value_t = 300)]
    requests: usize,
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Stream the responses (SSE), reading every chunk.
    #[arg(long)]
    stream: bool,
    /// Hard limit for the whole run.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// Do P/D here: prefill at this URL, then decode at `--url`.
    #[arg(long)]
    prefill_url: Option<String>,
    /// Speak HTTP/2 without TLS (prior knowledge) to `--url`, this many
    /// requests per connection at most (0: HTTP/1.1, one connection per
    /// request in flight).
    #[arg(long, default_value_t = 0)]
    http2_streams_per_connection: usize,
    /// A label echoed in the output line.
    #[arg(long, default_value = "run")]
    label: String,
    /// The request body's protocol (`--url` must be its route).
    #[arg(long, value_enum, default_value = "completions")]
    api: Api,
    /// Responses only: ask the router to keep nothing (`store: false`), so
    /// that what storing costs can be told from what the protocol does.
    #[arg(long)]
    no_store: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Api {
    Completions,
    Chat,
    Responses,
}

impl Api {
    /// The body of request `i` in this protocol.
    fn body(self, i: usize, max_tokens: u32, stream: bool) -> serde_json::Value {
        let prompt = format!("benchmark prompt {i} with a few words");
        match self {
            Api::Completions => json!({"model": "mock", "prompt": prompt,
                "max_tokens": max_tokens, "stream": stream}),
            Api::Chat => json!({"model": "mock", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "stream": stream}),
            Api::Responses => json!({"model": "mock", "input": prompt,
                "max_output_tokens": max_tokens, "stream": stream}),
        }
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // HTTP/2: one client per connection, each carrying its share of the
    // workers' requests (a reqwest client multiplexes all on one).
    let clients: Vec<reqwest::Client> = match args.http2_streams_per_connection {
        0 => vec![reqwest::Client::builder()
            .pool_max_idle_per_host(args.concurrency)
            .build()
            .expect("http client")],
        per => (0..args.concurrency.div_ceil(per).max(1))
            .map(|_| {
                reqwest::Client::builder()
                    .http2_prior_knowledge()
                    .build()
                    .expect("http client")
            })
            .collect(),
    };
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    // The zero-router limit's prefill calls go to an engine: HTTP/1.1.
    let engine_client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.concurrency)
        .build()
        .expect("http client");
    for worker in 0..args.concurrency {
        let client = clients[worker % clients.len()].clone();
        let engine_client = engine_client.clone();
        let (next, url) = (next.clone(), args.url.clone());
        let (total, max_tokens, stream) = (args.requests, args.max_tokens, args.stream);
        let prefill_url = args.prefill_url.clone();
        let (api, no_store) = (args.api, args.no_store);
        workers.spawn(async move {
            let mut latencies = Vec::new();
            let mut ttfts = Vec::new();
            let mut errors = 0usize;
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let i = latencies.len() + errors;
                let mut body = api.body(i, max_tokens, stream);
                if no_store {
                    body["store"] = serde_json::Value::Bool(false);
                }
                let t = Instant::now();
                if let Some(prefill_url) = &prefill_url {
                    match prefill(&engine_client, prefill_url, &body).await {
                        Ok(kv) => body["kv_transfer_params"] = kv,
                        Err(_) => {
                            errors += 1;
                            continue;
                        }
                    }
                }
                match one(&client, &url, &body, t).await {
                    Ok(ttft) => {
                        latencies.push(t.elapsed());
                        ttfts.extend(ttft);
                    }
                    Err(err) => {
                        errors += 1;
                        report_error(&err);
                    }
                }
            }
            (latencies, ttfts, errors)
        });
    }
    let deadline = Duration::from_secs(args.timeout_s);
    let mut latencies = Vec::new();
    let mut ttfts = Vec::new();
    let mut errors = 0;
    let collected = tokio::time::timeout(deadline, async {
        while let Some(Ok((l, t, e))) = workers.join_next().await {
            latencies.extend(l);
            ttfts.extend(t);
            errors += e;
        }
    })
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort();
    ttfts.sort();
    let pct = |sorted: &[Duration], p: f64| {
        sorted
            .get(((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1))
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    println!(
        "{}",
        json!({"label": args.label, "ok": latencies.len(), "errors": errors, "timed_out": collected.is_err(),
            "seconds": elapsed, "req_s": latencies.len() as f64 / elapsed, "p50_ms": pct(&latencies, 0.50),
            "p99_ms": pct(&latencies, 0.99), "ttft_p50_ms": pct(&ttfts, 0.50)})
    );
}

/// The zero-router limit's prefill: the `kv_transfer_params` of its answer.
async fn prefill(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let mut body = body.clone();
    body["stream"] = json!(false);
    body["max_tokens"] = json!(1);
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false});
    let answer: serde_json::Value = client
        .post(url)
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    answer
        .get("kv_transfer_params")
        .cloned()
        .ok_or_else(|| "no kv_transfer_params".to_string())
}

/// An error and its sources, `: `-joined (reqwest's own message is generic).
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(err) = source {
        message.push_str(": ");
        message.push_str(&err.to_string());
        source = err.source();
    }
    message
}

/// The first few errors go to stderr, so that a run with failures says why.
fn report_error(err: &str) {
    static REPORTED: AtomicUsize = AtomicUsize::new(0);
    if REPORTED.fetch_add(1, Ordering::Relaxed) < 10 {
        eprintln!("connex-loadgen: request failed: {err}");
    }
}

/// One request to its end; the time to its first token (streams) from `started`.
async fn one(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    started: Instant,
) -> Result<Option<Duration>, String> {
    let response = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| error_chain(&e))?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}", response.status()));
    }
    let mut body = response.bytes_stream();
    // The stream's last bytes, across chunk boundaries (the network may cut
    // the last event anywhere).
    let mut last = Vec::new();
    let mut ttft = None;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| error_chain(&e))?;
        // HTTP/2 ends a stream with an empty DATA frame.
        if chunk.is_empty() {
            continue;
        }
        ttft.get_or_insert_with(|| started.elapsed());
        // A stream that ends with an error event ends with [DONE] too.
        if carries_error_event(&chunk) {
            return Err("error event".into());
        }
        last.extend_from_slice(&chunk);
        if last.len() > TAIL_BYTES {
            last.drain(..last.len() - TAIL_BYTES);
        }
    }
    // A complete stream ends with [DONE] (a Responses stream with its
    // `response.completed`, which has its usage); a complete JSON reply with
    // its usage.
    let tail = String::from_utf8_lossy(&last);
    if tail.contains("[DONE]") || tail.contains("\"usage\"") {
        Ok(ttft)
    } else {
        Err("incomplete response".into())
    }
}

/// Whether a piece of a stream carries an OpenAI error event.
/// The stream's tail kept to tell a complete stream: more than its last
/// event (a Responses stream's last one holds the whole response).
const TAIL_BYTES: usize = 64 * 1024;

fn carries_error_event(bytes: &[u8]) -> bool {
    bytes.windows(10).any(|w| w == b"{\"error\":{")
}
