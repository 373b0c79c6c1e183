//! Sessions against scripted engines: one test per failure cause, through the
//! [`Upstream`] seam (the process tests in tests/e2e cover the same causes with
//! real mock engines).

use crate::config::{self, Command, RouterConfig};
use crate::error::ApiError;
use crate::membership::registration::Role;
use crate::membership::{Lifecycle, Registration, Registry};
use crate::pd::deps::FlowDeps;
use crate::pd::record::RequestRecord;
use crate::pd::upstream::{ByteStream, Call, CallError, Opened, Reply, Upstream};
use crate::protocols::openai::client_body::ClientBody;
use crate::protocols::openai::request::{validate, Route};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// One piece of a scripted decode stream.
enum Piece {
    /// An event whose data is this JSON.
    Event(Value),
    /// Raw bytes.
    Raw(&'static [u8]),
    /// Tokens `from..to` as completions chunks, the last one finishing when
    /// `finish` is set.
    Tokens { from: u32, to: u32, finish: bool },
    /// The connection breaks.
    Reset,
    /// Tells the test the stream got here.
    Reached(Arc<Notify>),
    /// Nothing more, ever.
    Hang,
}

/// What one decode call does.
enum Script {
    Refused,
    NoHeaders,
    Status(u16, &'static str),
    Stream(Vec<Piece>),
}

/// An upstream that answers each decode call with the next script, in call
/// order (whichever decoder the policy picks), and records the calls.
#[derive(Default)]
struct Scripted {
    scripts: Mutex<VecDeque<Script>>,
    calls: Mutex<Vec<(String, &'static str, Value)>>,
    /// `/detokenize` calls answered.
    detokenized: Mutex<usize>,
    /// `/tokenize` calls (refused: these engines have no tokenizer).
    tokenized: Mutex<usize>,
}

impl Scripted {
    fn new(scripts: Vec<Script>) -> Arc<Self> {
        Arc::new(Self {
            scripts: Mutex::new(scripts.into()),
            calls: Mutex::default(),
            detokenized: Mutex::default(),
            tokenized: Mutex::default(),
        })
    }

    fn calls(&self) -> Vec<(String, &'static str, Value)> {
        self.calls.lock().expect("calls").clone()
    }
}

/// The scripted tokenizer: token `id` is " t{id}", but for 10 and 11, which
/// together are "é" (its two bytes), and 10 alone its first byte (U+FFFD, as
/// a real tokenizer decodes a character cut short).
fn detokenize(ids: &[u64]) -> String {
    let mut text = String::new();
    let mut i = 0;
    while i < ids.len() {
        match (ids[i], ids.get(i + 1)) {
            (10, Some(11)) => {
                text.push('é');
                i += 1;
            }
            (10, _) => text.push('\u{FFFD}'),
            (id, _) => text.push_str(&format!(" t{id}")),
        }
        i += 1;
    }
    text
}

fn chunk(id: u32, finish: bool) -> Value {
    json!({"id": "e", "choices": [{"index": 0, "text": format!(" t{id}"), "token_ids": [id],
        "finish_reason": if finish { json!("length") } else { Value::Null }}]})
}

fn stream(pieces: Vec<Piece>) -> ByteStream {
    let mut out: Vec<Result<Bytes, String>> = Vec::new();
    let mut tail: Option<Piece> = None;
    let mut reached = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Event(value) => out.push(Ok(Bytes::from(format!("data: {value}\n\n")))),
            Piece::Raw(bytes) => out.push(Ok(Bytes::from_static(bytes))),
            Piece::Tokens { from, to, finish } => {
                for id in from..to {
                    let last = finish && id + 1 == to;
                    out.push(Ok(Bytes::from(format!("data: {}\n\n", chunk(id, last)))));
                }
                if finish {
                    out.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
                }
            }
            Piece::Reset => out.push(Err("connection reset".into())),
            Piece::Reached(notify) => reached.push(notify),
            Piece::Hang => tail = Some(Piece::Hang),
        }
    }
    let head = futures_util::stream::iter(out);
    let notify = futures_util::stream::once(async move {
        for n in reached {
            n.notify_one();
        }
    })
    .filter_map(|()| async { None });
    match tail {
        Some(_) => head
            .chain(notify)
            .chain(futures_util::stream::pending())
            .boxed(),
        None => head.chain(notify).boxed(),
    }
}

impl Upstream for Scripted {
    /// Every whole answer is a prefill's (these tests make no `/render`).
    fn answer<'a>(&'a self, _call: Call<'a>) -> BoxFuture<'a, Result<Reply, CallError>> {
        Box::pin(async {
            let body = json!({"choices": [{"index": 0, "text": "x", "prompt_token_ids": [1, 2, 3]}],
                "kv_transfer_params": {"transfer_id": "t", "do_remote_decode": true}});
            Ok(Reply {
                status: 200,
                body: Bytes::from(body.to_string()),
            })
        })
    }

    /// `/detokenize` as the scripted chunks spell tokens ([`detokenize`]);
    /// no `/tokenize`.
    fn convert<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Reply, CallError>> {
        let body: Value = serde_json::from_slice(&call.body.to_bytes()).unwrap_or(Value::Null);
        if call.path == "/tokenize" {
            *self.tokenized.lock().expect("tokenized") += 1;
        }
        let detokenized = (call.path == "/detokenize").then(|| {
            *self.detokenized.lock().expect("detokenized") += 1;
            let ids: Vec<u64> = body["tokens"]
                .as_array()
                .map(|ids| ids.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            json!({ "prompt": detokenize(&ids) })
        });
        Box::pin(async move {
            if let Some(answer) = detokenized {
                return Ok(Reply {
                    status: 200,
                    body: Bytes::from(answer.to_string()),
                });
            }
            Err(CallError::Connect {
                refused: true,
                message: "no tokenizer in these tests".into(),
            })
        })
    }

    fn decode<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Result<Opened, CallError>> {
        let body: Value = serde_json::from_slice(&call.body.to_bytes()).unwrap_or(Value::Null);
        self.calls
            .lock()
            .expect("calls")
            .push((call.url.to_string(), call.path, body));
        let script = self.scripts.lock().expect("scripts").pop_front();
        Box::pin(async move {
            match script {
                None | Some(Script::Refused) => Err(CallError::Connect {
                    refused: true,
                    message: "refused".into(),
                }),
                Some(Script::NoHeaders) => Err(CallError::NoHeaders(Duration::from_millis(1))),
                Some(Script::Status(status, body)) => Ok(Opened::Status(Reply {
                    status,
                    body: Bytes::from_static(body.as_bytes()),
                })),
                Some(Script::Stream(pieces)) => Ok(Opened::Stream(stream(pieces))),
            }
        })
    }
}

fn config(extra: &[&str]) -> RouterConfig {
    let mut args = vec![
        "connex-router",
        "serve",
        "--stall-timeout",
        "300",
        "--first-token-timeout",
        "300",
        "--resume-wait",
        "0",
        "--health-check-interval",
        "0",
    ];
    args.extend_from_slice(extra);
    match config::load(args.into_iter().map(Into::into).collect()).map(|c| c.command) {
        Ok(Command::Serve(config)) => config,
        other => panic!("config: {other:?}"),
    }
}

/// The flow's dependencies over one prefill and `decoders` decoders, on `upstream`.
async fn cluster(upstream: Arc<Scripted>, decoders: usize, extra: &[&str]) -> Arc<FlowDeps> {
    Arc::new(cluster_deps(upstream, decoders, extra).await)
}

/// [`cluster`]'s dependencies, before they are shared.
async fn cluster_deps(upstream: Arc<Scripted>, decoders: usize, extra: &[&str]) -> FlowDeps {
    let registry = Registry::new(&crate::config::MembershipArgs::with_ttl(
        Duration::from_secs(60),
    ));
    let mut instances = vec![("p0".to_string(), Role::Prefill)];
    instances.extend((0..decoders).map(|i| (format!("d{i}"), Role::Decode)));
    for (id, role) in instances {
        registry
            .register(
                Registration {
                    role,
                    url: format!("http://{id}"),
                    model: "m".into(),
                    ctrl: None,
                    id: Some(id),
                    persistent: false,
                    credential: None,
                },
                crate::membership::Claim::Admin,
            )
            .await
            .expect("register");
    }
    let (deps, _releases) = FlowDeps::new(&config(extra), registry, upstream);
    deps
}

/// Runs a non-stream completions request for 6 tokens; the response's text and
/// resumes, or the error.
async fn complete(deps: &Arc<FlowDeps>) -> Result<(String, u32), ApiError> {
    let body = json!({"model": "m", "prompt": "hi", "max_tokens": 6});
    let (value, resumes) = answer(deps, body).await?;
    Ok((
        value["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string(),
        resumes,
    ))
}

/// Runs the non-stream completions request `body`; the response and resumes.
async fn answer(deps: &Arc<FlowDeps>, body: Value) -> Result<(Value, u32), ApiError> {
    let body = ClientBody::of(body);
    let info = validate(Route::Completions, &body, "r".into(), 1 << 20)?;
    let response = crate::pd::run(
        deps.clone(),
        info,
        body,
        RequestRecord::new("/v1/completions", "r".into()),
    )
    .await?;
    let resumes = response
        .headers()
        .get(crate::pd::RESUMES_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("resumes header");
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    Ok((serde_json::from_slice(&bytes).expect("JSON"), resumes))
}

const WHOLE: &str = " t0 t1 t2 t3 t4 t5";

fn tokens(from: u32, to: u32, finish: bool) -> Piece {
    Piece::Tokens { from, to, finish }
}

/// The continuation body a resume sent: prompt + generated, max_tokens reduced.
fn assert_continues_after(call: &(String, &'static str, Value), generated: &[u32]) {
    assert_eq!(call.1, "/v1/completions");
    let mut prompt = vec![1, 2, 3];
    prompt.extend_from_slice(generated);
    assert_eq!(call.2["prompt"], json!(prompt));
    assert_eq!(call.2["max_tokens"], json!(6 - generated.len()));
}

/// A decoder's stream that sends its first `n` tokens, then fails `how`.
fn fails_after(n: u32, how: Piece) -> Script {
    Script::Stream(vec![tokens(0, n, false), how])
}

/// Runs a completions request over two decoders, the first answering `first`
/// and the second the rest of the tokens from `from`, and checks that the
/// client got the whole text after one resume; the cluster and the calls the
/// engines saw.
async fn completes_after_one_resume(
    first: Script,
    from: u32,
    extra: &[&str],
) -> (Arc<FlowDeps>, Arc<Scripted>) {
    let rest = Script::Stream(vec![tokens(from, 6, true)]);
    let upstream = Scripted::new(vec![first, rest]);
    let deps = cluster(upstream.clone(), 2, extra).await;
    assert_eq!(complete(&deps).await.expect("ok"), (WHOLE.to_string(), 1));
    (deps, upstream)
}

#[tokio::test]
async fn a_reset_mid_stream_resumes_after_the_tokens_the_client_has() {
    let (deps, upstream) = completes_after_one_resume(fails_after(2, Piece::Reset), 2, &[]).await;
    let calls = upstream.calls();
    assert_ne!(calls[0].0, calls[1].0, "another decoder");
    assert_continues_after(&calls[1], &[0, 1]);
    assert!(deps.journal.is_empty());
}

#[tokio::test]
async fn a_truncated_stream_resumes() {
    let (_, upstream) =
        completes_after_one_resume(Script::Stream(vec![tokens(0, 3, false)]), 3, &[]).await;
    assert_continues_after(&upstream.calls()[1], &[0, 1, 2]);
}

#[tokio::test]
async fn a_stall_after_the_first_token_resumes() {
    let (_, upstream) = completes_after_one_resume(fails_after(1, Piece::Hang), 1, &[]).await;
    assert_continues_after(&upstream.calls()[1], &[0]);
}

#[tokio::test]
async fn no_first_token_fails_over_with_the_clients_own_body() {
    let upstream = Scripted::new(vec![
        Script::Stream(vec![Piece::Hang]),
        Script::Stream(vec![tokens(0, 6, true)]),
    ]);
    // A first-token timeout longer than the stall timeout: the stall timer
    // does not run before the first token.
    let deps = cluster(
        upstream.clone(),
        2,
        &["--stall-timeout", "50", "--first-token-timeout", "400"],
    )
    .await;
    let started = std::time::Instant::now();
    assert_eq!(complete(&deps).await.expect("ok"), (WHOLE.to_string(), 1));
    assert!(started.elapsed() >= Duration::from_millis(400));
    let calls = upstream.calls();
    assert_eq!(calls[1].1, "/v1/completions");
    assert_eq!(calls[1].2["prompt"], "hi", "the client's own body");
}

#[tokio::test]
async fn a_trickling_decoder_is_cut_at_the_stall_timeout() {
    // Bytes of an event that never completes: each read would reset a timer
    // measured per read; the stall timer is measured per event.
    let trickle: Vec<Piece> = std::iter::once(tokens(0, 1, false))
        .chain((0..2000).map(|_| Piece::Raw(b"d")))
        .chain(std::iter::once(Piece::Hang))
        .collect();
    completes_after_one_resume(
        Script::Stream(trickle),
        1,
        &["--max-sse-event-bytes", "100000"],
    )
    .await;
}

#[tokio::test]
async fn an_oversized_event_is_a_protocol_failure() {
    completes_after_one_resume(
        Script::Stream(vec![
            tokens(0, 1, false),
            Piece::Raw(&[b'x'; 4096]),
            Piece::Hang,
        ]),
        1,
        &["--max-sse-event-bytes", "1024"],
    )
    .await;
}

#[tokio::test]
async fn no_response_headers_fail_over() {
    completes_after_one_resume(Script::NoHeaders, 0, &[]).await;
}

#[tokio::test]
async fn a_5xx_fails_over_and_a_4xx_reaches_the_client_as_an_openai_error() {
    completes_after_one_resume(Script::Status(503, "busy"), 0, &[]).await;

    let upstream = Scripted::new(vec![Script::Status(
        400,
        r#"{"error":{"message":"max_tokens too large","code":400}}"#,
    )]);
    let deps = cluster(upstream, 2, &[]).await;
    let error = complete(&deps).await.expect_err("refused");
    assert_eq!(error.status().as_u16(), 400);
    assert_eq!(error.body()["error"]["message"], "max_tokens too large");
}

#[tokio::test]
async fn a_protocol_violation_resumes_and_is_never_relayed() {
    let (_, upstream) = completes_after_one_resume(
        Script::Stream(vec![
            tokens(0, 2, false),
            Piece::Event(
                json!({"id": "e", "choices": [{"index": 7, "text": " evil", "token_ids": [99]}]}),
            ),
            tokens(2, 6, true),
        ]),
        2,
        &[],
    )
    .await;
    assert_continues_after(&upstream.calls()[1], &[0, 1]);
}

#[tokio::test]
async fn a_refused_connect_is_not_a_resume() {
    let upstream = Scripted::new(vec![
        Script::Refused,
        Script::Stream(vec![tokens(0, 6, true)]),
    ]);
    // No resume allowed at all: the request still goes on, since the first
    // decoder never had it.
    let deps = cluster(upstream.clone(), 2, &["--max-resumes", "0"]).await;
    assert_eq!(complete(&deps).await.expect("ok"), (WHOLE.to_string(), 0));
    let calls = upstream.calls();
    assert_ne!(calls[0].0, calls[1].0);
    // The decoder that refused is avoided by new requests.
    let refused = calls[0].0.trim_start_matches("http://");
    assert!(deps.outliers.is_suspect(refused));
}

#[tokio::test]
async fn every_resume_spent_fails_the_request_clearly() {
    let upstream = Scripted::new(vec![
        Script::Stream(vec![tokens(0, 1, false), Piece::Reset]),
        Script::Stream(vec![tokens(1, 2, false), Piece::Reset]),
    ]);
    let deps = cluster(upstream, 2, &["--max-resumes", "1"]).await;
    let error = complete(&deps).await.expect_err("gave up");
    assert_eq!(error.status().as_u16(), 503);
    assert!(
        error.to_string().contains("gave up after 1 resumes"),
        "{error}"
    );
    assert!(deps.journal.is_empty());
}

#[tokio::test]
async fn a_decoder_declared_dead_or_migrated_resumes_its_streams() {
    for lifecycle in [Lifecycle::Dead, Lifecycle::Migrating] {
        let reached = Arc::new(Notify::new());
        let upstream = Scripted::new(vec![
            Script::Stream(vec![
                tokens(0, 2, false),
                Piece::Reached(reached.clone()),
                Piece::Hang,
            ]),
            Script::Stream(vec![tokens(2, 6, true)]),
        ]);
        let deps = cluster(upstream.clone(), 2, &["--stall-timeout", "60000"]).await;
        let request = tokio::spawn({
            let deps = deps.clone();
            async move { complete(&deps).await }
        });
        reached.notified().await;
        let first = upstream.calls()[0]
            .0
            .trim_start_matches("http://")
            .to_string();
        deps.registry
            .set_lifecycle(&first, lifecycle)
            .await
            .expect("set");
        let (text, resumes) = request.await.expect("joined").expect("ok");
        assert_eq!((text.as_str(), resumes), (WHOLE, 1), "{lifecycle:?}");
    }
}

/// A completions request with `stops` whose decoder sends `text` and `ids`
/// in one merged chunk, then tokens 20 to 22; the answer's text, stop reason,
/// token ids and completion tokens, and the `/detokenize` calls made.
async fn stop_in_merged(
    stops: &[&str],
    text: &str,
    ids: &[u32],
) -> (Value, Value, Value, Value, usize) {
    let merged = json!({"id": "e", "choices": [{"index": 0, "text": text,
        "token_ids": ids, "finish_reason": null}]});
    let upstream = Scripted::new(vec![Script::Stream(vec![
        Piece::Event(merged),
        tokens(20, 22, true),
    ])]);
    let deps = cluster(upstream.clone(), 1, &[]).await;
    let body = json!({"model": "m", "prompt": "hi", "max_tokens": 6, "stop": stops,
        "return_token_ids": true});
    let (value, resumes) = answer(&deps, body).await.expect("ok");
    assert_eq!(resumes, 0);
    let choice = &value["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    let calls = *upstream.detokenized.lock().expect("detokenized");
    (
        choice["text"].clone(),
        choice["stop_reason"].clone(),
        choice["token_ids"].clone(),
        value["usage"]["completion_tokens"].clone(),
        calls,
    )
}

/// vLLM merges tokens into one chunk when its API server lags; an engine
/// checking each token for the stop keeps the ids through the one that
/// completed it, and so does the router (it asks the decoder's tokenizer).
#[tokio::test]
async fn a_stop_inside_a_merged_chunk_keeps_the_tokens_through_it() {
    let (text, stop, ids, usage, calls) =
        stop_in_merged(&["t1"], " t0 t1 t2 t3", &[0, 1, 2, 3]).await;
    assert_eq!((text, stop), (json!(" t0 "), json!("t1")));
    assert_eq!(
        ids,
        json!([0, 1]),
        "through the token that completed the stop"
    );
    assert_eq!(usage, 2);
    // The prompt's text, the whole chunk's (checked), then a bisection.
    assert!((2..=4).contains(&calls), "{calls} calls");
}

/// Of two stops in one merged chunk, an engine stops at the earlier token,
/// whatever the order the stops were given in.
#[tokio::test]
async fn of_two_stops_in_a_merged_chunk_the_one_that_ends_first_wins() {
    let (text, stop, ids, usage, _) =
        stop_in_merged(&["t3", "t1"], " t0 t1 t2 t3", &[0, 1, 2, 3]).await;
    assert_eq!((text, stop), (json!(" t0 "), json!("t1")));
    assert_eq!((ids, usage), (json!([0, 1]), json!(2)));
}

/// A token that ends inside a character decodes to U+FFFD alone: it does not
/// reach a stop that ends with that character (the next token does).
#[tokio::test]
async fn a_stop_ending_in_a_character_split_across_tokens_keeps_both() {
    let (text, stop, ids, _, _) = stop_in_merged(&["é"], " t0é t2", &[0, 10, 11, 2]).await;
    assert_eq!((text, stop), (json!(" t0"), json!("é")));
    assert_eq!(ids, json!([0, 10, 11]));
}

/// Tokens whose text is not the text relayed are all kept: never too few.
/// Here the first two tokens' text went elsewhere (as reasoning or tool-call
/// text does, outside `content`): counted against the content alone, two
/// tokens would seem to reach the stop.
#[tokio::test]
async fn a_merged_chunk_whose_tokens_are_not_its_text_keeps_them_all() {
    let (text, stop, ids, usage, _) = stop_in_merged(&["t3"], " t2 t3", &[0, 1, 2, 3]).await;
    assert_eq!((text, stop), (json!(" t2 "), json!("t3")));
    assert_eq!((ids, usage), (json!([0, 1, 2, 3]), json!(4)));
}

/// The router's own tokenizer out of time (every permit taken by long
/// prompts, past `--tokenize-timeout`): the request is still served, its
/// prefill chosen by load, and no engine is asked to tokenize it instead,
/// which would double the wait.
#[tokio::test]
async fn a_router_tokenizer_out_of_time_leaves_the_prefill_choice_to_load() {
    let path = std::env::temp_dir().join(format!("connex-tok-{}.json", uuid::Uuid::new_v4()));
    let json = connex_mock_engine::model::tokenizer_json().to_string();
    std::fs::write(&path, json).expect("tokenizer file");
    let tokenizers = crate::pd::tokenizer::Tokenizers::load(&[format!("m={}", path.display())]);
    let _ = std::fs::remove_file(&path);
    let tokenizers = tokenizers.expect("loaded").with_permits(1);
    let busy = tokenizers.permits().acquire_owned().await.expect("permit");
    let upstream = Scripted::new(vec![Script::Stream(vec![Piece::Tokens {
        from: 0,
        to: 6,
        finish: true,
    }])]);
    let extra = [
        "--prefill-policy",
        "cache_aware",
        "--tokenize-timeout",
        "100",
    ];
    let deps = cluster_deps(upstream.clone(), 1, &extra).await;
    let deps = Arc::new(deps.with_tokenizers(tokenizers));
    let started = std::time::Instant::now();
    let answered = tokio::time::timeout(Duration::from_secs(10), complete(&deps)).await;
    let (text, resumes) = answered.expect("served in time").expect("served");
    assert_eq!((text.as_str(), resumes), (" t0 t1 t2 t3 t4 t5", 0));
    assert!(
        started.elapsed() >= Duration::from_millis(100),
        "the router's tokenizer was not waited for"
    );
    assert_eq!(*upstream.tokenized.lock().expect("tokenized"), 0);
    drop(busy);
}

/// Whether `reached` was notified (the scripted stream was read that far).
fn was_reached(reached: &Notify) -> bool {
    futures_util::FutureExt::now_or_never(reached.notified()).is_some()
}

/// A one-decoder cluster whose stream is six tokens, then `after`, then a
/// marker that tells whether the stream was read to its end.
async fn marked_at_the_end(after: Vec<Piece>) -> (Arc<FlowDeps>, Arc<Notify>) {
    let end = Arc::new(Notify::new());
    let mut pieces = vec![tokens(0, 6, true)];
    pieces.extend(after);
    pieces.push(Piece::Reached(end.clone()));
    let deps = cluster(Scripted::new(vec![Script::Stream(pieces)]), 1, &[]).await;
    (deps, end)
}

#[tokio::test]
async fn after_done_the_rest_of_the_response_is_read_so_its_connection_is_kept() {
    let (deps, end) = marked_at_the_end(vec![]).await;
    assert_eq!(complete(&deps).await.expect("ok"), (WHOLE.to_string(), 0));
    drains_end(&deps).await;
    assert!(was_reached(&end), "the response was read to its end");
}

#[tokio::test]
async fn bytes_after_done_are_read_only_up_to_the_drain_bound() {
    let past_the_bound = Piece::Raw(&[b':'; crate::pd::attempt::DRAIN_BYTES + 1]);
    let (deps, end) = marked_at_the_end(vec![past_the_bound]).await;
    assert_eq!(complete(&deps).await.expect("ok"), (WHOLE.to_string(), 0));
    drains_end(&deps).await;
    assert!(!was_reached(&end), "the drain stopped at its bound");
}

/// Waits until the drains of finished responses have ended.
async fn drains_end(deps: &FlowDeps) {
    deps.drains.close();
    deps.drains.wait().await;
}

// A paused clock: nothing in the request itself waits, so if the answer
// waited for the drain, time would have to advance past its bound.
#[tokio::test(start_paused = true)]
async fn a_response_that_never_ends_after_done_is_not_waited_for() {
    let upstream = Scripted::new(vec![Script::Stream(vec![tokens(0, 6, true), Piece::Hang])]);
    let deps = cluster(upstream, 1, &[]).await;
    // The client's answer does not wait for the end of the decoder's response.
    let answer = tokio::time::timeout(crate::pd::attempt::DRAIN_WAIT / 2, complete(&deps)).await;
    assert_eq!(
        answer.expect("in time").expect("ok"),
        (WHOLE.to_string(), 0)
    );
    // Nor does the decoder's load: it ended with the request.
    let decoder = deps.registry.get("d0").expect("d0");
    assert_eq!(decoder.inflight(), 0);
    // The drain gives up at its bound.
    tokio::time::timeout(crate::pd::attempt::DRAIN_WAIT * 10, drains_end(&deps))
        .await
        .expect("the drain ends within its bound");
}

#[tokio::test]
async fn a_stream_cut_at_a_stop_string_is_closed_not_drained() {
    let (deps, end) = marked_at_the_end(vec![]).await;
    let body = json!({"model": "m", "prompt": "hi", "max_tokens": 6, "stop": [" t2"]});
    let (value, _) = answer(&deps, body).await.expect("ok");
    assert_eq!(value["choices"][0]["text"], " t0 t1");
    assert_eq!(value["choices"][0]["finish_reason"], "stop");
    drains_end(&deps).await;
    // The router ended the request before the decoder did: the connection
    // is closed (which aborts the engine's request), never read on.
    assert!(!was_reached(&end));
}
