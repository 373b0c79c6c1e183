//! The HTTP servers and their lifecycle: one accept loop per listener with a
//! header-read timeout (slowloris), a connection limit and graceful shutdown,
//! speaking HTTP/1.1 and, with `--http2`, HTTP/2 without TLS (told apart by a
//! connection's first bytes; an idle HTTP/2 connection is closed). The
//! client routes' layers (admission, instance headers, the cut of streams at
//! shutdown) are `edge::gate`'s.
//!
//! Shutdown (SIGTERM/SIGINT, or [`crate::Router::stop`]): `/ready` answers
//! 503 at once and the listeners close (no new connections); in-flight
//! requests run on for `--shutdown-grace`; streams still open then end in
//! their protocol's shape (`edge::gate::cut_at_shutdown`).

mod connection;

use crate::config::Http2Args;
use connection::{drive, service, sniff, Activity, Protocol};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What bounds one listener's connections.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// Time a client has for a request's headers; hyper also counts a kept-alive
    /// connection's wait for its next request against it. It bounds the wait
    /// for a new connection's first bytes too (which protocol it speaks).
    pub header_read_timeout: Duration,
    /// Most open connections; further ones wait in the accept backlog.
    pub max_connections: usize,
    /// HTTP/2 without TLS beside HTTP/1.1 (`--http2`), with its bounds per
    /// connection (`--http2-max-streams`, `--http2-idle-timeout`); `None`:
    /// HTTP/1.1 only.
    pub http2: Option<Http2Args>,
}

/// What one HTTP/2 stream may have queued for a client that reads slowly;
/// past it the response body is not polled (an SSE event is a few hundred
/// bytes; hyper's default, 400 KiB per stream, is a lot times 256 streams).
const H2_SEND_BUF: usize = 64 * 1024;

/// The phases of a shutdown, shared by the servers and the client routes' layers (`edge::gate`).
#[derive(Debug, Default, Clone)]
pub struct Shutdown {
    /// Cancelled when shutdown begins: `/ready` 503, listeners closed.
    pub draining: CancellationToken,
    /// Cancelled when the grace period is over: open streams end now.
    pub cut: CancellationToken,
}

/// Serves `app` on `listener` until `shutdown.draining`, then waits for its
/// connections to finish (the caller bounds that wait).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    limits: ServerLimits,
    shutdown: Shutdown,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let connections = TaskTracker::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let http2 = limits.http2.map(|h2| {
        let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .max_concurrent_streams(h2.http2_max_streams)
            .max_send_buf_size(H2_SEND_BUF)
            .keep_alive_interval(h2.http2_idle_timeout)
            .keep_alive_timeout(h2.http2_idle_timeout);
        (Arc::new(builder), h2.http2_idle_timeout)
    });
    let http1 = Arc::new(http1);
    loop {
        let slot = tokio::select! {
            _ = shutdown.draining.cancelled() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.draining.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // EMFILE and the like: wait rather than spin.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Every token is its own small SSE write; with Nagle's algorithm on,
        // such writes wait for the peer's delayed ACK (~40 ms on Linux).
        if let Err(err) = stream.set_nodelay(true) {
            tracing::warn!(%err, "could not set TCP_NODELAY");
        }
        let (app, http1, http2) = (app.clone(), http1.clone(), http2.clone());
        let (draining, within) = (shutdown.draining.clone(), limits.header_read_timeout);
        connections.spawn(async move {
            let protocol = match http2 {
                None => Some(Protocol::Http1),
                Some(_) => tokio::select! {
                    protocol = sniff(&stream, within) => protocol,
                    // A connection that has not spoken yet is not waited for.
                    _ = draining.cancelled() => None,
                },
            };
            let ended = match (protocol, http2) {
                (Some(Protocol::Http2), Some((builder, idle))) => {
                    let activity = Arc::new(Activity::default());
                    let service =
                        TowerToHyperService::new(service(app, peer, Some(activity.clone())));
                    let connection = builder.serve_connection(TokioIo::new(stream), service);
                    drive(connection, draining, Some((activity.idle_for(idle), idle))).await
                }
                (Some(_), _) => {
                    let service = TowerToHyperService::new(service(app, peer, None));
                    let connection = http1.serve_connection(TokioIo::new(stream), service);
                    drive(connection, draining, None::<(std::future::Pending<()>, _)>).await
                }
                // Closed, or too slow to say which protocol it speaks.
                (None, _) => Ok(()),
            };
            if let Err(err) = ended {
                tracing::debug!(%err, %peer, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Waits for SIGTERM (what Kubernetes sends) or SIGINT (Ctrl-C).
pub async fn terminate_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(err) => {
                tracing::warn!(%err, "cannot watch SIGTERM; waiting for Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
