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

/// POSTs `{}` to `/a` and expects an answer.
async fn ask(client: &EngineClient, url: &str) -> Response {
    client.post(url, "/a", &[], &empty()).await.expect("answer")
}

/// POSTs `{}` to `/a` and expects an error.
async fn ask_error(client: &EngineClient, url: &str) -> ClientError {
    match client.post(url, "/a", &[], &empty()).await {
        Ok(response) => panic!("answered {}", response.status),
        Err(error) => error,
    }
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
            .post(
                &url,
                "/echo",
                &[("x-request-id", "r")],
                &body.clone().into(),
            )
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
        .post(&url, "/echo", &[], &large.clone().into())
        .await
        .expect("answer");
    assert_eq!(response.status, 200);
    assert_eq!(read_all(&mut response.body).await, large.to_vec());
}

#[tokio::test]
async fn a_body_in_pieces_arrives_whole_and_in_order() {
    let (url, _) = server().await;
    // Pieces of a few bytes between large shared ones, as a patched client
    // body is sent (`protocols::openai::patch`).
    let shared = Bytes::from(vec![b'7'; 3 << 19]);
    let mut body = Payload::from(Bytes::from_static(b"{\"prompt\":["));
    body.push(shared.slice(..1 << 20));
    body.push(Bytes::from_static(b"],\"suffix\":\""));
    body.push(shared.slice(1 << 20..));
    body.push(Bytes::from_static(b"\"}"));
    let mut response = client()
        .post(&url, "/echo", &[], &body)
        .await
        .expect("answer");
    assert_eq!(response.status, 200);
    assert_eq!(read_all(&mut response.body).await, body.to_bytes().to_vec());
}

#[tokio::test]
async fn a_chunked_stream_comes_piece_by_piece() {
    let (url, _) = server().await;
    let client = client();
    let sent = Bytes::from_static(b"data: {\"id\": 1}\n\ndata: [DONE]\n\n");
    let response = client
        .post(&url, "/stream", &[], &sent.clone().into())
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
        .post(&url, "/stream", &[], &sent.clone().into())
        .await
        .expect("answer");
    assert!(response.body.chunk().await.expect("piece").is_some());
    drop(response);
    assert_eq!(client.idle_connections(), 0);
    let mut response = client
        .post(&url, "/echo", &[], &sent.clone().into())
        .await
        .expect("answer");
    assert_eq!(read_all(&mut response.body).await, sent.to_vec());
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "a new connection");
}

/// What a raw server does with one request of a connection.
#[derive(Clone, Copy)]
enum ServerStep {
    /// Writes this answer, then reads the next request.
    Answer(&'static [u8]),
    /// Writes this answer, then closes the connection.
    AnswerAndClose(&'static [u8]),
    /// Closes the connection without answering.
    Close,
}

/// A script in which each connection takes one step of `steps`, in order.
fn once_each<const N: usize>(steps: [ServerStep; N]) -> Vec<Vec<ServerStep>> {
    steps.into_iter().map(|step| vec![step]).collect()
}

/// A raw server: for each connection in turn, what it does with each request
/// it reads.
async fn scripted(script: Vec<Vec<ServerStep>>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        for steps in script {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            counter.fetch_add(1, Ordering::SeqCst);
            for step in steps {
                let mut request = vec![0u8; 64 * 1024];
                if socket.read(&mut request).await.unwrap_or(0) == 0 {
                    break;
                }
                match step {
                    ServerStep::Answer(answer) => socket.write_all(answer).await.expect("write"),
                    ServerStep::AnswerAndClose(answer) => {
                        socket.write_all(answer).await.expect("write");
                        break;
                    }
                    ServerStep::Close => break,
                }
            }
        }
        std::future::pending::<()>().await;
    });
    (url, accepted)
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

fn empty() -> Payload {
    Bytes::from_static(b"{}").into()
}

#[tokio::test]
async fn a_request_that_was_written_is_never_sent_twice() {
    // The engine answers once, then reads the next request and drops the
    // connection without an answer (it may have acted on it).
    let (url, accepted) = scripted(vec![
        vec![ServerStep::Answer(OK), ServerStep::Close],
        vec![ServerStep::Answer(OK)],
    ])
    .await;
    let client = client();
    let mut response = ask(&client, &url).await;
    assert_eq!(read_all(&mut response.body).await, b"ok");
    let result = client.post(&url, "/a", &[], &empty()).await;
    match result {
        Err(err) => assert!(!err.not_sent(), "the engine got it: {err}"),
        Ok(_) => panic!("sent again on a new connection"),
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "no second connection");
}

#[tokio::test]
async fn a_pooled_connection_the_engine_closed_is_not_used() {
    // A keep-alive timeout: the engine closes the idle connection.
    let (url, accepted) = scripted(once_each([
        ServerStep::AnswerAndClose(OK),
        ServerStep::Answer(OK),
    ]))
    .await;
    let client = client();
    let mut response = ask(&client, &url).await;
    assert_eq!(read_all(&mut response.body).await, b"ok");
    assert_eq!(client.idle_connections(), 1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut response = ask(&client, &url).await;
    assert_eq!(read_all(&mut response.body).await, b"ok");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_new_connection_closed_before_an_answer_is_an_error() {
    let (url, _) = scripted(once_each([ServerStep::Close])).await;
    let error = ask_error(&client(), &url).await;
    assert!(
        matches!(error, ClientError::ClosedBeforeResponse),
        "{error:?}"
    );
}

#[tokio::test]
async fn bodies_end_as_framed_and_only_clean_ends_are_reused() {
    let (url, accepted) = scripted(once_each([
        ServerStep::AnswerAndClose(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"),
        ServerStep::AnswerAndClose(b"HTTP/1.1 200 OK\r\n\r\nuntil the end"),
        ServerStep::Answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA"),
        ServerStep::Answer(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"),
        ServerStep::Answer(b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n"),
    ]))
    .await;
    let client = client();
    let mut response = ask(&client, &url).await;
    assert_eq!(
        response.body.chunk().await.expect("piece"),
        Some(Bytes::from("short"))
    );
    assert!(matches!(
        response.body.chunk().await,
        Err(ClientError::Framing(FramingError::Truncated))
    ));
    drop(response);
    for (body, why) in [
        (
            &b"until the end"[..],
            "a close-delimited body ends its connection",
        ),
        (b"ok", "bytes past the body: out of step"),
        (b"ok", "connection: close"),
    ] {
        let mut response = ask(&client, &url).await;
        assert_eq!(read_all(&mut response.body).await, body);
        assert_eq!(client.idle_connections(), 0, "{why}");
    }
    let mut response = ask(&client, &url).await;
    assert_eq!(response.status, 204);
    assert_eq!(
        read_all(&mut response.body).await,
        b"",
        "no body, whatever its length says"
    );
    assert_eq!(client.idle_connections(), 1);
    assert_eq!(accepted.load(Ordering::SeqCst), 5);
}

#[tokio::test]
async fn an_answer_before_the_whole_request_is_still_read() {
    // The engine refuses a large body after its head, and closes.
    let (url, _) = scripted(once_each([ServerStep::AnswerAndClose(
        b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\n\r\ntoo big!",
    )]))
    .await;
    let body = Bytes::from(vec![b' '; 32 << 20]);
    let mut response = client()
        .post(&url, "/a", &[], &body.clone().into())
        .await
        .expect("the answer");
    assert_eq!(response.status, 413);
    assert_eq!(read_all(&mut response.body).await, b"too big!");
}

#[tokio::test]
async fn dropping_a_stream_closes_it_at_the_engine() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut request = vec![0u8; 4096];
        let _ = socket.read(&mut request).await;
        let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
        socket.write_all(answer).await.expect("write");
        let read = socket.read(&mut request).await;
        let _ = closed_tx.send(matches!(read, Ok(0) | Err(_)));
    });
    let mut response = client()
        .post(&url, "/a", &[], &empty())
        .await
        .expect("answer");
    assert_eq!(
        response.body.chunk().await.expect("piece"),
        Some(Bytes::from("hello"))
    );
    drop(response);
    let closed = tokio::time::timeout(Duration::from_secs(5), closed_rx)
        .await
        .expect("the engine sees the end")
        .expect("sent");
    assert!(
        closed,
        "the engine reads the connection's end, so it stops generating"
    );
}

#[tokio::test]
async fn a_truncated_chunked_body_is_an_error() {
    // The engine dies in the middle of a stream.
    let (url, _) = scripted(once_each([ServerStep::AnswerAndClose(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )]))
    .await;
    let mut response = ask(&client(), &url).await;
    let hello = response.body.chunk().await.expect("piece");
    assert_eq!(hello, Some(Bytes::from("hello")));
    assert!(matches!(
        response.body.chunk().await,
        Err(ClientError::Framing(FramingError::Truncated))
    ));
}

#[tokio::test]
async fn interim_answers_are_skipped_within_a_bound() {
    let (url, _) = scripted(once_each([
        ServerStep::Answer(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
        ),
        ServerStep::Answer(
            b"HTTP/1.1 100 A\r\n\r\nHTTP/1.1 100 B\r\n\r\nHTTP/1.1 100 C\r\n\r\n\
              HTTP/1.1 100 D\r\n\r\nHTTP/1.1 100 E\r\n\r\nHTTP/1.1 100 F\r\n\r\n\
              HTTP/1.1 100 G\r\n\r\nHTTP/1.1 100 H\r\n\r\nHTTP/1.1 100 I\r\n\r\n",
        ),
    ]))
    .await;
    let client = client();
    let mut response = ask(&client, &url).await;
    assert_eq!(response.status, 201);
    assert_eq!(read_all(&mut response.body).await, b"ok");
    drop(response);
    // The first connection is pooled; the second one's interim answers never
    // end.
    let _pooled = client.inner.pool.take(url.trim_start_matches("http://"));
    let error = ask_error(&client, &url).await;
    assert!(matches!(error, ClientError::TooManyInterim), "{error:?}");
}

#[tokio::test]
async fn refused_connects_and_bad_urls_are_told_apart() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    drop(listener);
    let error = ask_error(&client(), &url).await;
    assert!(
        matches!(error, ClientError::Connect { refused: true, .. }),
        "{error:?}"
    );
    for url in [
        "https://127.0.0.1:1",
        "http://",
        "http://h:1/base",
        "127.0.0.1:1",
    ] {
        let error = ask_error(&client(), url).await;
        assert!(matches!(error, ClientError::Url(_)), "{url}: {error:?}");
    }
}

#[tokio::test]
async fn a_name_is_resolved() {
    let (url, _) = server().await;
    let url = url.replace("127.0.0.1", "localhost");
    let body = Bytes::from_static(b"{}");
    let mut response = client()
        .post(&url, "/echo", &[], &body.clone().into())
        .await
        .expect("answer");
    assert_eq!(read_all(&mut response.body).await, b"{}");
}

/// Tasks alive on this test's runtime.
fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

#[tokio::test]
async fn a_connect_still_running_on_its_task_ends_with_the_client() {
    // A listener whose accept queue is full: a new connect to it hangs (the
    // kernel drops its SYNs) until the connect timeout.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let listener = socket.listen(1).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let mut queued = Vec::new();
    for _ in 0..8 {
        let connect = TcpStream::connect(addr);
        if let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_millis(200), connect).await {
            queued.push(stream);
        }
    }
    let before = alive_tasks();
    let client = EngineClient::new(Duration::from_secs(30), 8, Duration::from_secs(10));
    let url = format!("http://{addr}");
    let asked = tokio::time::timeout(
        Duration::from_millis(300),
        client.post(&url, "/a", &[], &empty()),
    )
    .await;
    assert!(asked.is_err(), "the connect hangs");
    // The caller gave up; the connect goes on, on its own task (its
    // connection would be pooled for the next request)...
    assert_eq!(alive_tasks(), before + 1);
    // ...until the client is gone, not for the rest of its 30 s.
    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while alive_tasks() > before {
        assert!(
            std::time::Instant::now() < deadline,
            "the connect task outlived the client"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(queued);
}

/// N6: requests to an engine whose name was re-pointed after it registered
/// (from inside `--allowed-upstreams` to outside it) are refused at connect
/// and never reach the new address. Before, each connect resolved the name
/// again with no check.
#[tokio::test]
async fn requests_do_not_follow_a_rebound_name() {
    let places = crate::engines::addresses::testing::places().await;
    let (policy, names) = crate::engines::addresses::testing::rebindable();
    names.point("engine.test", "127.0.0.2");
    let url = format!("http://engine.test:{}", places.port);
    let engines = EngineClient::guarded(Duration::from_secs(1), 8, Duration::from_secs(4), policy);
    let body = Bytes::from_static(b"{}");
    let answer = engines
        .post(&url, "/v1/completions", &[], &body.clone().into())
        .await;
    assert_eq!(answer.map(|r| r.status).ok(), Some(200));
    assert_eq!(places.engine.lock().expect("engine").len(), 1);

    names.point("engine.test", "127.0.0.1");
    let refused = engines
        .post(&url, "/v1/completions", &[], &body.clone().into())
        .await;
    let Err(ClientError::Connect { message, .. }) = refused else {
        panic!("connected to a rebound name");
    };
    assert!(message.contains("outside --allowed-upstreams"), "{message}");
    assert!(
        places.forbidden.lock().expect("forbidden").is_empty(),
        "the rebound address was reached"
    );
}
