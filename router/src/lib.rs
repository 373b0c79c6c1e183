//! Connex router: the cluster's OpenAI endpoint for prefill/decode disaggregated
//! vLLM serving. Data flows one way: `api` -> `pd` -> (`policy`, `registry`) -> engines.

pub mod api;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub mod error;
pub mod health;
pub mod holds;
pub mod journal;
pub mod metrics;
pub mod pd;
pub mod policy;
pub mod registry;
pub mod sse;
pub mod state;

use axum::serve::ListenerExt;
use config::RouterConfig;
use state::AppState;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Errors starting the router.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("membership: {0}")]
    Registry(#[from] registry::RegistryError),
}

/// A running router: its address, its state and the tasks it owns.
pub struct Router {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    shutdown: CancellationToken,
    tasks: tokio::task::JoinSet<()>,
}

impl Router {
    /// Binds and starts serving, with the membership's background tasks.
    pub async fn start(config: RouterConfig) -> Result<Self, StartError> {
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| StartError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: config.listen,
            source,
        })?;
        let registry = registry::Registry::open(&config).await?;
        let (state, releases) = AppState::new(config, registry)?;
        let state = Arc::new(state);
        let shutdown = CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        let app = api::routes(state.clone());
        let stop = shutdown.clone();
        tasks.spawn(async move {
            if let Err(err) = axum::serve(listener.tap_io(no_delay), app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
            {
                tracing::error!(%err, "router server failed");
            }
        });
        state.registry.spawn(&mut tasks, shutdown.clone());
        state.config.health_checks().spawn(
            state.registry.clone(),
            state.client.clone(),
            state.outliers.clone(),
            &mut tasks,
            shutdown.clone(),
        );
        state
            .holds
            .spawn_keeper(releases, &mut tasks, shutdown.clone());
        tracing::info!(%addr, "connex-router listening");
        Ok(Self {
            addr,
            state,
            shutdown,
            tasks,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving (in-flight streams finish) and waits for the tasks.
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
