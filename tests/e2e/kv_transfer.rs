//! End-to-end KV transfer: a prefill mock holds the prompt KV through
//! connex-transfer, the decoder pulls it over TCP and checks every byte, and
//! the hold is freed when the request is done. Real router and engine
//! processes on loopback.

use crate::common::*;
use connex_mock_engine::model;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog";

/// Polls the engine's hold counters until `check` holds (or fails after 5 s).
async fn wait_holds(engine: &Proc, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let holds = engine_stats(engine).await["holds"].clone();
        if check(&holds) {
            return holds;
        }
        assert!(Instant::now() < deadline, "{what}: {holds}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asks `prefill` directly for a prefill of `prompt`; returns its kv_transfer_params.
async fn prefill_params(prefill: &Proc, prompt: &str) -> Value {
    let reply: Value = client()
        .post(format!("{}/v1/completions", prefill.url))
        .json(
            &json!({"model":"mock","prompt":prompt,"max_tokens":1,"stream":false,
                      "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    reply["kv_transfer_params"].clone()
}

async fn decode_with(decode: &Proc, prompt: &str, params: &Value) -> (u16, Value) {
    let response = client()
        .post(format!("{}/v1/completions", decode.url))
        .json(&json!({"model":"mock","prompt":prompt,"max_tokens":3,"kv_transfer_params":params}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_pulls_the_prefill_kv_verifies_it_and_releases_the_hold() {
    let (router, [prefill, decode]) = pd_cluster(&[], [("prefill", &[]), ("decode", &[])]).await;
    let prompt_len = model::tokenize(PROMPT).len() as u64;

    let (status, reply) = post(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":PROMPT,"max_tokens":6,"return_token_ids":true}),
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        ids(&reply["choices"][0]["token_ids"]),
        model::generate(&model::tokenize(PROMPT), 6)
    );
    let chunks = stream(
        &router,
        "/v1/chat/completions",
        &json!({"model":"mock","messages":[{"role":"user","content":PROMPT}],"max_tokens":4,"stream":true}),
    )
    .await;
    assert_eq!(chunks.last(), Some(&Value::String("[DONE]".into())));

    // The decoder really pulled the prompt KV (64 bytes per token) and computed none of it.
    let decodes = engine_requests(&decode).await;
    assert_eq!(decodes.len(), 2);
    assert_eq!(decodes[0]["pulled_bytes"], prompt_len * 64);
    assert!(decodes[1]["pulled_bytes"].as_u64().unwrap() > prompt_len * 64);
    for d in &decodes {
        assert_eq!(d["computed_prompt_tokens"], 0, "{d}");
        assert_eq!(d["outcome"], "completed", "{d}");
        // The params name the prefill's transfer listener, not its HTTP port.
        assert_eq!(d["body"]["kv_transfer_params"]["backend"], "tcp");
    }
    let ctrl = engine_stats(&prefill).await["ctrl"].clone();
    assert_eq!(
        decodes[0]["body"]["kv_transfer_params"]["remote_ctrl"],
        ctrl
    );
    // Both holds were pulled once and released by the decoder when done.
    let holds = wait_holds(&prefill, "holds released", |h| h["holds"] == 0).await;
    assert_eq!(holds["pulls"], 2, "{holds}");
    assert_eq!(holds["releases"], 2, "{holds}");
    assert_eq!(holds["held_bytes"], 0, "{holds}");
    assert_eq!(holds["expiries"], 0, "{holds}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_that_cannot_load_the_kv_answers_503() {
    let prefill = engine(None, "prefill", &[]);
    let decode = engine(None, "decode", &[]);
    let narrow = engine(None, "decode", &["--kv-bytes-per-token", "32"]);
    let params = prefill_params(&prefill, PROMPT).await;
    assert_eq!(params["do_remote_prefill"], true, "{params}");

    let mut unknown = params.clone();
    unknown["transfer_id"] = json!("xfer-unknown");
    let mut unreachable = params.clone();
    unreachable["remote_ctrl"] = json!("127.0.0.1:9");
    let cases = [
        ("unknown hold", &decode, PROMPT, unknown, "not found"),
        (
            "another prompt",
            &decode,
            "The quick brown cat jumps over the lazy dog",
            params.clone(),
            "does not match",
        ),
        (
            "other KV geometry",
            &narrow,
            PROMPT,
            params.clone(),
            "size mismatch",
        ),
        (
            "holder unreachable",
            &decode,
            PROMPT,
            unreachable,
            "unreachable",
        ),
    ];
    for (what, engine, prompt, params, reason) in cases {
        let (status, body) = decode_with(engine, prompt, &params).await;
        assert_eq!(status, 503, "{what}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("kv load failed: "), "{what}: {message}");
        assert!(message.contains(reason), "{what}: {message}");
    }
    // The failed attempts left the hold in place; the right decoder still gets it.
    let (status, body) = decode_with(&decode, PROMPT, &params).await;
    assert_eq!(status, 200, "{body}");
    let records = engine_requests(&decode).await;
    assert_eq!(
        records.last().unwrap()["pulled_bytes"],
        model::tokenize(PROMPT).len() * 64
    );
    assert_eq!(records[0]["outcome"], "failed");
    wait_holds(&prefill, "released after the good decode", |h| {
        h["releases"] == 1
    })
    .await;
    // Once released, the same params fail cleanly.
    let (status, _) = decode_with(&decode, PROMPT, &params).await;
    assert_eq!(status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_release_modes_and_budget_are_honoured() {
    // after_pull: the first complete pull frees the hold.
    let prefill = engine(None, "prefill", &["--hold-release", "after_pull"]);
    let decode = engine(None, "decode", &[]);
    let params = prefill_params(&prefill, PROMPT).await;
    assert_eq!(decode_with(&decode, PROMPT, &params).await.0, 200);
    let holds = engine_stats(&prefill).await["holds"].clone();
    assert_eq!(
        (holds["holds"].clone(), holds["pulls"].clone()),
        (json!(0), json!(1)),
        "{holds}"
    );

    // A budget of two prompts' KV: the third hold evicts the oldest.
    let kv = model::tokenize(PROMPT).len() * 64;
    let budget = (2 * kv + 10).to_string();
    let prefill = engine(None, "prefill", &["--hold-budget-bytes", &budget]);
    let first = prefill_params(&prefill, PROMPT).await;
    prefill_params(&prefill, PROMPT).await;
    prefill_params(&prefill, PROMPT).await;
    let holds = engine_stats(&prefill).await["holds"].clone();
    assert_eq!(holds["evictions"], 1, "{holds}");
    assert_eq!(holds["holds"], 2, "{holds}");
    let (status, body) = decode_with(&decode, PROMPT, &first).await;
    assert_eq!(status, 503, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_decoder_pulls_the_same_hold_with_the_next_epoch() {
    let (router, prefill, _d0, d1) = resume_cluster(None, None).await;
    let prompt = model::tokenize(PROMPT);

    let chunks = stream(
        &router,
        "/v1/completions",
        &json!({"model":"mock","prompt":PROMPT,"max_tokens":10,"stream":true,"return_token_ids":true}),
    )
    .await;
    assert_eq!(streamed_token_ids(&chunks), model::generate(&prompt, 10));

    let resumed = engine_requests(&d1).await;
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    let r = &resumed[0];
    let kv = &r["body"]["kv_transfer_params"];
    // The same hold, the next epoch: the prompt KV pulled and checked, only the
    // 3 generated tokens computed locally, no second prefill.
    assert_eq!(kv["resume_epoch"], 1, "{r}");
    assert_eq!(r["pulled_bytes"], prompt.len() * 64, "{r}");
    assert_eq!(r["computed_prompt_tokens"], 3, "{r}");
    assert_eq!(engine_requests(&prefill).await.len(), 1);
    // One prefill, one hold, pulled twice (d0 at epoch 0, d1 at epoch 1) and
    // released once, by d1 when it finished.
    let holds = wait_holds(&prefill, "released after the resume", |h| h["holds"] == 0).await;
    assert_eq!(
        (holds["pulls"].clone(), holds["releases"].clone()),
        (json!(2), json!(1)),
        "{holds}"
    );
}

/// A router, a prefill, `d0` and `d1`; round-robin over the sorted ids sends
/// the first request to d0, which dies at token 3. The engines' holders require
/// `secret`; the router is given `router_secret`. All registered and ready.
async fn resume_cluster(
    secret: Option<&str>,
    router_secret: Option<&str>,
) -> (Proc, Proc, Proc, Proc) {
    let mut flags = vec!["--decode-policy", "round_robin"];
    if let Some(router_secret) = router_secret {
        flags.extend(["--transfer-secret", router_secret]);
    }
    let with = |extra: &[&'static str]| {
        let mut flags = extra.to_vec();
        if let Some(secret) = secret {
            flags.extend(["--transfer-secret", secret]);
        }
        flags
    };
    let crash = [
        "--id",
        "d0",
        "--crash-after-tokens",
        "3",
        "--decode-us-per-token",
        "1000",
    ];
    let (router, [prefill, d0, d1]) = pd_cluster(
        &flags,
        [
            ("prefill", &with(&[])),
            ("decode", &with(&crash)),
            ("decode", &with(&["--id", "d1"])),
        ],
    )
    .await;
    (router, prefill, d0, d1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_transfer_secret_only_peers_that_know_it_touch_the_holds() {
    let prompt = model::tokenize(PROMPT);
    let body = json!({"model":"mock","prompt":PROMPT,"max_tokens":10,"stream":true,"return_token_ids":true});

    // Everyone has the secret: the decoders pull, the router checks and
    // renews the hold and the resume pulls it again; no second prefill.
    let (router, prefill, _d0, d1) = resume_cluster(Some("s3cret"), Some("s3cret")).await;
    let chunks = stream(&router, "/v1/completions", &body).await;
    assert_eq!(streamed_token_ids(&chunks), model::generate(&prompt, 10));
    let text = metrics_text(&router).await;
    assert_eq!(metric(&text, "connex_resumes_total", &[]), 1.0, "{text}");
    assert_eq!(metric(&text, "connex_reprefills_total", &[]), 0.0, "{text}");
    assert_eq!(engine_requests(&prefill).await.len(), 1);
    assert_eq!(
        engine_requests(&d1).await[0]["pulled_bytes"],
        prompt.len() * 64
    );
    let holds = wait_holds(&prefill, "released after the resume", |h| h["holds"] == 0).await;
    assert_eq!(
        (holds["pulls"].clone(), holds["releases"].clone()),
        (json!(2), json!(1))
    );

    // A decoder without it cannot load the KV: a clear 503, the hold untouched.
    let stranger = engine(None, "decode", &[]);
    let params = prefill_params(&prefill, PROMPT).await;
    let (status, reply) = decode_with(&stranger, PROMPT, &params).await;
    assert_eq!(status, 503, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("CONNEX_TRANSFER_SECRET"), "{message}");
    let holds = engine_stats(&prefill).await["holds"].clone();
    assert_eq!(
        (holds["holds"].clone(), holds["pulls"].clone()),
        (json!(1), json!(2)),
        "{holds}"
    );

    // A router without it cannot check the hold on resume: it prefills again.
    let (router, prefill, _d0, _d1) = resume_cluster(Some("s3cret"), None).await;
    let chunks = stream(&router, "/v1/completions", &body).await;
    assert_eq!(streamed_token_ids(&chunks), model::generate(&prompt, 10));
    let text = metrics_text(&router).await;
    assert_eq!(metric(&text, "connex_reprefills_total", &[]), 1.0, "{text}");
    assert_eq!(engine_requests(&prefill).await.len(), 2);
}
