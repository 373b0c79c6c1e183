//! One client connection: which protocol it speaks (told from its first
//! bytes), the routes as its service, and its lifetime: it is closed
//! gracefully when the server drains or, on HTTP/2, when no request has been
//! in flight for the idle timeout.

use crate::edge::held_body::HeldBody;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::response::Response;
use bytes::Bytes;
use hyper_util::server::graceful::GracefulConnection;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// The protocol a new connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
}

/// What an HTTP/2 client sends first (RFC 9113 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Tells a new connection's protocol from its first bytes, which are peeked
/// (left for hyper to read); `None` when it closes or has not said within
/// `within`.
pub async fn sniff(stream: &TcpStream, within: Duration) -> Option<Protocol> {
    let deadline = tokio::time::Instant::now() + within;
    let mut first = [0u8; H2_PREFACE.len()];
    let mut pause = SNIFF_PAUSE;
    loop {
        let seen = tokio::time::timeout_at(deadline, stream.peek(&mut first))
            .await
            .ok()?
            .ok()?;
        if seen == 0 {
            return None;
        }
        if first[..seen] != H2_PREFACE[..seen] {
            return Some(Protocol::Http1);
        }
        if seen == H2_PREFACE.len() {
            return Some(Protocol::Http2);
        }
        // A prefix of the preface so far (real clients send it whole).
        // `peek` returns at once while any byte waits, so wait for the rest,
        // longer each time: a client that stalls there costs a few wakeups,
        // not one every few milliseconds until the deadline.
        if tokio::time::Instant::now() + pause > deadline {
            return None;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(SNIFF_PAUSE_MAX);
    }
}

/// First and longest pause between two peeks at a connection's first bytes.
const SNIFF_PAUSE: Duration = Duration::from_millis(5);
const SNIFF_PAUSE_MAX: Duration = Duration::from_millis(500);

/// The router's routes as one connection's hyper service: every request gets
/// the peer's address and, on HTTP/2, counts as activity until its response
/// body is dropped.
pub fn service<B>(
    app: axum::Router,
    peer: std::net::SocketAddr,
    activity: Option<Arc<Activity>>,
) -> impl tower::Service<
    Request<B>,
    Response = Response,
    Error = std::convert::Infallible,
    Future = impl std::future::Future<Output = Result<Response, std::convert::Infallible>> + Send,
> + Clone
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    tower::service_fn(move |mut request: Request<B>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        let in_flight = activity.as_ref().map(|activity| activity.begin());
        let response = app.clone().oneshot(request.map(Body::new));
        async move {
            let response = response.await?;
            Ok(match in_flight {
                // Counted in flight until its body is dropped.
                Some(guard) => response.map(|inner| Body::new(HeldBody::new(inner, guard))),
                None => response,
            })
        }
    })
}

/// Runs one connection to its end; asks it to close gracefully (the requests
/// in flight finish, no new one starts) when the server drains (the caller
/// bounds that wait) or, with `idle`, when its future resolves: the
/// connection then gets the second field's time to close before it is
/// dropped, for a peer that never acknowledges the shutdown (HTTP/2 waits for
/// a ping's answer).
pub async fn drive<C, I>(
    connection: C,
    draining: CancellationToken,
    idle: Option<(I, Duration)>,
) -> Result<(), C::Error>
where
    C: GracefulConnection,
    I: std::future::Future<Output = ()>,
{
    let mut connection = std::pin::pin!(connection);
    let (idle, linger) = match idle {
        Some((idle, linger)) => (futures_util::future::Either::Left(idle), Some(linger)),
        None => (
            futures_util::future::Either::Right(std::future::pending()),
            None,
        ),
    };
    let lingering = tokio::select! {
        ended = connection.as_mut() => return ended,
        _ = draining.cancelled() => None,
        _ = idle => linger,
    };
    connection.as_mut().graceful_shutdown();
    match lingering {
        Some(linger) => tokio::time::timeout(linger, connection)
            .await
            .unwrap_or(Ok(())),
        None => connection.await,
    }
}

/// The requests in flight on one connection, for its idle timeout.
#[derive(Debug, Default)]
pub struct Activity {
    in_flight: AtomicUsize,
    changed: Notify,
}

/// One request in flight; counted until dropped.
pub struct InFlight(Arc<Activity>);

impl Activity {
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
        InFlight(self.clone())
    }

    /// Resolves once no request has been in flight for `after`.
    pub async fn idle_for(&self, after: Duration) {
        loop {
            // Registered before the count is read, so no change is missed.
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if self.in_flight.load(Ordering::Acquire) == 0 {
                if tokio::time::timeout(after, changed).await.is_err() {
                    return;
                }
            } else {
                changed.await;
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    #[tokio::test]
    async fn a_connection_is_idle_only_once_its_last_request_has_ended() {
        let activity = Arc::new(Activity::default());
        let idle = Duration::from_millis(100);
        let first = activity.begin();
        let second = activity.begin();
        let waiting = tokio::time::timeout(Duration::from_millis(500), activity.idle_for(idle));
        assert!(waiting.await.is_err(), "idle with two requests in flight");
        drop(first);
        let waiting = tokio::time::timeout(Duration::from_millis(500), activity.idle_for(idle));
        assert!(waiting.await.is_err(), "idle with one request in flight");
        // The last one ends while the wait is on: it must see that.
        let ends = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(second);
        };
        let waiting = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(activity.idle_for(idle), ends)
        });
        assert!(
            waiting.await.is_ok(),
            "never idle after the last request ended"
        );
    }

    #[tokio::test]
    async fn a_request_counts_until_its_response_body_is_dropped() {
        let activity = Arc::new(Activity::default());
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "body" }));
        let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 1));
        let service = service(app, peer, Some(activity.clone()));
        let response = service
            .oneshot(Request::new(Body::empty()))
            .await
            .unwrap_or_else(|never| match never {});
        assert_eq!(activity.in_flight.load(Ordering::Acquire), 1);
        drop(response);
        assert_eq!(activity.in_flight.load(Ordering::Acquire), 0);
    }

    async fn sniffed(first: &'static [u8]) -> Option<Protocol> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut socket = TcpStream::connect(addr).await.expect("connect");
            socket.write_all(first).await.expect("write");
            // Held open past the sniff's time limit.
            tokio::time::sleep(Duration::from_secs(2)).await;
        });
        let (stream, _) = listener.accept().await.expect("accept");
        let protocol = sniff(&stream, Duration::from_millis(300)).await;
        client.abort();
        protocol
    }

    #[tokio::test]
    async fn a_connection_is_told_http2_by_its_preface() {
        assert_eq!(sniffed(b"GET / HTTP/1.1\r\n").await, Some(Protocol::Http1));
        // "P" then not "R": HTTP/1.1 (a POST).
        assert_eq!(sniffed(b"POST / HTTP/1.1\r\n").await, Some(Protocol::Http1));
        assert_eq!(sniffed(H2_PREFACE).await, Some(Protocol::Http2));
        // Stopped inside the preface: given up on at the time limit.
        assert_eq!(sniffed(&H2_PREFACE[..8]).await, None);
    }
}
