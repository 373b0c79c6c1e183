//! Faithful OpenAI behaviour (issue 15), on real processes: what a client gets
//! through the router is what the engine alone would have answered.
//!
//! The router streams from its decoder even for a non-stream client and
//! assembles the answer; the reference is a mock engine of the same model
//! answering the same request unstreamed, itself (the mock builds its
//! non-stream answer independently of its stream, as vLLM does).

// Tests fail loudly on anything unexpected; that is what unwrap is for here.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use serde_json::{json, Value};

/// A router with one prefill and one decode engine, and a lone engine of the
/// same model as the reference.
async fn cluster() -> (Proc, Proc, Proc, Proc) {
    let router = router(&[]);
    let prefill = engine(Some(&router), "prefill", &[]);
    let decode = engine(Some(&router), "decode", &[]);
    wait_ready(&router, 2).await;
    let reference = engine(None, "both", &[]);
    (router, prefill, decode, reference)
}

/// An answer without what differs between any two answers (id, created).
fn comparable(mut answer: Value) -> Value {
    if let Some(map) = answer.as_object_mut() {
        map.remove("id");
        map.remove("created");
    }
    answer
}

/// Posts `body` to the router and to the lone engine; both must answer 200
/// with equal bodies.
async fn assert_same_answer(router: &Proc, reference: &Proc, path: &str, body: Value) {
    let (status, through_router) = post(router, path, &body).await;
    assert_eq!(status, 200, "{body}: {through_router}");
    let (status, alone) = post(reference, path, &body).await;
    assert_eq!(status, 200, "{body}: {alone}");
    assert_eq!(
        comparable(through_router),
        comparable(alone),
        "router vs engine for {body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_completions_equal_the_engines_own_answer() {
    let (router, _prefill, _decode, reference) = cluster().await;
    let base = json!({"model":"mock","prompt":"The quick brown fox","max_tokens":9});
    let variants = [
        json!({}),
        json!({"logprobs": 3}),
        json!({"logprobs": 0, "echo": true}),
        json!({"echo": true}),
        json!({"n": 2, "logprobs": 2}),
        json!({"return_token_ids": true, "logprobs": 1}),
        json!({"response_format": {"type": "json_object"}}),
    ];
    for variant in variants {
        let mut body = base.clone();
        body.as_object_mut()
            .unwrap()
            .extend(variant.as_object().unwrap().clone());
        assert_same_answer(&router, &reference, "/v1/completions", body).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_stream_chat_equals_the_engines_own_answer_tools_reasoning_and_logprobs() {
    let (router, _prefill, _decode, reference) = cluster().await;
    let tool = |name: &str| {
        json!({"type":"function","function":{"name":name,"parameters":{"type":"object",
            "properties":{"words":{"type":"string"}}}}})
    };
    let base = json!({"model":"mock","messages":[{"role":"user","content":"Say a few words"}],
        "max_completion_tokens":10});
    let variants = [
        json!({}),
        json!({"logprobs": true, "top_logprobs": 2}),
        json!({"logprobs": true}),
        json!({"n": 3}),
        json!({"tools": [tool("lookup"), tool("store")], "tool_choice": "auto"}),
        json!({"tools": [tool("lookup")], "n": 2, "logprobs": true, "top_logprobs": 1}),
        json!({"reasoning_effort": "low"}),
        json!({"reasoning_effort": "low", "tools": [tool("lookup"), tool("store")]}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"return_token_ids": true}),
    ];
    for variant in variants {
        let mut body = base.clone();
        body.as_object_mut()
            .unwrap()
            .extend(variant.as_object().unwrap().clone());
        assert_same_answer(&router, &reference, "/v1/chat/completions", body).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_tool_calls_and_logprobs_reach_the_client_and_assemble_to_the_answer() {
    let (router, _prefill, _decode, reference) = cluster().await;
    let body = json!({"model":"mock","messages":[{"role":"user","content":"call"}],
        "max_completion_tokens":6,"logprobs":true,"top_logprobs":1,
        "tools":[{"type":"function","function":{"name":"lookup","parameters":{}}}]});
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = stream(&router, "/v1/chat/completions", &streamed).await;
    let arguments: String = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/delta/tool_calls/0/function/arguments"))
        .filter_map(Value::as_str)
        .collect();
    let logprobs = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/logprobs/content"))
        .filter_map(Value::as_array)
        .map(Vec::len)
        .sum::<usize>();
    let (status, alone) = post(&reference, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    assert_eq!(
        alone["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        arguments.as_str()
    );
    assert_eq!(logprobs, 6, "one logprobs entry per token");
}
