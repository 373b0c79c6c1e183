//! `connex-router`: `serve` the router, or run the in-process `demo`.

use connex_router::config::{self, Command, LogFormat};
use connex_router::logs;
#[cfg(feature = "demo")]
mod demo;
use std::process::ExitCode;

// Every token's chunk is a few small allocations; mimalloc serves them from
// thread-local pages where glibc's malloc took a visible share of the CPU.
// It is built without transparent huge pages (the `no_thp` feature): with
// them the kernel backs whole 2 MiB regions where hyper's 8 KiB connection
// buffers touch a page or two, and the router's RSS per in-flight stream was
// 67 KiB instead of 49 (docs/bench.md, "scale"). On a host whose THP setting
// is `always` (not `madvise`) the kernel may still use huge pages: there, run
// the router with MIMALLOC_ALLOW_THP=0 (the chart does).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match config::load(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(config::ConfigError::Cli(err)) => err.exit(),
        Err(err) => {
            eprintln!("connex-router: {err}");
            return ExitCode::from(2);
        }
    };
    // The demo prints its own report; its logs are for warnings only.
    let (format, level, default, otlp) = match &cli.command {
        Command::Serve(config) => (
            config.observability.log_format,
            config.observability.log_level.clone(),
            "info",
            config.observability.otlp_endpoint.clone(),
        ),
        Command::Demo(_) => (LogFormat::Text, None, "warn", None),
    };
    // Held to the end: its drop exports the last spans.
    let _telemetry = match logs::init(format, level.as_deref(), default, otlp.as_deref()) {
        Ok(telemetry) => telemetry,
        Err(err) => {
            eprintln!("connex-router: {err}");
            return ExitCode::from(2);
        }
    };
    match cli.command {
        Command::Serve(config) => serve(config).await,
        #[cfg(feature = "demo")]
        Command::Demo(args) => match demo::run(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("demo failed: {err}");
                ExitCode::FAILURE
            }
        },
        #[cfg(not(feature = "demo"))]
        Command::Demo(_) => {
            eprintln!("connex-router: this build has no demo (built without the `demo` feature)");
            ExitCode::from(2)
        }
    }
}

/// Tells the bound addresses on stdout, whatever the log level (tests and
/// scripts read them): in text, two lines, the internal one first (a reader may
/// stop at "listening on"); in JSON, one JSON object with both as fields, so
/// that every line a log pipeline reads is JSON.
fn announce(format: LogFormat, router: &connex_router::Router) {
    match format {
        LogFormat::Text => {
            println!("connex-router internal API on {}", router.internal_url());
            println!("connex-router listening on {}", router.url());
        }
        LogFormat::Json => {
            println!(
                "{}",
                logs::listening_line(&router.url(), &router.internal_url())
            );
        }
    }
}

async fn serve(config: config::RouterConfig) -> ExitCode {
    let format = config.observability.log_format;
    let router = match connex_router::Router::start(config).await {
        Ok(router) => router,
        Err(err) => {
            eprintln!("connex-router: {err}");
            return ExitCode::FAILURE;
        }
    };
    announce(format, &router);
    connex_router::terminate_signal().await;
    router.stop().await;
    ExitCode::SUCCESS
}
