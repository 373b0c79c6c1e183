//! `/v1/messages` (Anthropic's Messages API) through prefill/decode (issue
//! 30): its events in order, tool use and results over two turns, errors in
//! Anthropic's shape, and a decoder killed mid-message. Part of the resume
//! binary: a message is resumed as a chat is.

use crate::common::*;
use serde_json::{json, Value};

async fn create(router: &Proc, body: &Value) -> (u16, String) {
    let response = client()
        .post(format!("{}/v1/messages", router.url))
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

fn tools() -> Value {
    json!([{"name": "get_weather", "description": "The weather.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}])
}

/// The message a stream of events makes, as a client accumulates it.
fn accumulate(events: &[Value]) -> Value {
    let mut message = events[0]["message"].clone();
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_parts: Vec<String> = Vec::new();
    for event in events {
        match event["type"].as_str().unwrap() {
            "content_block_start" => {
                blocks.push(event["content_block"].clone());
                json_parts.push(String::new());
            }
            "content_block_delta" => {
                let i = event["index"].as_u64().unwrap() as usize;
                let delta = &event["delta"];
                match delta["type"].as_str().unwrap() {
                    "text_delta" => {
                        let text = blocks[i]["text"].as_str().unwrap().to_string();
                        blocks[i]["text"] = json!(text + delta["text"].as_str().unwrap());
                    }
                    "thinking_delta" => {
                        let text = blocks[i]["thinking"].as_str().unwrap().to_string();
                        blocks[i]["thinking"] = json!(text + delta["thinking"].as_str().unwrap());
                    }
                    "input_json_delta" => {
                        json_parts[i].push_str(delta["partial_json"].as_str().unwrap())
                    }
                    other => panic!("unknown delta {other}"),
                }
            }
            "content_block_stop" => {
                let i = event["index"].as_u64().unwrap() as usize;
                if blocks[i]["type"] == "tool_use" {
                    blocks[i]["input"] = serde_json::from_str(&json_parts[i])
                        .unwrap_or_else(|_| json!({"_raw_arguments": json_parts[i]}));
                }
            }
            "message_delta" => {
                message["stop_reason"] = event["delta"]["stop_reason"].clone();
                message["stop_sequence"] = event["delta"]["stop_sequence"].clone();
                message["usage"] = event["usage"].clone();
            }
            _ => {}
        }
    }
    message["content"] = Value::Array(blocks);
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_message_and_a_whole_one_say_the_same() {
    let (router, _engines) = scale_out_cluster(&[], &[]).await;
    let body = json!({"model": "mock", "max_tokens": 12, "tools": tools(),
                      "output_config": {"effort": "low"},
                      "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    let whole: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(whole["type"], "message");
    assert_eq!(whole["stop_reason"], "max_tokens");
    assert_eq!(whole["usage"]["output_tokens"], 12);
    let kinds: Vec<&str> = whole["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["thinking", "tool_use"]);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, text) = create(&router, &streamed).await;
    assert_eq!(status, 200);
    let events = sse_events(&text);
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[0], "message_start");
    assert_eq!(
        &kinds[kinds.len() - 2..],
        ["message_delta", "message_stop"],
        "{text}"
    );
    let mut message = accumulate(&events);
    let mut expected = whole.clone();
    for m in [&mut message, &mut expected] {
        m.as_object_mut().unwrap().remove("id");
    }
    assert_eq!(message, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_results_go_back_as_tool_messages() {
    let (router, engines) = scale_out_cluster(&[], &[]).await;
    let body = json!({"model": "mock", "max_tokens": 4, "system": "Use tools.",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}
        ], "tools": tools()});
    let (status, text) = create(&router, &body).await;
    assert_eq!(status, 200, "{text}");
    let requests = engine_requests(&engines[0]).await;
    let messages = &requests.last().unwrap()["body"]["messages"];
    assert_eq!(
        messages,
        &json!([
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "toolu_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
        ])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_on_the_route_are_in_anthropics_shape() {
    let (router, _engines) = scale_out_cluster(&[], &[]).await;
    for (body, status, kind) in [
        (
            json!({"model": "mock", "messages": [{"role": "user", "content": "x"}]}),
            400,
            "invalid_request_error",
        ),
        (
            json!({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "top_n": 2}),
            400,
            "invalid_request_error",
        ),
        (
            json!({"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}),
            404,
            "not_found_error",
        ),
        (
            json!({"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
                   "ec_transfer_params": {}}),
            400,
            "invalid_request_error",
        ),
    ] {
        let (got, text) = create(&router, &body).await;
        assert_eq!(got, status, "{text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["type"], "error", "{text}");
        assert_eq!(error["error"]["type"], kind, "{text}");
    }
    // The model list in Anthropic's shape for Anthropic's clients.
    let list: Value = client()
        .get(format!("{}/v1/models", router.url))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["data"][0]["type"], "model");
    assert_eq!(list["data"][0]["id"], "mock");
    assert_eq!(list["has_more"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_killed_mid_message_is_resumed_into_one_message() {
    let body = json!({"model": "mock", "max_tokens": 24, "stream": true, "tools": tools(),
                      "output_config": {"effort": "low"},
                      "messages": [{"role": "user", "content": "Resume this message"}]});
    let Resumed {
        uninterrupted: (_, text),
        resumed: (status, resumed_text),
        router,
        engines: _engines,
    } = uninterrupted_then_resumed(async |router| create(router, &body).await).await;
    let mut whole = accumulate(&sse_events(&text));
    let text = resumed_text;
    assert_eq!(status, 200);
    let events = sse_events(&text);
    assert!(!events.iter().any(|e| e["type"] == "error"), "{text}");
    let mut resumed = accumulate(&events);
    for m in [&mut resumed, &mut whole] {
        m.as_object_mut().unwrap().remove("id");
        for block in m["content"].as_array_mut().unwrap() {
            block.as_object_mut().unwrap().remove("id");
        }
    }
    assert_eq!(resumed, whole);
    let metrics = metrics_text(&router).await;
    assert_eq!(
        metric(&metrics, "connex_resumes_total", &[]),
        1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_fields_reach_prefill_decode_and_a_resume() {
    let extras = json!({"chat_template_kwargs": {"enable_thinking": false},
                        "vllm_xargs": {"mock_note": "kept"}});
    let mut body = json!({"model": "mock", "max_tokens": 24, "stream": true, "top_k": 5,
                          "thinking": {"type": "enabled", "budget_tokens": 12},
                          "messages": [{"role": "user", "content": "Resume with vLLM's fields"}]});
    for (key, value) in extras.as_object().unwrap() {
        body[key] = value.clone();
    }
    body["cache_salt"] = json!("my-salt");
    // d0 dies after 10 tokens; d1 continues.
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
    assert_eq!(accumulate(&events)["usage"]["output_tokens"], 24, "{text}");
    // (d0 is gone: the prefill and the continuation tell.)
    let sent = &engine_requests(&engines[0]).await[0]["body"];
    for (key, value) in extras.as_object().unwrap() {
        assert_eq!(&sent[key], value, "prefill: {key} in {sent}");
    }
    // The client's salt, under the router's own namespace for clients' salts.
    let salt = sent["cache_salt"].as_str().unwrap().to_string();
    assert!(salt.ends_with("my-salt"), "{sent}");
    let stats = engine_stats(&engines[2]).await;
    let rendered = &stats["last_render"];
    assert_eq!(
        rendered["chat_template_kwargs"],
        extras["chat_template_kwargs"]
    );
    let generate = stats["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["path"] == "/inference/v1/generate")
        .cloned()
        .unwrap();
    assert_eq!(generate["body"]["sampling_params"]["top_k"], 5);
    assert_eq!(
        generate["body"]["sampling_params"]["extra_args"],
        extras["vllm_xargs"]
    );
    assert_eq!(generate["body"]["cache_salt"], json!(salt));
    let metrics = metrics_text(&router).await;
    assert_eq!(metric(&metrics, "connex_resumes_total", &[]), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_404_under_each_route_is_in_its_own_shape() {
    let router = router(&[]);
    let get = |path: &str| {
        let url = format!("{}{path}", router.url);
        async move {
            let response = client()
                .post(url)
                .header("anthropic-version", "2023-06-01")
                .json(&json!({}))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    // Anthropic's clients call routes of its API the router does not serve.
    for path in ["/v1/messages/count_tokens", "/v1/messages/batches"] {
        let (status, error) = get(path).await;
        assert_eq!(status, 404, "{path}");
        assert_eq!(error["type"], "error", "{path}: {error}");
        assert_eq!(error["error"]["type"], "not_found_error", "{path}: {error}");
    }
    // OpenAI's shape elsewhere, under /v1/responses/ too.
    for path in ["/v1/responses/a/b/c", "/v1/nothing", "/v1/messagesx"] {
        let (status, error) = get(path).await;
        assert_eq!(status, 404, "{path}");
        assert_eq!(error["error"]["type"], "not_found_error", "{path}: {error}");
        assert!(error.get("type").is_none(), "{path}: {error}");
    }
}
