//! `connex-router demo`: an in-process cluster (the router on the embedded
//! in-memory registry, one prefill and two decode mock engines that register
//! themselves) and a few requests through it, with what happened to each.

use clap::Parser;
use connex_mock_engine::{CrashAction, MockConfig, MockEngine, Role};
use connex_router::config::{Cli, Command, DemoArgs, RouterConfig};
use connex_router::{Router, SseParser, DECODER_HEADER, PREFILL_HEADER, SSE_DONE};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("starting the router: {0}")]
    Router(#[from] connex_router::StartError),
    #[error("starting a mock engine: {0}")]
    Engine(#[from] std::io::Error),
    #[error("the mock engines did not register within 10 s")]
    Registration,
    #[error("the resumed stream differs from an uninterrupted run: {0}")]
    Resume(String),
    #[error("request `{name}` failed: {message}")]
    Request { name: &'static str, message: String },
}

/// One demo request and what the client saw.
struct Outcome {
    prefill: String,
    decoder: String,
    tokens: usize,
    ttft: Duration,
    total: Duration,
    text: String,
}

pub async fn run(args: DemoArgs) -> Result<(), DemoError> {
    let router = Router::start(demo_router_config()).await?;
    println!(
        "connex demo: router on {} (embedded in-memory registry)",
        router.url()
    );
    let mut engines: Vec<(&str, MockEngine)> = Vec::new();
    for (id, role) in [
        ("prefill-0", Role::Prefill),
        ("decode-0", Role::Decode),
        ("decode-1", Role::Decode),
    ] {
        let mut config = MockConfig::new(role, "mock", Some(router.internal_url()));
        config.id = Some(id.to_string());
        config.decode_us_per_token = 2_000;
        // As the chart starts vLLM decoders: a chat resumes through the tokens API.
        config.enable_scale_out = true;
        let engine = MockEngine::start(config, CrashAction::StopServing).await?;
        println!(
            "connex demo: mock engine {id:<9} ({role:?}) on {} registering",
            engine.url()
        );
        engines.push((id, engine));
    }
    let result = async {
        wait_registered(&router, engines.len()).await?;
        let client = reqwest::Client::new();
        let requests = demo_requests(args.max_tokens);
        println!();
        println!("{:<22} {:<10} {:<9} {:>6} {:>9} {:>9}  text", "request", "prefill", "decoder", "tokens", "ttft_ms", "total_ms");
        for (name, path, body) in &requests {
            let outcome = send(&client, &router.url(), path, body)
                .await
                .map_err(|message| DemoError::Request { name, message })?;
            println!(
                "{name:<22} {:<10} {:<9} {:>6} {:>9.1} {:>9.1}  {}",
                outcome.prefill,
                outcome.decoder,
                outcome.tokens,
                outcome.ttft.as_secs_f64() * 1e3,
                outcome.total.as_secs_f64() * 1e3,
                preview(&outcome.text)
            );
        }
        println!();
        println!("connex demo: {} requests served, each prefilled once and decoded from the prefill's KV hold", requests.len());
        println!();
        failure_demo(&client, &router.url(), &engines, args.max_tokens.max(8)).await

    }
    .await;
    for (_, engine) in engines {
        engine.stop().await;
    }
    router.stop().await;
    result
}

fn demo_router_config() -> RouterConfig {
    // The defaults of `serve`, on an ephemeral loopback port, with the decode
    // policy that makes the two decoders take turns visibly.
    let argv = [
        "connex-router",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--internal-listen",
        "127.0.0.1:0",
        // The demo prints which instances served each request.
        "--expose-instance-headers",
        "--decode-policy",
        "round_robin",
    ];
    match Cli::parse_from(argv).command {
        Command::Serve(config) => config,
        Command::Demo(_) => unreachable!("parsed a serve command line"),
    }
}

async fn wait_registered(router: &Router, count: usize) -> Result<(), DemoError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.instance_count() < count {
        if Instant::now() > deadline {
            return Err(DemoError::Registration);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn demo_requests(max_tokens: u32) -> Vec<(&'static str, &'static str, Value)> {
    let messages = json!([{"role": "user", "content": "Tell me about disaggregated serving."}]);
    vec![
        (
            "completion",
            "/v1/completions",
            json!({"model": "mock", "prompt": "Once upon a time", "max_tokens": max_tokens}),
        ),
        (
            "completion stream",
            "/v1/completions",
            json!({"model": "mock", "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": true,
                "stream_options": {"include_usage": true}}),
        ),
        (
            "chat",
            "/v1/chat/completions",
            json!({"model": "mock", "messages": messages, "max_tokens": max_tokens}),
        ),
        (
            "chat stream",
            "/v1/chat/completions",
            json!({"model": "mock", "messages": messages, "max_tokens": max_tokens, "stream": true,
                "stream_options": {"include_usage": true}}),
        ),
    ]
}

async fn send(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    body: &Value,
) -> Result<Outcome, String> {
    let started = Instant::now();
    let response = client
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("?")
            .to_string()
    };
    let (prefill, decoder) = (header(PREFILL_HEADER), header(DECODER_HEADER));
    if !status.is_success() {
        return Err(format!(
            "HTTP {status}: {}",
            response.text().await.unwrap_or_default()
        ));
    }
    let mut outcome = Outcome {
        prefill,
        decoder,
        tokens: 0,
        ttft: Duration::ZERO,
        total: Duration::ZERO,
        text: String::new(),
    };
    if body["stream"] == true {
        let mut parser = SseParser::default();
        let mut chunks = response.bytes_stream();
        while let Some(bytes) = chunks.next().await {
            for data in parser.push(bytes.map_err(|e| e.to_string())?) {
                if data == SSE_DONE {
                    continue;
                }
                let chunk: Value = serde_json::from_slice(&data).map_err(|e| e.to_string())?;
                // Counted from usage: a chunk may carry the text of two tokens.
                if let Some(count) = chunk.pointer("/usage/completion_tokens") {
                    outcome.tokens = count.as_u64().unwrap_or(0) as usize;
                }
                let piece = choice_text(&chunk["choices"][0]);
                if !piece.is_empty() {
                    if outcome.text.is_empty() {
                        outcome.ttft = started.elapsed();
                    }
                    outcome.text.push_str(piece);
                }
            }
        }
    } else {
        let reply: Value = response.json().await.map_err(|e| e.to_string())?;
        outcome.ttft = started.elapsed();
        outcome.tokens = reply["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
        outcome.text = choice_text(&reply["choices"][0]).to_string();
    }
    outcome.total = started.elapsed();
    Ok(outcome)
}

/// The text of a completion or chat choice, whole or as a stream delta.
fn choice_text(choice: &Value) -> &str {
    ["/text", "/delta/content", "/message/content"]
        .iter()
        .find_map(|pointer| choice.pointer(pointer).and_then(Value::as_str))
        .unwrap_or("")
}

fn preview(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(40) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

/// Part two: the decoder serving a stream is killed half-way; the router resumes
/// the request on the other decoder from the prefill's hold, and the client's
/// stream goes on. Prints what the client saw, and the gap.
async fn failure_demo(
    client: &reqwest::Client,
    base: &str,
    engines: &[(&str, MockEngine)],
    tokens: u32,
) -> Result<(), DemoError> {
    let failed = |message: String| DemoError::Request {
        name: "failure",
        message,
    };
    let prompt = "The decoder serving this stream dies half-way.";
    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": tokens,
        "stream": true, "return_token_ids": true});
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| failed(e.to_string()))?;
    let decoder = response
        .headers()
        .get(DECODER_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("?")
        .to_string();
    let kill_at = (tokens / 2) as usize;
    println!("connex demo: decoder failure: a {tokens}-token stream on {decoder}; {decoder} is killed after the client has {kill_at} tokens");
    let mut ids: Vec<u32> = Vec::new();
    let mut arrivals: Vec<Instant> = Vec::new();
    let mut error = None;
    let mut parser = SseParser::default();
    let mut chunks = response.bytes_stream();
    while let Some(bytes) = chunks.next().await {
        for data in parser.push(bytes.map_err(|e| failed(e.to_string()))?) {
            if data == SSE_DONE {
                continue;
            }
            let chunk: Value = serde_json::from_slice(&data).map_err(|e| failed(e.to_string()))?;
            if let Some(message) = chunk.pointer("/error/message") {
                error = Some(message.to_string());
            }
            for id in chunk
                .pointer("/choices/0/token_ids")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                ids.push(
                    id.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .unwrap_or(0),
                );
                arrivals.push(Instant::now());
                if ids.len() == kill_at {
                    if let Some((_, engine)) = engines.iter().find(|(id, _)| *id == decoder) {
                        engine.crash_now();
                    }
                }
            }
        }
    }
    if let Some(error) = error {
        return Err(failed(error));
    }
    let expected = connex_mock_engine::model::generate(
        &connex_mock_engine::model::tokenize(prompt),
        tokens as usize,
    );
    if ids != expected {
        return Err(DemoError::Resume(format!(
            "got {} tokens {ids:?}, expected {expected:?}",
            ids.len()
        )));
    }
    // Who continued the stream, and from how many of the first decoder's tokens.
    let resumed = engines.iter().find_map(|(id, engine)| {
        engine.requests().into_iter().find_map(|r| {
            let epoch = r
                .body
                .pointer("/kv_transfer_params/resume_epoch")?
                .as_u64()?;
            let prompt_len = r.body.get("prompt")?.as_array()?.len();
            (epoch > 0).then_some((*id, prompt_len))
        })
    });
    let (resumed_on, prompt_len) = resumed.unwrap_or(("?", 0));
    let carried = prompt_len.saturating_sub(prompt.len());
    let gaps: Vec<Duration> = arrivals.windows(2).map(|w| w[1] - w[0]).collect();
    let resume_gap = gaps
        .get(carried.saturating_sub(1))
        .copied()
        .unwrap_or_default();
    let mut usual: Vec<Duration> = gaps
        .iter()
        .enumerate()
        .filter(|(i, _)| *i + 1 != carried)
        .map(|(_, g)| *g)
        .collect();
    usual.sort();
    let median = usual.get(usual.len() / 2).copied().unwrap_or_default();
    println!("connex demo: {decoder} died after delivering {carried} tokens; the router resumed the request on {resumed_on}");
    println!("connex demo: {resumed_on} got prompt + {carried} generated ids and pulled the prompt KV from the hold (no second prefill)");
    println!(
        "connex demo: client received {} tokens in one stream, identical to an uninterrupted run",
        ids.len()
    );
    println!(
        "connex demo: gap at the failure {:.1} ms (usual gap between tokens {:.1} ms)",
        resume_gap.as_secs_f64() * 1e3,
        median.as_secs_f64() * 1e3
    );
    Ok(())
}
