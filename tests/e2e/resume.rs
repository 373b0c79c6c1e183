//! End-to-end request resume: a real router, prefill and decoders as real
//! processes on loopback. The first decoder fails at token k in each way the
//! router recognises; the client must see exactly the tokens, text and usage of an
//! uninterrupted run, in one stream or one response, with one resume counted.

use crate::common::*;
use connex_mock_engine::model;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MAX_TOKENS: usize = 16;
const PROMPT: &str = "Resume me, exactly";
/// Microseconds per token of a decoder that crashes: each token is flushed to the
/// router before the next one, so "crash at token k" means k tokens were seen.
const PACE_US: &str = "1000";

/// How the first decoder fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The process exits mid-stream (connection reset).
    Crash,
    /// The stream ends cleanly without a finish_reason.
    Truncate,
    /// An error event with code 500, then the end.
    ErrorEvent,
    /// A last chunk with finish_reason "error" (vLLM's failed request).
    FinishError,
    /// No token within the router's stall timeout.
    Stall,
    /// The process is frozen (SIGSTOP): heartbeats stop and the TTL declares it dead.
    Dead,
    /// The process is frozen (SIGSTOP) with a long heartbeat TTL and stall
    /// timeout: only the router's `/health` probes can declare it dead.
    Hung,
    /// The engine core dies: streams stop, `/health` answers 503, and the
    /// engine keeps heartbeating: only the probes can declare it dead, and
    /// its heartbeats must not bring it back.
    EngineDead,
    /// `drain?migrate=true` while the stream runs.
    Migrate,
    /// HTTP 503 before any token.
    Refuse5xx,
}

impl Fault {
    fn decoder_flags(self, k: usize) -> Vec<String> {
        let k = k.to_string();
        let flags: &[&str] = match self {
            // Paced, so that each token is on the wire before the process dies.
            Fault::Crash => &["--crash-after-tokens", &k, "--decode-us-per-token", PACE_US],
            Fault::Truncate => &["--truncate-after-tokens", &k],
            Fault::ErrorEvent => &["--error-after-tokens", &k],
            Fault::FinishError => &["--finish-error-after-tokens", &k],
            Fault::Stall | Fault::Dead | Fault::Hung | Fault::Migrate => {
                &["--stall-after-tokens", &k]
            }
            Fault::EngineDead => &["--engine-dead-after-tokens", &k],
            Fault::Refuse5xx => &["--fail-status", "503"],
        };
        flags.iter().map(|s| s.to_string()).collect()
    }

    fn router_flags(self) -> Vec<&'static str> {
        // Quick probes and a stall timeout too long to matter: only the probes
        // can catch d0, frozen (with a TTL too long to matter) or heartbeating.
        let probes_only = |ttl_s| {
            vec![
                "--heartbeat-ttl-s",
                ttl_s,
                "--stall-timeout-ms",
                "30000",
                "--health-check-interval-ms",
                "100",
                "--health-check-timeout-ms",
                "200",
                "--health-check-failures",
                "2",
            ]
        };
        match self {
            Fault::Stall => vec!["--stall-timeout-ms", "500"],
            // d0 stands still after its tokens while the test migrates away
            // from it (`trigger`): with the default stall timeout (10 s) the
            // router would resume it on its own, cause `stall`, whenever the
            // test, polling d0 and the journal on a loaded host, took that
            // long to migrate. The stall timeout is put past the test's own
            // bounds: only the migrate moves the stream.
            Fault::Migrate => vec!["--stall-timeout-ms", "300000"],
            Fault::Dead => vec!["--heartbeat-ttl-s", "1"],
            Fault::Hung => probes_only("60"),
            // A TTL of 6 s: d0 heartbeats every 2 s while its probes fail
            // (`assert_stays_out_while_heartbeating`); a 2 s TTL marked the
            // healthy engines dead on a loaded host and the request got 503.
            Fault::EngineDead => probes_only("6"),
            _ => vec![],
        }
    }

    /// The `cause` label the router counts when the fault hits at token `k`.
    fn cause(self) -> &'static str {
        match self {
            // Before the first token too: the decoder had accepted the
            // request (a connect that fails is not a resume at all).
            Fault::Crash => "reset",
            Fault::Truncate => "truncated",
            Fault::ErrorEvent | Fault::FinishError | Fault::Refuse5xx => "5xx",
            Fault::Stall => "stall",
            Fault::Dead | Fault::Hung | Fault::EngineDead => "dead",
            Fault::Migrate => "migrate",
        }
    }
}

/// A router with a prefill, a faulty decoder `d0` and a healthy one `d1`.
/// Round-robin over the sorted ids sends a fresh router's first request to `d0`.
struct Cluster {
    router: Proc,
    _prefill: Proc,
    faulty: Proc,
    healthy: Proc,
}

async fn cluster(fault: Fault, k: usize, router_flags: &[&str]) -> Cluster {
    let flags = [fault.router_flags().as_slice(), router_flags].concat();
    let faulty_flags = fault.decoder_flags(k);
    let faulty_flags: Vec<&str> = faulty_flags.iter().map(String::as_str).collect();
    let (router, [prefill, faulty, healthy]) = failover_cluster(&flags, &faulty_flags, &[]).await;
    Cluster {
        router,
        _prefill: prefill,
        faulty,
        healthy,
    }
}

/// For the faults the test causes from outside: waits until `d0` has emitted `k`
/// tokens (it stalls there), then freezes it or migrates away from it once the
/// router has journaled the `kept` of them whose text it has.
async fn trigger(fault: Fault, cluster: &Cluster, k: usize, kept: usize) {
    if !matches!(fault, Fault::Dead | Fault::Hung | Fault::Migrate) {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let records = engine_requests(&cluster.faulty).await;
        if records
            .iter()
            .any(|r| r["tokens_emitted"] == k && r["outcome"] == "running")
        {
            break;
        }
        assert!(Instant::now() < deadline, "d0 never reached token {k}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if matches!(fault, Fault::Dead | Fault::Hung) {
        cluster.faulty.signal("STOP");
        return;
    }
    // The journal shows the request on d0 with its tokens, before the move. It
    // lags the engine: it names the decoder once the router has taken d0's
    // response head (d0 may have sent tokens by then: the full suite's load
    // once caught it still unnamed), and journals tokens as the client reads
    // them.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let entries = journal(&cluster.router, false).await;
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert!(entries[0].get("prompt_token_ids").is_none(), "not verbose");
        let decoder = &entries[0]["decoder"];
        assert!(decoder.is_null() || decoder == "d0", "{entries:?}");
        if decoder == "d0" && entries[0]["generated_tokens"] == kept {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "journal never reached {kept}: {entries:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reply = client()
        .post(format!(
            "{}/admin/instances/d0/drain?migrate=true",
            cluster.router.internal
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
}

/// A request of the case: completions or chat, stream or not.
#[derive(Debug, Clone, Copy)]
struct Shape {
    chat: bool,
    stream: bool,
}

const SHAPES: [Shape; 4] = [
    Shape {
        chat: false,
        stream: true,
    },
    Shape {
        chat: false,
        stream: false,
    },
    Shape {
        chat: true,
        stream: true,
    },
    Shape {
        chat: true,
        stream: false,
    },
];

impl Shape {
    fn path(self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    fn messages() -> Value {
        json!([{"role":"user","content":PROMPT}])
    }

    fn body(self, extra: Value) -> Value {
        let mut body = if self.chat {
            json!({"model":"mock","messages":Self::messages(),"max_tokens":MAX_TOKENS})
        } else {
            json!({"model":"mock","prompt":PROMPT,"max_tokens":MAX_TOKENS})
        };
        body["return_token_ids"] = json!(true);
        if self.stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        for (key, value) in extra.as_object().into_iter().flatten() {
            body[key] = value.clone();
        }
        body
    }

    fn prompt_ids(self) -> Vec<u32> {
        if self.chat {
            model::tokenize(&model::apply_chat_template(&Self::messages()).unwrap())
        } else {
            model::tokenize(PROMPT)
        }
    }
}

/// What the client got: token ids, text, usage, finish reason, or an error.
#[derive(Debug)]
struct Outcome {
    token_ids: Vec<u32>,
    text: String,
    usage: Value,
    finish_reason: Value,
    error: Option<Value>,
}

async fn request(router: &Proc, shape: Shape, extra: Value) -> Outcome {
    let body = shape.body(extra);
    if !shape.stream {
        let (status, reply) = post(router, shape.path(), &body).await;
        if status != 200 {
            return Outcome {
                token_ids: vec![],
                text: String::new(),
                usage: Value::Null,
                finish_reason: Value::Null,
                error: Some(json!({"status": status, "body": reply})),
            };
        }
        let choice = &reply["choices"][0];
        let text = choice["text"]
            .as_str()
            .or_else(|| choice["message"]["content"].as_str())
            .unwrap_or_default()
            .to_string();
        return Outcome {
            token_ids: ids(&choice["token_ids"]),
            text,
            usage: reply["usage"].clone(),
            finish_reason: choice["finish_reason"].clone(),
            error: None,
        };
    }
    let chunks = stream(router, shape.path(), &body).await;
    assert_eq!(
        chunks.last(),
        Some(&json!("[DONE]")),
        "the stream ends with [DONE]"
    );
    let objects: Vec<&Value> = chunks.iter().filter(|c| c.is_object()).collect();
    let error = objects.iter().find(|c| c.get("error").is_some());
    // One response id for the whole stream, whichever decoder produced a chunk.
    let first_id = &objects[0]["id"];
    if error.is_none() {
        assert!(objects.iter().all(|c| &c["id"] == first_id), "{chunks:?}");
        let object = if shape.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        assert!(objects.iter().all(|c| c["object"] == object), "{chunks:?}");
    }
    let finish_reason = objects
        .iter()
        .filter_map(|c| c.pointer("/choices/0/finish_reason"))
        .find(|r| !r.is_null())
        .cloned()
        .unwrap_or(Value::Null);
    Outcome {
        token_ids: streamed_token_ids(&chunks),
        text: streamed_text(&chunks),
        usage: objects
            .iter()
            .find(|c| c["usage"].is_object())
            .map(|c| c["usage"].clone())
            .unwrap_or(Value::Null),
        finish_reason,
        error: error.map(|e| (*e).clone()),
    }
}

/// How many of the first `n` generated tokens a client has with their text:
/// trailing split tokens wait for the next token's (see `model::is_split`).
fn with_text(generated: &[u32], mut n: usize) -> usize {
    while n > 0 && model::is_split(generated[n - 1]) {
        n -= 1;
    }
    n
}

/// Checks that the client got exactly the uninterrupted run.
fn assert_uninterrupted(outcome: &Outcome, shape: Shape, context: &str) {
    let prompt = shape.prompt_ids();
    let expected = model::generate(&prompt, MAX_TOKENS);
    assert!(outcome.error.is_none(), "{context}: {outcome:?}");
    assert_eq!(outcome.token_ids, expected, "{context}: token ids");
    assert_eq!(
        outcome.text,
        model::detokenize(&expected),
        "{context}: text"
    );
    // The router's counts (a non-stream answer also lists vLLM's null details).
    let mut usage = outcome.usage.clone();
    if let Some(map) = usage.as_object_mut() {
        map.retain(|_, v| !v.is_null());
    }
    assert_eq!(
        usage,
        json!({"prompt_tokens": prompt.len(), "completion_tokens": MAX_TOKENS,
               "total_tokens": prompt.len() + MAX_TOKENS}),
        "{context}: usage"
    );
    assert_eq!(outcome.finish_reason, "length", "{context}");
}

/// One case: `fault` on d0 at token `k`, for a request of `shape`.
async fn resume_case(fault: Fault, k: usize, shape: Shape) {
    let context = format!("{fault:?} at token {k}, {shape:?}");
    let cluster = cluster(fault, k, &[]).await;
    let expected = model::generate(&shape.prompt_ids(), MAX_TOKENS);
    let kept = with_text(&expected, k);
    let (outcome, ()) = tokio::join!(
        request(&cluster.router, shape, json!({})),
        trigger(fault, &cluster, k, kept)
    );
    assert_uninterrupted(&outcome, shape, &context);

    let text = metrics_text(&cluster.router).await;
    assert_eq!(
        metric(&text, "connex_resumes_total", &[]),
        1.0,
        "{context}: {text}"
    );
    assert_eq!(
        metric(
            &text,
            "connex_resumes_total",
            &[&format!("cause=\"{}\"", fault.cause())]
        ),
        1.0,
        "{context}: {text}"
    );
    assert_eq!(
        metric(&text, "connex_resume_latency_seconds_count", &[]),
        1.0
    );
    if matches!(fault, Fault::Hung | Fault::EngineDead) {
        let failed = metric(
            &text,
            "connex_health_check_failures_total",
            &["instance=\"d0\""],
        );
        assert!(failed >= 2.0, "{context}: {text}");
    }

    // The healthy decoder continued the request from the hold: prompt ids plus
    // the tokens generated so far, computing only those itself.
    let records = engine_requests(&cluster.healthy).await;
    assert_eq!(records.len(), 1, "{context}: {records:?}");
    let resumed = &records[0];
    assert_eq!(resumed["body"]["kv_transfer_params"]["resume_epoch"], 1);
    assert_eq!(
        resumed["body"]["kv_transfer_params"]["do_remote_prefill"],
        true
    );
    // It continues after the tokens the client has with their text.
    if kept == 0 {
        assert_eq!(resumed["path"], shape.path(), "{context}");
    } else {
        assert_eq!(resumed["path"], "/v1/completions", "{context}");
        let mut prompt = shape.prompt_ids();
        prompt.extend_from_slice(&expected[..kept]);
        assert_eq!(ids(&resumed["body"]["prompt"]), prompt, "{context}");
        assert_eq!(
            resumed["body"]["max_tokens"],
            MAX_TOKENS - kept,
            "{context}"
        );
        assert_eq!(resumed["computed_prompt_tokens"], kept, "{context}");
    }
    // A decoder the router moved away from while it was alive lost the request.
    if matches!(fault, Fault::Stall | Fault::Migrate) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while engine_requests(&cluster.faulty).await[0]["outcome"] != "aborted" {
            assert!(
                Instant::now() < deadline,
                "{context}: d0's request was not aborted"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(
        journal(&cluster.router, false).await.is_empty(),
        "{context}"
    );
    assert_no_holds_left(&cluster._prefill).await;
    if fault == Fault::EngineDead {
        assert_stays_out_while_heartbeating(&cluster, shape, &context).await;
    }
}

/// A decoder whose probes fail stays out of rotation though it heartbeats on:
/// a heartbeat it sends after the resume (one every third of its 6 s TTL)
/// leaves it dead and unhealthy, and new requests all go to the healthy one,
/// with no failover.
async fn assert_stays_out_while_heartbeating(cluster: &Cluster, shape: Shape, context: &str) {
    let since = Instant::now();
    let d0 = loop {
        let listed = instances(&cluster.router).await;
        let d0 = listed.iter().find(|i| i["id"] == "d0").unwrap().clone();
        let age = Duration::from_millis(d0["last_heartbeat_ms_ago"].as_u64().unwrap());
        if age < since.elapsed() {
            break d0;
        }
        assert!(
            since.elapsed() < Duration::from_secs(6),
            "{context}: d0 stopped heartbeating: {d0}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(d0["state"], "dead", "{context}: {d0}");
    assert_eq!(d0["unhealthy"], true, "{context}: {d0}");
    for _ in 0..3 {
        assert_uninterrupted(
            &request(&cluster.router, shape, json!({})).await,
            shape,
            context,
        );
    }
    assert_eq!(engine_requests(&cluster.faulty).await.len(), 1, "{context}");
    assert_eq!(
        engine_requests(&cluster.healthy).await.len(),
        4,
        "{context}"
    );
    let text = metrics_text(&cluster.router).await;
    assert_eq!(metric(&text, "connex_resumes_total", &[]), 1.0, "{context}");
}

async fn resume_cases(fault: Fault, ks: &[usize]) {
    for &k in ks {
        for shape in SHAPES {
            resume_case(fault, k, shape).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_crash_is_resumed_on_another_decoder() {
    resume_cases(Fault::Crash, &[0, 1, 8, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_closed_without_finish_is_resumed() {
    resume_cases(Fault::Truncate, &[1, 8, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_error_event_is_resumed() {
    resume_cases(Fault::ErrorEvent, &[1, 8, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_finished_with_an_error_is_resumed() {
    resume_cases(Fault::FinishError, &[1, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_decoder_is_resumed() {
    resume_cases(Fault::Stall, &[1, 8, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_declared_dead_is_resumed() {
    resume_cases(Fault::Dead, &[1, 8, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_decoder_failing_health_checks_is_resumed() {
    resume_cases(Fault::Hung, &[1, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_whose_engine_died_is_resumed_and_kept_out() {
    resume_cases(Fault::EngineDead, &[1, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_migrate_moves_live_streams() {
    resume_cases(Fault::Migrate, &[1, 8, MAX_TOKENS - 1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_answering_5xx_is_failed_over() {
    resume_cases(Fault::Refuse5xx, &[0]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_resumed_twice_in_a_row() {
    // Round-robin over the sorted ids, skipping failed decoders, picks d0, then
    // d2, then d1: the first two crash.
    let (router, [_prefill, _d0, _d1, _d2]) = pd_cluster(
        &["--decode-policy", "round_robin"],
        [
            ("prefill", &[]),
            (
                "decode",
                &[
                    "--id",
                    "d0",
                    "--crash-after-tokens",
                    "3",
                    "--decode-us-per-token",
                    PACE_US,
                ],
            ),
            ("decode", &["--id", "d1"]),
            (
                "decode",
                &[
                    "--id",
                    "d2",
                    "--crash-after-tokens",
                    "4",
                    "--decode-us-per-token",
                    PACE_US,
                ],
            ),
        ],
    )
    .await;
    let outcome = request(&router, SHAPES[0], json!({})).await;
    assert_uninterrupted(&outcome, SHAPES[0], "resumed twice");
    let text = metrics_text(&router).await;
    assert_eq!(
        metric(&text, "connex_resumes_total", &["cause=\"reset\""]),
        2.0,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exceeding_max_resumes_ends_with_an_error() {
    for shape in SHAPES {
        let (router, [_prefill, _d0, _d1]) = failover_cluster(
            &["--max-resumes", "1", "--resume-wait-ms", "100"],
            &[
                "--crash-after-tokens",
                "3",
                "--decode-us-per-token",
                PACE_US,
            ],
            &["--truncate-after-tokens", "2"],
        )
        .await;
        let outcome = request(&router, shape, json!({})).await;
        let error = outcome.error.clone().expect("an error, not a truncation");
        let expected = model::generate(&shape.prompt_ids(), MAX_TOKENS);
        if shape.stream {
            // What was streamed before the error is the true prefix: 3 + 2
            // tokens, less any whose text was still held back.
            let sent = with_text(&expected, with_text(&expected, 3) + 2);
            assert_eq!(outcome.token_ids, expected[..sent], "{shape:?}");
            let message = error["error"]["message"].as_str().unwrap();
            assert!(message.contains("gave up after 1 resumes"), "{message}");
        } else {
            assert_eq!(error["status"], 503, "{error}");
            assert!(error["body"]["error"]["message"]
                .as_str()
                .unwrap()
                .contains("gave up after 1 resumes"));
        }
        let text = metrics_text(&router).await;
        assert_eq!(
            metric(&text, "connex_requests_failed_after_resume_total", &[]),
            1.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_decoder_left_ends_with_an_error() {
    for shape in SHAPES {
        let (router, [_prefill, _d0]) = pd_cluster(
            &["--resume-wait-ms", "200"],
            [
                ("prefill", &[]),
                (
                    "decode",
                    &[
                        "--crash-after-tokens",
                        "3",
                        "--decode-us-per-token",
                        PACE_US,
                    ],
                ),
            ],
        )
        .await;
        let outcome = request(&router, shape, json!({})).await;
        let error = outcome.error.expect("an error, not a truncation");
        if shape.stream {
            let message = error["error"]["message"].as_str().unwrap();
            assert!(message.contains("no decode instance"), "{message}");
            let expected = model::generate(&shape.prompt_ids(), MAX_TOKENS);
            assert_eq!(outcome.token_ids.len(), with_text(&expected, 3));
        } else {
            assert_eq!(error["status"], 503, "{error}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guided_output_resumes_saying_which_prompt_tokens_are_generated() {
    // Guided output continues after its first token: the continuation asks
    // the same grammar and says how many of its prompt's last tokens are
    // generated (the decoder's connector replays the grammar over them).
    for shape in [SHAPES[0], SHAPES[2]] {
        let context = format!("{shape:?}");
        let cluster = cluster(Fault::Crash, 3, &[]).await;
        let guided = if shape.chat {
            json!({"response_format": {"type": "json_object"}})
        } else {
            json!({"guided_regex": "( w[0-9]+)+"})
        };
        let outcome = request(&cluster.router, shape, guided.clone()).await;
        assert_uninterrupted(&outcome, shape, &context);
        let expected = model::generate(&shape.prompt_ids(), MAX_TOKENS);
        let kept = with_text(&expected, 3);
        // A chat continues through the tokens API: render gets the client's
        // body, generate the hold's params.
        let records = engine_requests(&cluster.healthy).await;
        let resumed = records
            .iter()
            .find(|r| r["body"]["kv_transfer_params"].is_object())
            .expect("the continuation");
        let kv = &resumed["body"]["kv_transfer_params"];
        assert_eq!(kv["resume_epoch"], 1, "{context}");
        assert_eq!(kv["generated_tokens"], kept, "{context}");
        let (key, value) = guided.as_object().unwrap().iter().next().unwrap();
        assert!(
            records.iter().any(|r| &r["body"][key] == value),
            "{context}: {records:?}"
        );
    }
    // A failure before the first token moves the request with its own body.
    let cluster_early = cluster(Fault::Refuse5xx, 0, &[]).await;
    let outcome = request(
        &cluster_early.router,
        SHAPES[1],
        json!({"logprobs": 1, "n": 1}),
    )
    .await;
    assert!(outcome.error.is_none(), "{outcome:?}");
    let records = engine_requests(&cluster_early.healthy).await;
    assert_eq!(records[0]["path"], "/v1/completions");
    assert_eq!(records[0]["body"]["logprobs"], 1);
}

/// The first decoder sent the echoed prompt: a continuation does not ask
/// for it again, and the client's text is the prompt and every token once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_echo_request_resumes_mid_stream() {
    for shape in SHAPES.into_iter().filter(|s| !s.chat) {
        let cluster = cluster(Fault::Crash, 5, &[]).await;
        // Without token ids: vLLM echoes no prompt text to a request that
        // asks for them.
        let extra = json!({"echo": true, "return_token_ids": false});
        let outcome = request(&cluster.router, shape, extra).await;
        let expected = model::generate(&shape.prompt_ids(), MAX_TOKENS);
        assert!(outcome.error.is_none(), "{shape:?}: {outcome:?}");
        assert_eq!(
            outcome.text,
            format!("{PROMPT}{}", model::detokenize(&expected)),
            "{shape:?}"
        );
        let records = engine_requests(&cluster.healthy).await;
        assert_eq!(records[0]["path"], "/v1/completions", "{shape:?}");
        assert_eq!(records[0]["body"]["echo"], false, "{shape:?}");
        let text = metrics_text(&cluster.router).await;
        assert_eq!(metric(&text, "connex_resumes_total", &[]), 1.0);
    }
}

/// The prefill engine's hold counters.
async fn holder_stats(prefill: &Proc) -> Value {
    engine_stats(prefill).await["holds"].clone()
}

/// Waits until the prefill holds nothing (releases go out after the response).
async fn assert_no_holds_left(prefill: &Proc) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let holds = holder_stats(prefill).await;
        if holds["holds"] == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "holds left: {holds}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A cluster whose prefill frees each hold on its first pull, so that every
/// resume finds the hold gone.
async fn cluster_losing_holds(router_flags: &[&str]) -> (Proc, Proc, Proc, Proc) {
    let mut flags = vec!["--decode-policy", "round_robin"];
    flags.extend_from_slice(router_flags);
    let (router, [prefill, faulty, healthy]) = pd_cluster(
        &flags,
        [
            ("prefill", &["--hold-release", "after_pull"]),
            (
                "decode",
                &[
                    "--id",
                    "d0",
                    "--crash-after-tokens",
                    "5",
                    "--decode-us-per-token",
                    PACE_US,
                ],
            ),
            ("decode", &["--id", "d1"]),
        ],
    )
    .await;
    (router, prefill, faulty, healthy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_hold_is_prefilled_again_with_the_generated_tokens() {
    for shape in [SHAPES[0], SHAPES[3]] {
        let (router, prefill, _faulty, healthy) = cluster_losing_holds(&[]).await;
        let outcome = request(&router, shape, json!({})).await;
        assert_uninterrupted(&outcome, shape, "re-prefill");
        // Prefill ran twice: the prompt, then prompt + the 5 tokens generated.
        let expected = model::generate(&shape.prompt_ids(), MAX_TOKENS);
        let prefills = engine_requests(&prefill).await;
        assert_eq!(prefills.len(), 2, "{prefills:?}");
        let mut context = shape.prompt_ids();
        context.extend_from_slice(&expected[..5]);
        assert_eq!(prefills[1]["path"], "/v1/completions");
        assert_eq!(ids(&prefills[1]["body"]["prompt"]), context);
        assert_eq!(prefills[1]["body"]["max_tokens"], 1);
        // The decoder continued from the new hold: it computed nothing itself.
        let resumed = &engine_requests(&healthy).await[0];
        assert_ne!(
            resumed["body"]["kv_transfer_params"]["transfer_id"],
            prefills[0]["body"]["kv_transfer_params"]["transfer_id"]
        );
        assert_eq!(
            resumed["body"]["kv_transfer_params"]["remote_num_tokens"],
            context.len()
        );
        assert_eq!(resumed["computed_prompt_tokens"], 0);
        let text = metrics_text(&router).await;
        assert_eq!(metric(&text, "connex_reprefills_total", &[]), 1.0, "{text}");
        assert_eq!(metric(&text, "connex_resumes_total", &[]), 1.0, "{text}");
        assert_no_holds_left(&prefill).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_hold_with_the_fail_policy_ends_with_an_error() {
    for shape in [SHAPES[0], SHAPES[1]] {
        let (router, prefill, _faulty, _healthy) =
            cluster_losing_holds(&["--on-hold-lost", "fail"]).await;
        let outcome = request(&router, shape, json!({})).await;
        let error = outcome.error.expect("an error");
        let message = if shape.stream {
            error["error"]["message"].clone()
        } else {
            assert_eq!(error["status"], 503);
            error["body"]["error"]["message"].clone()
        };
        assert!(
            message.as_str().unwrap().contains("--on-hold-lost fail"),
            "{message}"
        );
        assert_eq!(
            engine_requests(&prefill).await.len(),
            1,
            "no second prefill"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_prefill_instance_is_replaced_by_a_prefill_elsewhere() {
    let (router, [mut p0, p1, faulty, _healthy]) = pd_cluster(
        &[
            "--decode-policy",
            "round_robin",
            "--prefill-policy",
            "round_robin",
        ],
        [
            ("prefill", &["--id", "p0"]),
            ("prefill", &["--id", "p1"]),
            ("decode", &["--id", "d0", "--stall-after-tokens", "6"]),
            ("decode", &["--id", "d1"]),
        ],
    )
    .await;
    let cluster = Cluster {
        router,
        _prefill: p1,
        faulty,
        healthy: _healthy,
    };
    let shape = SHAPES[0];
    let (outcome, ()) = tokio::join!(request(&cluster.router, shape, json!({})), async {
        // d0 stalls at token 6; the prefill that holds the KV (p0) dies; then
        // the operator migrates d0's streams away.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !engine_requests(&cluster.faulty)
            .await
            .iter()
            .any(|r| r["tokens_emitted"] == 6)
        {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        p0.kill();
        client()
            .post(format!(
                "{}/admin/instances/d0/drain?migrate=true",
                cluster.router.internal
            ))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .unwrap();
    });
    assert_uninterrupted(&outcome, shape, "prefill died");
    let on_p1 = engine_requests(&cluster._prefill).await;
    assert_eq!(on_p1.len(), 1, "p1 prefilled the context again: {on_p1:?}");
    assert_no_holds_left(&cluster._prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_releases_the_hold_and_aborts_the_decoder() {
    // A prefill that never frees a hold by itself within the test.
    let (router, [prefill, decode]) = pd_cluster(
        &[],
        [
            ("prefill", &["--retain-s", "600"]),
            ("decode", &["--decode-us-per-token", "50000"]),
        ],
    )
    .await;
    let mut response = client()
        .post(format!("{}/v1/completions", router.url))
        .json(&json!({"model":"mock","prompt":PROMPT,"max_tokens":200,"stream":true}))
        .send()
        .await
        .unwrap();
    assert!(response.chunk().await.unwrap().is_some());
    assert_eq!(holder_stats(&prefill).await["holds"], 1);
    drop(response);
    assert_no_holds_left(&prefill).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine_requests(&decode).await[0]["outcome"] != "aborted" {
        assert!(Instant::now() < deadline, "decoder kept generating");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        journal(&router, false).await.is_empty(),
        "journal entry left"
    );
    let text = metrics_text(&router).await;
    assert_eq!(
        metric(
            &text,
            "connex_holds_released_total",
            &["outcome=\"released\""]
        ),
        1.0,
        "{text}"
    );
    // The request is counted, as one whose client went away.
    assert_eq!(
        metric(
            &text,
            "connex_requests_total",
            &["route=\"/v1/completions\"", "status=\"499\""]
        ),
        1.0,
        "{text}"
    );
    assert_eq!(
        metric(&text, "connex_requests_total", &[]),
        1.0,
        "counted once: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_request_keeps_its_hold_alive_for_a_late_resume() {
    // Leases of 1 s; the decode takes ~2.5 s before d0 dies at token 40. The
    // router renews the hold, so the resume pulls it: no second prefill.
    let (router, [prefill, _d0, _d1]) = pd_cluster(
        &["--decode-policy", "round_robin"],
        [
            ("prefill", &["--retain-s", "1"]),
            (
                "decode",
                &[
                    "--id",
                    "d0",
                    "--crash-after-tokens",
                    "40",
                    "--decode-us-per-token",
                    "60000",
                ],
            ),
            ("decode", &["--id", "d1"]),
        ],
    )
    .await;
    let body = json!({"model":"mock","prompt":PROMPT,"max_tokens":48,"stream":true,"return_token_ids":true});
    let chunks = stream(&router, "/v1/completions", &body).await;
    assert_eq!(
        streamed_token_ids(&chunks),
        model::generate(&model::tokenize(PROMPT), 48)
    );
    let text = metrics_text(&router).await;
    assert_eq!(metric(&text, "connex_resumes_total", &[]), 1.0, "{text}");
    assert_eq!(metric(&text, "connex_reprefills_total", &[]), 0.0, "{text}");
    assert!(
        metric(
            &text,
            "connex_holds_renewed_total",
            &["outcome=\"renewed\""]
        ) >= 2.0,
        "{text}"
    );
    assert_eq!(engine_requests(&prefill).await.len(), 1);
    assert_eq!(holder_stats(&prefill).await["expiries"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_every_stream_completes_while_decoders_die_and_return() {
    use rand::{Rng, SeedableRng};
    const STREAMS: usize = 32;
    const TOKENS: usize = 200;
    let decoder_flags = |id: &'static str| vec!["--id", id, "--decode-us-per-token", "5000"];
    let ids = ["d0", "d1", "d2"];
    let (router, prefill, mut decoders) = chaos_cluster(
        &[
            "--decode-policy",
            "least_loaded",
            "--heartbeat-ttl-s",
            "1",
            "--max-resumes",
            "10",
            "--resume-wait-ms",
            "5000",
        ],
        ids.map(decoder_flags),
    )
    .await;

    let streams = TrackedStreams::start(
        &router,
        (0..STREAMS)
            .map(|i| {
                let prompt = format!("chaos stream {i}");
                let body = json!({"model":"mock","prompt":prompt,"max_tokens":TOKENS,
                    "stream":true,"return_token_ids":true});
                (prompt, body)
            })
            .collect(),
        Duration::ZERO,
    );

    // Kill a random decoder and restart it 150 ms later, each time after every
    // live stream has received TOKENS / 9 more tokens (so no stream lives
    // through more than 9 kills, within `--max-resumes 10`, however slow the
    // machine), until the streams are done (bounded: at most 40 kills).
    let mut rng = rand::rngs::StdRng::seed_from_u64(20261203);
    let mut kills = 0;
    let mut at_last_kill = streams.live();
    while !streams.all_finished() && kills < 40 {
        streams.moved_on(&at_last_kill, TOKENS / 9).await;
        let victim = rng.random_range(0..decoders.len());
        at_last_kill = streams.live();
        decoders[victim].kill();
        kills += 1;
        tokio::time::sleep(Duration::from_millis(150)).await;
        decoders[victim] = engine(Some(&router), "decode", &decoder_flags(ids[victim]));
    }
    assert!(kills >= 3, "the streams ended before the chaos began");
    for (prompt, chunks) in streams.results().await {
        assert!(
            chunks.iter().all(|c| c.get("error").is_none()),
            "{prompt}: {chunks:?}"
        );
        assert_eq!(chunks.last(), Some(&json!("[DONE]")));
        assert_eq!(
            streamed_token_ids(&chunks),
            model::generate(&model::tokenize(&prompt), TOKENS),
            "{prompt}"
        );
    }
    let text = metrics_text(&router).await;
    assert!(metric(&text, "connex_resumes_total", &[]) >= 3.0, "{text}");
    assert_eq!(
        metric(&text, "connex_requests_failed_after_resume_total", &[]),
        0.0
    );
    assert_no_holds_left(&prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_character_split_across_the_failure_is_sent_whole() {
    // d0 dies right after a split token (its text held back for the next
    // token's): the client must still get that text, so the resume continues
    // from the token before it, and d1 generates the split token again.
    for shape in SHAPES {
        let expected = model::generate(&shape.prompt_ids(), MAX_TOKENS);
        let split = expected[..MAX_TOKENS - 1]
            .iter()
            .position(|&id| model::is_split(id))
            .expect("the mock model splits some token of this prompt");
        let context = format!("split token at {split}, {shape:?}");
        let cluster = cluster(Fault::Crash, split + 1, &[]).await;
        let outcome = request(&cluster.router, shape, json!({})).await;
        assert_uninterrupted(&outcome, shape, &context);
        let records = engine_requests(&cluster.healthy).await;
        let resumed = &records[0]["body"];
        let mut prompt = shape.prompt_ids();
        prompt.extend_from_slice(&expected[..split]);
        assert_eq!(ids(&resumed["prompt"]), prompt, "{context}");
        assert_eq!(resumed["max_tokens"], MAX_TOKENS - split, "{context}");
    }
}

/// The answer a chat client puts together from a stream or a response:
/// reasoning, content, tool calls (id, name, arguments by index), finish,
/// usage and token ids.
fn chat_answer(shape: Shape, reply: &Value) -> Value {
    if !shape.stream {
        let choice = &reply["choices"][0];
        let message = &choice["message"];
        let calls: Vec<Value> = message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| json!({"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}))
            .collect();
        let mut usage = reply["usage"].clone();
        if let Some(map) = usage.as_object_mut() {
            map.retain(|_, v| !v.is_null());
        }
        return json!({"reasoning": message["reasoning"], "content": message["content"],
            "tool_calls": calls, "finish_reason": choice["finish_reason"], "usage": usage,
            "token_ids": choice["token_ids"]});
    }
    let chunks = reply.as_array().unwrap();
    let mut reasoning: Option<String> = None;
    let mut content: Option<String> = None;
    let mut calls: Vec<Value> = Vec::new();
    let mut finish = Value::Null;
    let mut usage = Value::Null;
    for chunk in chunks.iter().filter(|c| c.is_object()) {
        assert!(chunk.get("error").is_none(), "{chunk}");
        if chunk["usage"].is_object() {
            usage = chunk["usage"].clone();
        }
        let Some(choice) = chunk.pointer("/choices/0") else {
            continue;
        };
        let delta = &choice["delta"];
        if let Some(text) = delta["reasoning"].as_str() {
            reasoning.get_or_insert_with(String::new).push_str(text);
        }
        if let Some(text) = delta["content"].as_str() {
            if !text.is_empty() {
                content.get_or_insert_with(String::new).push_str(text);
            }
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if index == calls.len() {
                calls.push(
                    json!({"id": call["id"], "name": call["function"]["name"], "arguments": ""}),
                );
            }
            assert!(
                index < calls.len(),
                "tool call {index} skipped an index: {chunks:?}"
            );
            if call.get("id").is_some() && index + 1 < calls.len() {
                panic!("tool call {index} opened twice: {chunks:?}");
            }
            let more = call["function"]["arguments"].as_str().unwrap_or_default();
            let arguments = format!("{}{more}", calls[index]["arguments"].as_str().unwrap());
            calls[index]["arguments"] = json!(arguments);
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    json!({"reasoning": reasoning, "content": content, "tool_calls": calls,
        "finish_reason": finish, "usage": usage, "token_ids": streamed_token_ids(chunks)})
}

/// A chat of `shape` with reasoning (and two tools, with `tools`) through
/// `router`: the answer the client puts together.
async fn reasoning_chat(router: &Proc, shape: Shape, tools: bool) -> Value {
    let mut extra = json!({"reasoning_effort": "low"});
    if tools {
        extra["tools"] = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
        ]);
    }
    let body = shape.body(extra);
    let reply = if shape.stream {
        Value::Array(stream(router, shape.path(), &body).await)
    } else {
        let (status, reply) = post(router, shape.path(), &body).await;
        assert_eq!(status, 200, "{reply}");
        reply
    };
    chat_answer(shape, &reply)
}

/// A router with a prefill and two decoders that serve vLLM's tokens API; d0
/// crashes after `k` tokens when `k` is set.
async fn tokens_api_cluster(k: Option<usize>, scale_out: bool) -> Cluster {
    let crash = k.map(|k| Fault::Crash.decoder_flags(k)).unwrap_or_default();
    let crash: Vec<&str> = crash.iter().map(String::as_str).collect();
    let (router, [prefill, faulty, healthy]) = if scale_out {
        scale_out_cluster(&[], &crash).await
    } else {
        failover_cluster(&[], &crash, &[]).await
    };
    Cluster {
        router,
        _prefill: prefill,
        faulty,
        healthy,
    }
}

/// A chat whose decoder dies mid-answer gets the uninterrupted answer:
/// reasoning stays reasoning, a tool call half-streamed goes on in that call
/// under the id the client has, at every kill point: mid-reasoning, at its
/// end, inside a call's arguments, between two calls, mid-content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_and_tool_calls_resume_at_every_kill_point() {
    let reference = tokens_api_cluster(None, true).await;
    let mut expected = std::collections::HashMap::new();
    for tools in [true, false] {
        for shape in SHAPES.into_iter().filter(|s| s.chat) {
            expected.insert(
                (tools, shape.stream),
                reasoning_chat(&reference.router, shape, tools).await,
            );
        }
    }
    // The reference: 8 reasoning tokens, then content (or the two calls'
    // arguments, taking turns).
    let with_tools = &expected[&(true, true)];
    assert_eq!(
        with_tools["tool_calls"].as_array().unwrap().len(),
        2,
        "{with_tools}"
    );
    assert_eq!(
        with_tools["finish_reason"], "length",
        "cut by max_tokens, as vLLM says it"
    );
    assert!(with_tools["reasoning"].as_str().unwrap().len() > 10);
    assert!(expected[&(false, true)]["content"].as_str().unwrap().len() > 10);
    // Kill points: mid-reasoning, the end of the reasoning, inside the first
    // call, between the two calls' openings, inside the second; mid-content.
    let cases = [
        (true, 3),
        (true, 8),
        (true, 9),
        (true, 10),
        (true, 13),
        (false, 11),
    ];
    for (tools, k) in cases {
        for shape in SHAPES.into_iter().filter(|s| s.chat) {
            let context = format!("tools {tools}, killed at {k}, {shape:?}");
            let cluster = tokens_api_cluster(Some(k), true).await;
            let got = reasoning_chat(&cluster.router, shape, tools).await;
            let want = &expected[&(tools, shape.stream)];
            let calls = |answer: &Value| -> Vec<Value> {
                answer["tool_calls"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| json!([c["name"], c["arguments"]]))
                    .collect()
            };
            for key in [
                "reasoning",
                "content",
                "finish_reason",
                "usage",
                "token_ids",
            ] {
                assert_eq!(got[key], want[key], "{context}: {key}: {got}");
            }
            assert_eq!(calls(&got), calls(want), "{context}: {got}");
            // Calls the client saw open before the kill keep their ids; those
            // opened after it have the new decoder's.
            let opened_before = match (tools, k) {
                (true, k) if k > 9 => 2,
                (true, 9) => 1,
                _ => 0,
            };
            for (index, call) in got["tool_calls"].as_array().unwrap().iter().enumerate() {
                let id = call["id"].as_str().unwrap();
                if index < opened_before {
                    assert_eq!(id, want["tool_calls"][index]["id"], "{context}");
                } else {
                    assert_ne!(id, want["tool_calls"][index]["id"], "{context}: a new id");
                    assert!(id.starts_with("chatcmpl-tool-"), "{context}: {id}");
                }
            }
            // The healthy decoder continued through the tokens API, from the
            // hold: it computed only the tokens the client had.
            let records = engine_requests(&cluster.healthy).await;
            assert_eq!(records.len(), 1, "{context}: {records:?}");
            assert_eq!(records[0]["path"], "/inference/v1/generate", "{context}");
            assert_eq!(records[0]["body"]["kv_transfer_params"]["resume_epoch"], 1);
            let kept = ids(&records[0]["body"]["token_ids"]).len() - shape.prompt_ids().len();
            assert!(kept > 0 && kept <= k, "{context}: kept {kept}");
            assert_eq!(records[0]["computed_prompt_tokens"], kept, "{context}");
            let stats = engine_stats(&cluster.healthy).await;
            assert_eq!(stats["render_calls"], 1, "{context}");
            let text = metrics_text(&cluster.router).await;
            assert_eq!(metric(&text, "connex_resumes_total", &[]), 1.0, "{context}");
            assert_no_holds_left(&cluster._prefill).await;
        }
    }
}

/// Decoders without the tokens API (vLLM without `--enable-scale-out`): a
/// plain chat continues through completions as before; a chat with tools
/// ends with an error that says what to start vLLM with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_tokens_api_a_chat_with_tools_fails_clearly() {
    let cluster = tokens_api_cluster(Some(10), false).await;
    let shape = SHAPES[2];
    let body = shape.body(json!({"tools": [{"type": "function", "function": {"name": "f"}}]}));
    let chunks = stream(&cluster.router, shape.path(), &body).await;
    let error = chunks
        .iter()
        .find(|c| c.get("error").is_some())
        .expect("an error event");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("--enable-scale-out"), "{message}");
    assert!(
        message.contains("cannot be resumed after its first token"),
        "{message}"
    );
    let cluster = tokens_api_cluster(Some(5), false).await;
    let outcome = request(&cluster.router, shape, json!({})).await;
    assert_uninterrupted(&outcome, shape, "plain chat without the tokens API");
    let records = engine_requests(&cluster.healthy).await;
    assert_eq!(records[0]["path"], "/v1/completions");
}

/// A request of several choices resumes each unfinished choice as its own
/// sequence, under its own index: every choice gets the uninterrupted
/// tokens, and usage counts each token once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_several_choices_resumes_each_choice() {
    for shape in SHAPES {
        let context = format!("n = 3, {shape:?}");
        let cluster = cluster(Fault::Crash, 5, &[]).await;
        let body = shape.body(json!({"n": 3}));
        let prompt = shape.prompt_ids();
        let expected = model::generate(&prompt, MAX_TOKENS);
        let (choices, usage) = if shape.stream {
            let chunks = stream(&cluster.router, shape.path(), &body).await;
            assert!(
                chunks.iter().all(|c| c.get("error").is_none()),
                "{context}: {chunks:?}"
            );
            let mut ids = vec![Vec::new(); 3];
            let mut text = vec![String::new(); 3];
            let mut finish = vec![Value::Null; 3];
            for chunk in chunks.iter().filter(|c| c.is_object()) {
                for choice in chunk["choices"].as_array().into_iter().flatten() {
                    let index = choice["index"].as_u64().unwrap() as usize;
                    ids[index].extend(crate::common::ids(&choice["token_ids"]));
                    let piece = choice["text"]
                        .as_str()
                        .or_else(|| choice["delta"]["content"].as_str());
                    text[index].push_str(piece.unwrap_or_default());
                    if !choice["finish_reason"].is_null() {
                        finish[index] = choice["finish_reason"].clone();
                    }
                }
            }
            let usage = chunks
                .iter()
                .find(|c| c["usage"].is_object())
                .map(|c| c["usage"].clone());
            (
                (0..3)
                    .map(|i| (ids[i].clone(), text[i].clone(), finish[i].clone()))
                    .collect::<Vec<_>>(),
                usage.unwrap(),
            )
        } else {
            let (status, reply) = post(&cluster.router, shape.path(), &body).await;
            assert_eq!(status, 200, "{context}: {reply}");
            let choices = reply["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    let text = c["text"]
                        .as_str()
                        .or_else(|| c["message"]["content"].as_str())
                        .unwrap()
                        .to_string();
                    (
                        crate::common::ids(&c["token_ids"]),
                        text,
                        c["finish_reason"].clone(),
                    )
                })
                .collect();
            (choices, reply["usage"].clone())
        };
        assert_eq!(choices.len(), 3, "{context}");
        for (ids, text, finish) in &choices {
            assert_eq!(ids, &expected, "{context}");
            assert_eq!(text, &model::detokenize(&expected), "{context}");
            assert_eq!(finish, "length", "{context}");
        }
        assert_eq!(usage["completion_tokens"], 3 * MAX_TOKENS, "{context}");
        // One request per unfinished choice on the healthy decoder, each
        // after that choice's own tokens.
        let records = engine_requests(&cluster.healthy).await;
        assert_eq!(records.len(), 3, "{context}: {records:?}");
        let text = metrics_text(&cluster.router).await;
        assert_eq!(metric(&text, "connex_resumes_total", &[]), 1.0, "{context}");
    }
}

/// A chat that hides its reasoning (`include_reasoning: false`) gets no
/// reasoning, streamed or not, and still resumes after its first tokens
/// (the router asks the decoders for the reasoning and its token ids, which
/// vLLM leaves out for such a request, and hides it itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_hiding_its_reasoning_resumes_without_showing_it() {
    let reference = tokens_api_cluster(None, true).await;
    for shape in SHAPES.into_iter().filter(|s| s.chat) {
        let context = format!("{shape:?}");
        let body = shape.body(json!({"reasoning_effort": "low", "include_reasoning": false}));
        let answer = |router: &Proc| {
            let body = body.clone();
            let url = router.url.clone();
            async move {
                if shape.stream {
                    let response = client()
                        .post(format!("{url}{}", shape.path()))
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    Value::Array(sse_events(&response.text().await.unwrap()))
                } else {
                    client()
                        .post(format!("{url}{}", shape.path()))
                        .json(&body)
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap()
                }
            }
        };
        let whole = chat_answer(shape, &answer(&reference.router).await);
        let cluster = tokens_api_cluster(Some(11), true).await;
        let resumed = chat_answer(shape, &answer(&cluster.router).await);
        assert!(whole["reasoning"].is_null(), "{context}: {whole}");
        assert_eq!(resumed["reasoning"], whole["reasoning"], "{context}");
        assert_eq!(resumed["content"], whole["content"], "{context}");
        assert!(
            whole["content"].as_str().unwrap().len() > 10,
            "{context}: {whole}"
        );
        assert_eq!(resumed["usage"], whole["usage"], "{context}");
        let records = engine_requests(&cluster.healthy).await;
        assert_eq!(records[0]["path"], "/inference/v1/generate", "{context}");
        let kept = ids(&records[0]["body"]["token_ids"]).len() - shape.prompt_ids().len();
        assert!(
            kept > 8,
            "{context}: continued after the tokens the client has ({kept})"
        );
    }
}
