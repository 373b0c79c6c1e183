//! The client against a real HTTP server (axum on hyper, as the mock engine)
//! and against raw sockets for what a server may do wrong.

use super::*;
use axum::routing::post;
use futures_util::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::net::TcpListener;

fn client() -> EngineClient {
    EngineClient::new(Duration::from_secs(1), 8, Duration::from_secs(10))
}

/// An axum server counting the connections it accepted: `/echo` answers the
/// body with its length, `/stream` the body's bytes one chunk per byte, slowly.
async fn server() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new()
        .route("/echo", post(|body: Bytes| async move { body }))
        .route(
            "/stream",
            post(|body: Bytes| async move {
                let pieces = futures_util::stream::iter(body.to_vec()).then(|byte| async move {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok::<_, std::io::Error>(Bytes::from(vec![byte]))
                });
                axum::body::Body::from_stream(pieces)
            }),
        );
    let counter = accepted.clone();
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            counter.fetch_add(1, Ordering::SeqCst);
            let app = app.clone();
            tokio::spawn(async move {
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    (url, accepted)
}

async fn read_all(body: &mut Body) -> Vec<u8> {
    let mut all = Vec::new();
    while let Some(piece) = body.chunk().await.expect("body") {
        all.extend_from_slice(&piece);
    }
    all
}

#[tokio::test]
async fn answers_are_read_whole_and_connections_kept_alive() {
    let (url, accepted) = server().await;
    let client = client();
    for i in 0..5 {
        let body = Bytes::from(format!("{{\"n\": {i}}}"));
        let mut response = client
            .post(&url, "/echo", &[("x-request-id", "r")], &body)
            .await
            .expect("answer");
        assert_eq!(response.status, 200);
        assert_eq!(read_all(&mut response.body).await, body.to_vec());
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one connection, kept alive"
    );
    assert_eq!(client.idle_connections(), 1);
    // Larger than a read at a time (axum's default body limit is 2 MB).
    let large = Bytes::from(vec![b'x'; 3 << 19]);
    let mut response = client
        .post(&url, "/echo", &[], &large)
        .await
        .expect("answer");
    assert_eq!(response.status, 200);
    assert_eq!(read_all(&mut response.body).await, large.to_vec());
}

#[tokio::test]
async fn a_chunked_stream_comes_piece_by_piece() {
    let (url, _) = server().await;
    let client = client();
    let sent = Bytes::from_static(b"data: {\"id\": 1}\n\ndata: [DONE]\n\n");
    let response = client
        .post(&url, "/stream", &[], &sent)
        .await
        .expect("answer");
    let pieces: Vec<Bytes> = response
        .body
        .into_stream()
        .map(|piece| piece.expect("piece"))
        .collect()
        .await;
    assert!(pieces.len() > 1, "pieces as they came, not one at the end");
    assert_eq!(pieces.concat(), sent.to_vec());
    assert_eq!(
        client.idle_connections(),
        1,
        "read to its end: pooled again"
    );
}

#[tokio::test]
async fn a_body_dropped_before_its_end_closes_its_connection() {
    let (url, accepted) = server().await;
    let client = client();
    let sent = Bytes::from(vec![b'a'; 200]);
    let mut response = client
        .post(&url, "/stream", &[], &sent)
        .await
        .expect("answer");
    assert!(response.body.chunk().await.expect("piece").is_some());
    drop(response);
    assert_eq!(client.idle_connections(), 0);
    let mut response = client
        .post(&url, "/echo", &[], &sent)
        .await
        .expect("answer");
    assert_eq!(read_all(&mut response.body).await, sent.to_vec());
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "a new connection");
}

/// A raw server: for each connection in turn, what it answers to each request
/// it reads (`None`: it closes the connection instead).
async fn scripted(script: Vec<Vec<Option<&'static [u8]>>>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        for answers in script {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            counter.fetch_add(1, Ordering::SeqCst);
            for answer in answers {
                let mut request = vec![0u8; 4096];
                if socket.read(&mut request).await.unwrap_or(0) == 0 {
                    break;
                }
                match answer {
                    Some(answer) => socket.write_all(answer).await.expect("write"),
                    None => break,
                }
            }
        }
        std::future::pending::<()>().await;
    });
    (url, accepted)
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

#[tokio::test]
async fn a_pooled_connection_the_engine_dropped_is_replaced_without_an_error() {
    // The engine answers once, then drops the connection on the next request
    // without answering (a keep-alive timeout racing the request).
    let (url, accepted) = scripted(vec![vec![Some(OK), None], vec![Some(OK)]]).await;
    let client = client();
    for _ in 0..2 {
        let mut response = client
            .post(&url, "/v1/completions", &[], &Bytes::from_static(b"{}"))
            .await
            .expect("answer");
        assert_eq!(read_all(&mut response.body).await, b"ok");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_new_connection_closed_before_an_answer_is_an_error() {
    let (url, _) = scripted(vec![vec![None]]).await;
    let result = client()
        .post(&url, "/v1/completions", &[], &Bytes::from_static(b"{}"))
        .await;
    assert!(
        matches!(result, Err(ClientError::ClosedBeforeResponse)),
        "{:?}",
        result.err()
    );
}

#[tokio::test]
async fn a_body_cut_short_is_an_error_and_its_connection_not_reused() {
    let (url, accepted) = scripted(vec![
        vec![Some(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")],
        vec![Some(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        )],
        vec![Some(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")],
    ])
    .await;
    let client = client();
    let mut response = client
        .post(&url, "/a", &[], &Bytes::new())
        .await
        .expect("answer");
    assert_eq!(
        response.body.chunk().await.expect("piece"),
        Some(Bytes::from("short"))
    );
    // The server now waits for another request on this connection: drop it.
    drop(response);
    let mut response = client
        .post(&url, "/a", &[], &Bytes::new())
        .await
        .expect("answer");
    assert_eq!(
        response.body.chunk().await.expect("piece"),
        Some(Bytes::from("hello"))
    );
    drop(response);
    let mut response = client
        .post(&url, "/a", &[], &Bytes::new())
        .await
        .expect("answer");
    // The raw server keeps this socket open: the body has no end yet.
    let first = response.body.chunk().await.expect("piece");
    assert_eq!(first, Some(Bytes::from("until the end")));
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
    assert_eq!(client.idle_connections(), 0);
}

#[tokio::test]
async fn a_truncated_chunked_body_is_an_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut request = vec![0u8; 4096];
        let _ = socket.read(&mut request).await;
        let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
        socket.write_all(answer).await.expect("write");
        // and the engine dies
    });
    let mut response = client()
        .post(&url, "/a", &[], &Bytes::new())
        .await
        .expect("answer");
    assert_eq!(
        response.body.chunk().await.expect("piece"),
        Some(Bytes::from("hello"))
    );
    assert!(matches!(
        response.body.chunk().await,
        Err(ClientError::Framing(FramingError::Truncated))
    ));
}

#[tokio::test]
async fn interim_answers_are_skipped() {
    let (url, _) = scripted(vec![vec![Some(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
    )]])
    .await;
    let mut response = client()
        .post(&url, "/a", &[], &Bytes::new())
        .await
        .expect("answer");
    assert_eq!(response.status, 201);
    assert_eq!(read_all(&mut response.body).await, b"ok");
}

#[tokio::test]
async fn refused_connects_and_bad_urls_are_told_apart() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    drop(listener);
    let result = client().post(&url, "/a", &[], &Bytes::new()).await;
    assert!(
        matches!(result, Err(ClientError::Connect { refused: true, .. })),
        "{:?}",
        result.err()
    );
    for url in [
        "https://127.0.0.1:1",
        "http://",
        "http://h:1/base",
        "127.0.0.1:1",
    ] {
        let result = client().post(url, "/a", &[], &Bytes::new()).await;
        assert!(matches!(result, Err(ClientError::Url(_))), "{url}");
    }
}

#[tokio::test]
async fn a_name_is_resolved() {
    let (url, _) = server().await;
    let url = url.replace("127.0.0.1", "localhost");
    let body = Bytes::from_static(b"{}");
    let mut response = client()
        .post(&url, "/echo", &[], &body)
        .await
        .expect("answer");
    assert_eq!(read_all(&mut response.body).await, b"{}");
}
