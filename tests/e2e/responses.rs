//! `/v1/responses` through prefill/decode (issue 30): every event in order,
//! the stored conversation behind `previous_response_id`, errors in the
//! route's shape, the store's bounds, and a decoder killed mid-response.
//! Part of the resume binary: a response is resumed as a chat is.

use crate::common::*;
use serde_json::{json, Value};

pub(super) async fn create(router: &Proc, body: &Value) -> (u16, String) {
    let response = client()
        .post(format!("{}/v1/responses", router.url))
        .json(body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

pub(super) async fn get(router: &Proc, id: &str) -> (u16, Value) {
    let response = client()
        .get(format!("{}/v1/responses/{id}", router.url))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

fn tools() -> Value {
    json!([{"type": "function", "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_has_every_event_in_order_and_is_stored() {
    let (router, _engines) = scale_out_cluster(&[], &[]).await;
    let body = json!({"model": "mock", "input": "What is the weather?", "stream": true,
                      "max_output_tokens": 12, "reasoning": {"effort": "low"}, "tools": tools()});
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    let numbers: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(
        numbers,
        (0..events.len() as u64).collect::<Vec<_>>(),
        "{text}"
    );
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(&kinds[..2], ["response.created", "response.in_progress"]);
    // The mock answers until max_output_tokens: an incomplete response, in a
    // `response.completed` event as vLLM's own stream ends.
    assert_eq!(kinds.last(), Some(&"response.completed"), "{text}");
    for kind in [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ] {
        assert!(kinds.contains(&kind), "no {kind}: {kinds:?}");
    }
    let done = &events.last().unwrap()["response"];
    assert_eq!(done["status"], "incomplete");
    assert_eq!(done["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(done["usage"]["output_tokens"], 12);
    let output = done["output"].as_array().unwrap();
    assert_eq!(output[0]["type"], "reasoning");
    let call = output
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap();
    assert_eq!(call["name"], "get_weather");
    // The deltas add up to the items.
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(call["arguments"].as_str().unwrap(), deltas);
    // Stored: GET gives the same response.
    let (status, stored) = get(&router, done["id"].as_str().unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(&stored, done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_carries_the_stored_conversation_to_any_engine() {
    let (router, engines) = scale_out_cluster(&[], &[]).await;
    let first = json!({"model": "mock", "input": "Weather in Paris?", "max_output_tokens": 6,
                       "tools": tools(), "instructions": "Use the tools."});
    let (status, text) = create(&router, &first).await;
    assert_eq!(status, 200, "{text}");
    let first: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(first["object"], "response");
    assert_eq!(first["status"], "incomplete");
    let call = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .cloned()
        .unwrap();
    let second = json!({"model": "mock", "previous_response_id": first["id"], "max_output_tokens": 4,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]});
    let (status, text) = create(&router, &second).await;
    assert_eq!(status, 200, "{text}");
    let second: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(second["previous_response_id"], first["id"]);
    // The prefill saw the whole conversation: the first turn's question, its
    // call, and the call's output (the instructions are not carried over).
    let requests = engine_requests(&engines[0]).await;
    let messages = &requests.last().unwrap()["body"]["messages"];
    assert_eq!(
        messages[0],
        json!({"role": "user", "content": "Weather in Paris?"}),
        "{messages}"
    );
    assert_eq!(messages[1]["tool_calls"][0]["id"], call["call_id"]);
    assert_eq!(
        messages[2],
        json!({"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"})
    );
    // Each turn on its own decoder (round robin): the conversation lives in
    // the router, not in an engine.
    assert_eq!(engine_requests(&engines[1]).await.len(), 1);
    assert_eq!(engine_requests(&engines[2]).await.len(), 1);
}

/// The keys of a JSON object, in its order.
fn keys(object: &Value) -> Vec<&str> {
    object
        .as_object()
        .map(|map| map.keys().map(String::as_str).collect())
        .unwrap_or_default()
}

/// A JSON schema's properties reach the engines in the order the client
/// declared them: vLLM's grammar (xgrammar) writes an object's members in
/// that order, so a router that sorted them (a map without order) would
/// change the answer, e.g. `{"motto":..,"season":..,"warm":..}` for a schema
/// that declares `motto, warm, season`. Likewise a tool's parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_schemas_properties_reach_the_engines_in_their_declared_order() {
    let (router, engines) = scale_out_cluster(&[], &[]).await;
    let schema = json!({"type": "object", "properties": {
        "motto": {"type": "string"}, "warm": {"type": "boolean"},
        "season": {"type": "object", "properties": {"when": {"type": "string"}, "early": {"type": "boolean"}}}},
        "required": ["motto", "warm", "season"]});
    let tool = json!({"type": "function", "name": "plan", "parameters": {"type": "object",
        "properties": {"zone": {"type": "string"}, "at": {"type": "string"}}}});
    let body = json!({"model": "mock", "input": "A city?", "max_output_tokens": 4, "tools": [tool],
        "text": {"format": {"type": "json_schema", "name": "city", "schema": schema}}});
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    for engine in [&engines[0], &engines[1]] {
        let requests = engine_requests(engine).await;
        let sent = &requests.last().unwrap()["body"];
        let schema = &sent["response_format"]["json_schema"]["schema"];
        assert_eq!(
            keys(&schema["properties"]),
            ["motto", "warm", "season"],
            "{sent}"
        );
        assert_eq!(
            keys(&schema["properties"]["season"]["properties"]),
            ["when", "early"],
            "{sent}"
        );
        let parameters = &sent["tools"][0]["function"]["parameters"];
        assert_eq!(keys(&parameters["properties"]), ["zone", "at"], "{sent}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_come_in_the_routes_shape_and_the_store_is_bounded() {
    let (router, _engines) = scale_out_cluster(&["--max-stored-responses", "2"], &[]).await;
    for (body, status, said) in [
        (
            json!({"model": "mock", "input": "x", "temprature": 1}),
            400,
            "temprature",
        ),
        (json!({"model": "mock", "input": []}), 400, "input"),
        (
            json!({"model": "mock", "input": "x", "previous_response_id": "resp_nope"}),
            404,
            "resp_nope",
        ),
        (json!({"model": "nope", "input": "x"}), 404, "nope"),
        // Neither OpenAI's nor vLLM's.
        (
            json!({"model": "mock", "input": "x", "top_n": 2}),
            400,
            "`top_n` is not a Responses request field",
        ),
        // vLLM's, but the router's own to set.
        (
            json!({"model": "mock", "input": "x", "kv_transfer_params": {"do_remote_decode": true}}),
            400,
            "not taken from clients",
        ),
        (
            json!({"model": "mock", "input": "x", "chat_template_kwargs": true}),
            400,
            "`chat_template_kwargs` must be an object",
        ),
    ] {
        let (got, text) = create(&router, &body).await;
        assert_eq!(got, status, "{body}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert!(
            error["error"]["message"].as_str().unwrap().contains(said),
            "{text}"
        );
    }
    // store: false keeps nothing.
    let (_, text) = create(
        &router,
        &json!({"model": "mock", "input": "x", "store": false,
                                             "max_output_tokens": 2}),
    )
    .await;
    let unstored: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(get(&router, unstored["id"].as_str().unwrap()).await.0, 404);
    // Three stored into a store of two: the oldest is gone.
    let mut ids = Vec::new();
    for i in 0..3 {
        let (_, text) = create(
            &router,
            &json!({"model": "mock", "input": format!("turn {i}"),
                                                 "max_output_tokens": 2}),
        )
        .await;
        let response: Value = serde_json::from_str(&text).unwrap();
        ids.push(response["id"].as_str().unwrap().to_string());
    }
    assert_eq!(get(&router, &ids[0]).await.0, 404);
    assert_eq!(get(&router, &ids[2]).await.0, 200);
    // Deleted: gone, and a second delete is 404.
    let delete = || {
        client()
            .delete(format!("{}/v1/responses/{}", router.url, ids[2]))
            .send()
    };
    let deleted: Value = delete().await.unwrap().json().await.unwrap();
    assert_eq!(deleted["deleted"], true);
    assert_eq!(delete().await.unwrap().status(), 404);
    assert_eq!(get(&router, &ids[2]).await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_killed_mid_response_is_resumed_into_one_response() {
    // An uninterrupted run first, on a cluster of healthy decoders.
    let body = json!({"model": "mock", "input": "Resume this response", "stream": true,
                      "max_output_tokens": 24, "reasoning": {"effort": "low"}, "tools": tools()});
    // The second time d0 dies after 10 tokens (inside the reasoning); d1 goes on.
    let Resumed {
        uninterrupted: (_, text),
        resumed: (status, resumed_text),
        router,
        engines: _engines,
    } = uninterrupted_then_resumed(async |router| create(router, &body).await).await;
    let whole = sse_events(&text).last().unwrap()["response"].clone();
    let text = resumed_text;
    assert_eq!(status, 200);
    let events = sse_events(&text);
    assert!(!events.iter().any(|e| e["type"] == "error"), "{text}");
    let numbers: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    let resumed = &events.last().unwrap()["response"];
    assert_eq!(resumed["status"], "incomplete", "{text}");
    // The same items as the uninterrupted run (ids aside).
    let strip = |response: &Value| -> Vec<Value> {
        response["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| {
                let mut item = item.clone();
                item.as_object_mut().unwrap().remove("id");
                item.as_object_mut().unwrap().remove("call_id");
                item
            })
            .collect()
    };
    assert_eq!(strip(resumed), strip(&whole));
    // The call id the client saw when the call started is the one it ends with.
    let added = events
        .iter()
        .find(|e| e["type"] == "response.output_item.added" && e["item"]["type"] == "function_call")
        .unwrap();
    let call = resumed["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap();
    assert_eq!(added["item"]["call_id"], call["call_id"]);
    assert_eq!(resumed["usage"]["output_tokens"], 24);
    let metrics = metrics_text(&router).await;
    assert_eq!(
        metric(&metrics, "connex_resumes_total", &[]),
        1.0,
        "{metrics}"
    );
}

/// vLLM's own request fields a test sends (and which the engines must get):
/// the sampling extras and `chat_template_kwargs` (how a client turns Qwen3's
/// thinking off).
pub(super) fn vllm_extras() -> Value {
    json!({"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "seed": 7,
           "stop_token_ids": [3], "ignore_eos": false, "skip_special_tokens": false,
           "vllm_xargs": {"mock_note": "kept"},
           "chat_template_kwargs": {"enable_thinking": false}})
}

/// `body` with every field of `extras`.
pub(super) fn with_extras(mut body: Value, extras: &Value) -> Value {
    for (key, value) in extras.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// Asserts that `body` (an engine's record of a chat request) has every
/// field of `extras` as the client sent it.
pub(super) fn assert_carries(body: &Value, extras: &Value, context: &str) {
    for (key, value) in extras.as_object().unwrap() {
        assert_eq!(&body[key], value, "{context}: {key} in {body}");
    }
}

/// Asserts that a continuation on `decoder` (vLLM's tokens API) rendered a
/// chat that has every field of `extras`, and generated with the sampling
/// parameters vLLM makes of them (`vllm_xargs` as `extra_args`).
pub(super) async fn assert_continued_with(decoder: &Proc, extras: &Value) {
    let stats = engine_stats(decoder).await;
    assert_carries(&stats["last_render"], extras, "the continuation's render");
    let requests = stats["requests"].as_array().unwrap();
    let generate = requests
        .iter()
        .find(|r| r["path"] == "/inference/v1/generate")
        .unwrap_or_else(|| panic!("no continuation on the second decoder: {requests:?}"));
    let sampling = &generate["body"]["sampling_params"];
    for key in [
        "top_k",
        "min_p",
        "repetition_penalty",
        "seed",
        "stop_token_ids",
    ] {
        assert_eq!(sampling[key], extras[key], "{key} in {sampling}");
    }
    assert_eq!(sampling["extra_args"], extras["vllm_xargs"], "{sampling}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_fields_reach_prefill_decode_and_a_resume() {
    let extras = vllm_extras();
    let body = with_extras(
        json!({"model": "mock", "input": "Resume with vLLM's fields", "stream": true,
               "max_output_tokens": 24, "reasoning": {"effort": "low"}}),
        &extras,
    );
    // d0 dies after 10 tokens (inside the reasoning); d1 continues.
    let crashing = [
        "--crash-after-tokens",
        "10",
        "--decode-us-per-token",
        "1000",
    ];
    let (router, engines) = scale_out_cluster(&[], &crashing).await;
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    let events = sse_events(&text);
    assert!(!events.iter().any(|e| e["type"] == "error"), "{text}");
    let done = &events.last().unwrap()["response"];
    assert_eq!(done["usage"]["output_tokens"], 24, "{text}");
    // The response object repeats OpenAI's fields only, as vLLM's does.
    assert!(done.get("chat_template_kwargs").is_none(), "{done}");
    // (d0 is gone: what a decoder is sent, the next test reads.)
    let prefill = engine_requests(&engines[0]).await;
    assert_carries(&prefill[0]["body"], &extras, "the prefill");
    assert_continued_with(&engines[2], &extras).await;
    let metrics = metrics_text(&router).await;
    assert_eq!(metric(&metrics, "connex_resumes_total", &[]), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_and_hidden_reasoning_reach_prefill_and_decode() {
    let (router, engines) = scale_out_cluster(&[], &[]).await;
    let structured = json!({"regex": "w[0-9]+"});
    let extras = with_extras(vllm_extras(), &json!({"structured_outputs": structured}));
    let body = with_extras(
        json!({"model": "mock", "input": "Think, but do not show it",
               "max_output_tokens": 8, "reasoning": {"effort": "low"},
               "include_reasoning": false}),
        &extras,
    );
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    let response: Value = serde_json::from_str(&text).unwrap();
    // The mock reasons half of its tokens: none of it shows.
    let kinds: Vec<&str> = response["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["message"], "{text}");
    assert_eq!(response["usage"]["output_tokens"], 8);
    for (engine, what) in [(&engines[0], "prefill"), (&engines[1], "decoder")] {
        let requests = engine_requests(engine).await;
        assert_carries(&requests[0]["body"], &extras, what);
    }
    // The same request streamed shows no reasoning event either.
    let (status, text) = create(&router, &with_extras(body, &json!({"stream": true}))).await;
    assert_eq!(status, 200, "{text}");
    assert!(!text.contains("reasoning_text"), "{text}");
}

/// A [`failover_cluster`] of decoders that answer like a model
/// (`--eos-after-tokens 16`) with the tokens API; d0 with `d0_flags` too.
async fn ending_cluster(d0_flags: &[&str]) -> (Proc, [Proc; 3]) {
    let model = ["--enable-scale-out", "--eos-after-tokens", "16"];
    failover_cluster(&[], &[&model[..], d0_flags].concat(), &model).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_ends_calls_its_tool_then_answers_the_result() {
    let (router, _engines) = ending_cluster(&[]).await;
    // Turn one, streamed: the model calls the tool and stops there.
    let first = json!({"model": "mock", "input": "Weather in Paris?", "stream": true,
                       "max_output_tokens": 64, "reasoning": {"effort": "low"}, "tools": tools()});
    let (status, text) = create(&router, &first).await;
    assert_eq!(status, 200, "{text}");
    let done = sse_events(&text).last().unwrap().clone();
    assert_eq!(done["type"], "response.completed", "{text}");
    let first = &done["response"];
    assert_eq!(first["status"], "completed", "{first}");
    assert_eq!(first["usage"]["output_tokens"], 16);
    let call = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .cloned()
        .unwrap();
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(arguments["words"].is_string(), "{call}");
    // Turn two, the tool's output chained by id: the model answers in text.
    let second = json!({"model": "mock", "previous_response_id": first["id"], "tools": tools(),
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]});
    let (status, text) = create(&router, &second).await;
    assert_eq!(status, 200, "{text}");
    let second: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(second["status"], "completed", "{second}");
    let kinds: Vec<&str> = second["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["message"], "{second}");
    // Fifteen words, then the end-of-sequence token (no text).
    let answer = second["output"][0]["content"][0]["text"].as_str().unwrap();
    assert_eq!(answer.split_whitespace().count(), 15, "{answer}");
    assert_eq!(second["usage"]["output_tokens"], 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_ends_is_resumed_to_its_end() {
    let body = json!({"model": "mock", "input": "Call it across a kill", "stream": true,
                      "max_output_tokens": 64, "reasoning": {"effort": "low"}, "tools": tools()});
    let (router, _engines) = ending_cluster(&[]).await;
    let whole = create(&router, &body).await;
    drop(router);
    // d0 dies after 10 of the 16 tokens (inside the call's arguments).
    let crashing = [
        "--crash-after-tokens",
        "10",
        "--decode-us-per-token",
        "1000",
    ];
    let (router, _engines) = ending_cluster(&crashing).await;
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    let resumed = &sse_events(&text).last().unwrap()["response"].clone();
    let whole = &sse_events(&whole.1).last().unwrap()["response"].clone();
    assert_eq!(resumed["status"], "completed", "{text}");
    assert_eq!(resumed["usage"]["output_tokens"], 16);
    let call = |response: &Value| {
        let output = response["output"].as_array().unwrap();
        let call = output
            .iter()
            .find(|i| i["type"] == "function_call")
            .unwrap();
        (call["name"].clone(), call["arguments"].clone())
    };
    assert_eq!(call(resumed), call(whole));
    let metrics = metrics_text(&router).await;
    assert_eq!(metric(&metrics, "connex_resumes_total", &[]), 1.0);
}

/// Reads a background response's events from `starting_after` until `take`
/// events came (then lets go) or the stream ended.
pub(super) async fn reattach(
    router: &Proc,
    id: &str,
    starting_after: Option<u64>,
    take: usize,
) -> Vec<Value> {
    let mut url = format!("{}/v1/responses/{id}?stream=true", router.url);
    if let Some(n) = starting_after {
        url.push_str(&format!("&starting_after={n}"));
    }
    let mut response = client().get(url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let mut text = String::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
        if sse_events(&text).len() >= take {
            break;
        }
    }
    let mut got = sse_events(&text);
    got.truncate(take);
    got
}

/// `POST /v1/responses/{id}/cancel` through `router`: the response it answers.
pub(super) async fn cancel(router: &Proc, id: &str) -> Value {
    client()
        .post(format!("{}/v1/responses/{id}/cancel", router.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// `decoder`'s last request stopped (its stream closed) short of `tokens`.
pub(super) async fn assert_stopped_short(decoder: &Proc, tokens: u64) {
    eventually(
        std::time::Duration::from_secs(5),
        "the decoder stopped",
        || async {
            let requests = engine_requests(decoder).await;
            requests.last().is_some_and(|r| r["outcome"] != "running")
        },
    )
    .await;
    let emitted = engine_requests(decoder).await.last().unwrap()["tokens_emitted"]
        .as_u64()
        .unwrap();
    assert!(emitted < tokens, "{emitted}");
}

/// The events of background response `id` through `router`: the first
/// `first` of them, then (after `between`) the rest through `then`, read
/// after the last one seen. Asserts each came once, in order.
pub(super) async fn read_across(
    router: &Proc,
    then: &Proc,
    id: &str,
    first: usize,
    between: impl std::future::Future<Output = ()>,
) -> Vec<Value> {
    let mut all = reattach(router, id, None, first).await;
    let last_seen = all.last().unwrap()["sequence_number"].as_u64().unwrap();
    between.await;
    all.extend(reattach(then, id, Some(last_seen), usize::MAX).await);
    let numbers: Vec<u64> = all
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(
        numbers,
        (0..all.len() as u64).collect::<Vec<_>>(),
        "each event exactly once"
    );
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_is_read_again_from_any_event() {
    let (router, _engines) = scale_out_cluster(&[], &["--decode-us-per-token", "20000"]).await;
    let body = json!({"model": "mock", "input": "Run in the background", "background": true,
                      "max_output_tokens": 40});
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    let queued: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(queued["background"], true);
    assert!(
        ["queued", "in_progress"].contains(&queued["status"].as_str().unwrap()),
        "{queued}"
    );
    let id = queued["id"].as_str().unwrap();
    // A reader that leaves after 6 events, then one that comes back after them.
    let all = read_across(&router, &router, id, 6, async {}).await;
    let numbers: Vec<u64> = all
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(all.last().unwrap()["type"], "response.completed");
    let done = &all.last().unwrap()["response"];
    assert_eq!(done["usage"]["output_tokens"], 40);
    // From the start again: the same events; past the end: none, at once.
    assert_eq!(reattach(&router, id, None, usize::MAX).await, all);
    let last = *numbers.last().unwrap();
    assert!(reattach(&router, id, Some(last), usize::MAX)
        .await
        .is_empty());
    // And the stored response is the finished one.
    let (status, stored) = get(&router, id).await;
    assert_eq!(status, 200);
    assert_eq!(&stored, done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_can_be_cancelled_and_a_stored_one_cannot_be_streamed() {
    let (router, engines) = scale_out_cluster(&[], &["--decode-us-per-token", "50000"]).await;
    let body = json!({"model": "mock", "input": "Cancel me", "background": true,
                      "max_output_tokens": 400});
    let (_, text) = create(&router, &body).await;
    let id = serde_json::from_str::<Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Some tokens first.
    let seen = reattach(&router, &id, None, 8).await;
    assert_eq!(seen.len(), 8);
    let cancelled = cancel(&router, &id).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert_eq!(get(&router, &id).await.1["status"], "cancelled");
    // The decoder's stream was closed: the decoder stops well short of 400.
    assert_stopped_short(&engines[1], 400).await;
    // A response made without background is stored, not streamed again,
    // and cannot be cancelled.
    let (_, text) = create(
        &router,
        &json!({"model": "mock", "input": "x", "max_output_tokens": 2}),
    )
    .await;
    let plain = serde_json::from_str::<Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let streamed = client()
        .get(format!("{}/v1/responses/{plain}?stream=true", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 400);
    let cancel = client()
        .post(format!("{}/v1/responses/{plain}/cancel", router.url))
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 400);
    // background needs store.
    let (status, _) = create(
        &router,
        &json!({"model": "mock", "input": "x", "background": true,
                                               "store": false}),
    )
    .await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_that_cannot_start_takes_no_place() {
    // One place for background responses: one that failed to start (no such
    // model) must not hold it.
    let (router, _engines) = scale_out_cluster(&["--max-background-responses", "1"], &[]).await;
    let (status, _) = create(
        &router,
        &json!({"model": "nope", "input": "x", "background": true}),
    )
    .await;
    assert_eq!(status, 404);
    let body = json!({"model": "mock", "input": "x", "background": true, "max_output_tokens": 2});
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_no_engine_reads_are_held_to_openais_limits() {
    // Issue 40: 25 MB of `metadata` cost the engine nothing and the router
    // about four copies per response; OpenAI's own limits hold now.
    let (router, _engines) = scale_out_cluster(&[], &[]).await;
    let pairs = |n: usize, value: &str| -> Value {
        (0..n)
            .map(|i| (format!("key{i}"), json!(value)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let body = |extra: Value| {
        let mut body = json!({"model": "mock", "input": "x", "max_output_tokens": 2,
                              "background": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    for (extra, param, said) in [
        (json!({"metadata": pairs(17, "v")}), "metadata", "16 pairs"),
        (
            json!({"metadata": {"k": "v".repeat(2_000_000)}}),
            "metadata",
            "512 characters",
        ),
        (
            json!({"metadata": {"k".repeat(65): "v"}}),
            "metadata",
            "64 characters",
        ),
        (
            json!({"metadata": {"k": {"nested": 1}}}),
            "metadata",
            "strings",
        ),
        (
            json!({"reasoning": {"effort": "low", "notes": "x".repeat(100_000)}}),
            "reasoning",
            "reasoning.notes",
        ),
        (
            json!({"text": {"format": {"type": "text"}, "extra": "x".repeat(100_000)}}),
            "text",
            "text.extra",
        ),
    ] {
        let (status, text) = create(&router, &body(extra)).await;
        assert_eq!(status, 400, "{text:.300}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["type"], "invalid_request_error", "{text}");
        assert_eq!(error["error"]["param"], param, "{text}");
        assert!(
            error["error"]["message"].as_str().unwrap().contains(said),
            "{text}"
        );
    }
    // At the limits: served, and echoed as asked.
    let full = pairs(16, &"v".repeat(512));
    let (status, text) = create(
        &router,
        &body(json!({"metadata": full, "reasoning": {"effort": "low", "summary": "auto"}})),
    )
    .await;
    assert_eq!(status, 200, "{text:.300}");
    let created: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(created["metadata"], full);
    assert_eq!(created["reasoning"]["summary"], "auto");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_background_logs_are_bounded_in_bytes() {
    // Each finished log here is about 40 KB (its metadata in three events
    // and its response): 100 KB keeps the last two or so, not all six.
    let (router, _engines) =
        scale_out_cluster(&["--max-background-response-bytes", "100000"], &[]).await;
    let metadata: serde_json::Map<String, Value> = (0..16)
        .map(|i| (format!("key{i}"), json!("v".repeat(512))))
        .collect();
    let mut ids = Vec::new();
    for i in 0..6 {
        let body = json!({"model": "mock", "input": format!("turn {i}"), "background": true,
                          "max_output_tokens": 2, "metadata": metadata});
        let (status, text) = create(&router, &body).await;
        assert_eq!(status, 200, "{text:.300}");
        let id = serde_json::from_str::<Value>(&text).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        // Read to its end: done before the next one starts.
        let events = reattach(&router, &id, None, usize::MAX).await;
        assert_eq!(events.last().unwrap()["type"], "response.completed");
        ids.push(id);
    }
    let replays = |id: String| {
        let url = format!("{}/v1/responses/{id}?stream=true", router.url);
        async move { client().get(url).send().await.unwrap().status().as_u16() }
    };
    // The oldest logs are forgotten (their stored responses stay); the
    // newest is read again.
    assert_eq!(replays(ids[0].clone()).await, 400);
    assert_eq!(replays(ids[5].clone()).await, 200);
    for id in &ids {
        let (status, stored) = get(&router, id).await;
        // Stopped at max_output_tokens, as the mock answers.
        assert_eq!(
            (status, stored["status"].as_str()),
            (200, Some("incomplete"))
        );
        assert_eq!(stored["id"].as_str(), Some(id.as_str()));
    }
}
