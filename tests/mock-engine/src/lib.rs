//! `connex-mock-engine`: a deterministic stand-in for a vLLM OpenAI server.
//!
//! It speaks the subset of vLLM's API that Connex uses (completions and chat,
//! stream and non-stream, `kv_transfer_params`, `return_token_ids`), registers
//! itself with a router, and has fault switches so that every failure mode of a
//! decoder can be reproduced on a CPU. Tokens are a pure function of the whole
//! context (see [`model`]).

pub mod api;
pub mod config;
pub mod kv;
pub mod merge;
pub mod model;
pub mod pooling;
pub mod prefix;
pub mod publish;
pub mod register;
pub mod shape;
pub mod stats;
pub mod tokens;

pub use config::{CrashAction, MockConfig, Role};

use axum::serve::ListenerExt;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A running mock engine. Dropping it does not stop it; call [`MockEngine::stop`].
pub struct MockEngine {
    /// Address the HTTP server is bound to.
    pub addr: SocketAddr,
    /// Where the KV events are published (`--kv-events-publish`), bound.
    pub kv_events_endpoint: Option<String>,
    state: Arc<api::EngineState>,
    shutdown: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
}

impl MockEngine {
    /// Binds `config.listen`, starts serving and (when `config.router` is set)
    /// registering. `crash` tells what a crash fault does.
    pub async fn start(config: MockConfig, crash: CrashAction) -> std::io::Result<Self> {
        let listener = TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let kv = kv::KvState::start(&config)
            .await
            .map_err(|err| std::io::Error::other(format!("KV holder: {err}")))?;
        let state = Arc::new(api::EngineState::new(
            config.clone(),
            addr,
            crash,
            shutdown.clone(),
            kv,
        ));
        let mut tasks = tokio::task::JoinSet::new();
        let mut kv_events_endpoint = None;
        if let Some(endpoint) = &config.kv_events_publish {
            let publisher = publish::Publisher::bind(endpoint)
                .await
                .map_err(std::io::Error::other)?;
            kv_events_endpoint = Some(publisher.endpoint.clone());
            tasks.spawn(publisher.run(state.clone(), shutdown.clone()));
        }
        // The holder lives as long as the engine serves (a crash takes it too).
        let kv_state = state.clone();
        let kv_stop = shutdown.clone();
        tasks.spawn(async move {
            kv_stop.cancelled().await;
            kv_state.kv.stop().await;
        });
        let app = api::routes(state.clone());
        let serve_stop = shutdown.clone();
        tasks.spawn(async move {
            let result = axum::serve(listener.tap_io(no_delay), app)
                .with_graceful_shutdown(serve_stop.cancelled_owned())
                .await;
            if let Err(err) = result {
                tracing::error!(%err, "mock engine server failed");
            }
        });
        if let Some(router) = config.router.clone() {
            tasks.spawn(register::run(router, state.clone(), shutdown.clone()));
        }
        Ok(Self {
            addr,
            kv_events_endpoint,
            state,
            shutdown,
            tasks,
        })
    }

    /// Base URL of this engine.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Crashes the engine at the next token of any decode stream, as a kill
    /// would (what that does is the engine's [`CrashAction`]).
    pub fn crash_now(&self) {
        self.state
            .crash_now
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Every request this engine received so far.
    pub fn requests(&self) -> Vec<stats::RequestRecord> {
        self.state.log.snapshot()
    }

    /// Resolves when the engine stopped (shutdown or an in-process crash).
    pub async fn stopped(&self) {
        self.shutdown.cancelled().await;
    }

    /// Stops serving and deregisters; waits for the tasks to end.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Every token is its own small SSE write; with Nagle's algorithm on, such writes
/// wait for the peer's delayed ACK (~40 ms on Linux), once per response.
fn no_delay(stream: &mut tokio::net::TcpStream) {
    if let Err(err) = stream.set_nodelay(true) {
        tracing::warn!(%err, "could not set TCP_NODELAY");
    }
}
