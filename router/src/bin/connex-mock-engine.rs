//! `connex-mock-engine`: the mock vLLM engine as its own process.

use clap::Parser;
use connex_mock_engine::{CrashAction, MockConfig, MockEngine};

// The router's allocator (see main.rs): the mock stands in for engines whose
// CPU is not the router host's, so on a bench host that shares its cores
// with the router it should cost as little as it can (glibc's malloc was
// about a seventh of a decode mock's CPU).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CONNEX_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = MockConfig::parse();
    if let Some(path) = &config.write_tokenizer {
        // The model's tokenizer.json, for a router's --tokenizer; no engine.
        let json = connex_mock_engine::model::tokenizer_json().to_string();
        return match std::fs::write(path, json) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("connex-mock-engine: cannot write {}: {err}", path.display());
                std::process::ExitCode::FAILURE
            }
        };
    }
    let engine = match MockEngine::start(config, CrashAction::ExitProcess).await {
        Ok(engine) => engine,
        Err(err) => {
            eprintln!("connex-mock-engine: cannot start: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Some(endpoint) = &engine.kv_events_endpoint {
        println!("connex-mock-engine publishes KV events on {endpoint}");
    }
    // The tests read the bound address from this line (the last one).
    println!("connex-mock-engine listening on {}", engine.url());
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = engine.stopped() => {}
    }
    engine.stop().await;
    std::process::ExitCode::SUCCESS
}
