//! Phase 4: resume. What a request that lost its decoder is continued with,
//! after the tokens the client has:
//!
//! - a completions request: on `/v1/completions`, prompt ids + generated ids
//!   as the prompt, the client's sampling parameters, `max_tokens` reduced by
//!   what was generated, and the hold's `kv_transfer_params` with a bumped
//!   `resume_epoch`. The new decoder pulls the prompt KV from the hold and
//!   computes only the generated suffix;
//! - a chat: the same tokens through the engine's tokens API (`derender.rs`),
//!   so that the engine's reasoning and tool parsers continue what they
//!   made of the first decoder's tokens. A chat that asks logprobs continues
//!   on `/v1/completions` as a completions request does (vLLM's derender
//!   gives no logprobs yet), its chunks re-wrapped as chat chunks.
//!
//! Every continuation's `kv_transfer_params` say how many of its prompt's
//! last tokens are generated output (`generated_tokens`): a decoder's
//! connector fast-forwards a guided or structured request's grammar over
//! exactly those before the first new token is sampled (vLLM starts a
//! grammar at its root otherwise; docs/resume.md), and ends the request with
//! an error where it cannot.
//!
//! A request that asks logprobs together with tools carries state that no
//! continuation can: it fails over only before its first token (when nothing
//! has reached the client yet).

use super::failure::Failure;
use crate::engines::http::Payload;
use crate::protocols::openai::client_body::{ClientBody, TypeOnly};
use crate::protocols::openai::patch::{Patch, Set};
use crate::protocols::openai::request::{forces_tool_call, offers_tools, Route};
use serde_json::{json, Value};

/// Keys of a chat request that a completions request does not take.
pub const CHAT_ONLY: &[&str] = &[
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "mm_processor_kwargs",
    "max_completion_tokens",
    "top_logprobs",
    "reasoning_effort",
    "include_reasoning",
    "modalities",
    "audio",
];

/// The `kv_transfer_params` key of a continuation that says how many of its
/// prompt's last tokens are generated output (the connector replays a
/// structured request's grammar over them).
pub const GENERATED_TOKENS: &str = "generated_tokens";

/// Whether vLLM serves the request with guided or structured output (a
/// grammar that a continuation's decoder must fast-forward over the
/// generated tokens): `guided_*`, `structured_outputs`, a `response_format`
/// other than text, or a chat's `tool_choice` of `required` or a named
/// function.
pub fn structured_output(route: Route, body: &ClientBody) -> bool {
    let guided = [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    ];
    guided.iter().any(|key| body.is_set(key))
        || (route == Route::Chat && forces_tool_call(body))
        || body
            .typed::<TypeOnly>("response_format")
            .is_some_and(|format| format.kind != "text")
}

/// Why a request cannot be continued from its generated tokens, if it cannot.
pub fn mid_stream_blocker(route: Route, body: &ClientBody) -> Option<&'static str> {
    if route == Route::Chat
        && offers_tools(body)
        && chat_continuation(body) == ChatContinuation::Completions
    {
        return Some("logprobs and tools");
    }
    None
}

/// How a chat continues after its first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatContinuation {
    /// Through the engine's tokens API, its chat parsers replayed.
    Tokens,
    /// Through `/v1/completions`, re-wrapped as chat chunks: a chat asking
    /// logprobs (the tokens API's derender gives none yet).
    Completions,
}

/// How a chat request continues after its first token.
pub fn chat_continuation(body: &ClientBody) -> ChatContinuation {
    if body.get("logprobs") == Some(&Value::Bool(true)) {
        ChatContinuation::Completions
    } else {
        ChatContinuation::Tokens
    }
}

/// The `max_tokens` the client asked for, from either key.
pub fn requested_max_tokens(body: &ClientBody) -> Option<u64> {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|key| body.get(key).and_then(Value::as_u64))
}

/// `kv_transfer_params` for resume `epoch`.
pub fn with_epoch(kv_transfer_params: &Value, epoch: u64) -> Value {
    let mut kv = kv_transfer_params.clone();
    if let Some(map) = kv.as_object_mut() {
        map.insert("resume_epoch".into(), json!(epoch));
    }
    kv
}

/// A continuation's `kv_transfer_params`: `kv` (the hold's, at its epoch)
/// saying that the prompt's last `generated` tokens are generated output.
pub fn continuing(kv: &Value, generated: usize) -> Value {
    let mut kv = kv.clone();
    if let Some(map) = kv.as_object_mut() {
        map.insert(GENERATED_TOKENS.into(), json!(generated));
    }
    kv
}

/// `kv_transfer_params` that ask the decoder not to release the hold when
/// its request finishes (`release_on_finish: false`): several requests
/// continue from it, and the router releases it when the last one ends.
pub fn keeping_hold(kv_transfer_params: &Value) -> Value {
    let mut kv = kv_transfer_params.clone();
    if let Some(map) = kv.as_object_mut() {
        map.insert("release_on_finish".into(), Value::Bool(false));
    }
    kv
}

/// The `/v1/completions` body that continues a request after `generated` tokens.
pub fn resume_body(
    route: Route,
    body: &ClientBody,
    prompt_token_ids: &[u32],
    generated: &[u32],
    kv_transfer_params: &Value,
) -> Payload {
    let mut remove: Vec<&str> = if route == Route::Chat {
        CHAT_ONLY.to_vec()
    } else {
        Vec::new()
    };
    // Stop strings are the router's (`stops.rs`).
    if crate::protocols::openai::stops::StopStrings::of(body).is_some() {
        remove.push("stop");
    }
    let done = generated.len() as u64;
    // Without a limit the engine generates to the end of the context: `null` asks
    // vLLM for exactly that on the completions route (whose default is 16).
    let max_tokens =
        requested_max_tokens(body).map_or(Value::Null, |m| json!(m.saturating_sub(done).max(1)));
    let mut patch = Patch::new(body, &remove)
        .set("prompt", Set::Ids(prompt_token_ids, generated))
        .value("max_tokens", max_tokens);
    if route == Route::Chat {
        // Chat asks `logprobs: true` and `top_logprobs: k`; completions asks
        // `logprobs: k`.
        let top = (body.get("logprobs") == Some(&Value::Bool(true))).then(|| {
            body.get("top_logprobs")
                .and_then(Value::as_u64)
                .unwrap_or(0)
        });
        patch = patch.value("logprobs", top.map_or(Value::Null, |k| json!(k)));
    }
    for key in ["min_tokens", "min_completion_tokens"] {
        if let Some(min) = body.get(key).and_then(Value::as_u64) {
            patch = patch.value(key, json!(min.saturating_sub(done)));
        }
    }
    patch
        .value("stream", Value::Bool(true))
        .value("return_token_ids", Value::Bool(true))
        .value("stream_options", json!({"include_usage": true}))
        .value("n", json!(1))
        // The first decoder sent the echoed prompt and its logprobs.
        .value("echo", Value::Bool(false))
        .value("prompt_logprobs", Value::Null)
        .value(
            "kv_transfer_params",
            continuing(kv_transfer_params, generated.len()),
        )
        .to_payload()
}

/// Where a request stands when its decoder fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Tokens the client has, over all choices.
    pub generated: usize,
    /// Resumes so far (attempts that reached a decoder and failed).
    pub resumes: u32,
    /// Connects that failed so far (the decoder never had the request).
    pub connect_failures: u32,
}

/// What the operator allows (`--max-resumes`) and the request permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumePolicy {
    pub max_resumes: u32,
    /// Failed connects one request may go through before it fails.
    pub max_connect_failures: u32,
    /// Why the request cannot continue after its first token, if it cannot.
    pub blocker: Option<&'static str>,
    /// The request has guided or structured output ([`structured_output`]):
    /// a continuation's decoder fast-forwards its grammar, or ends it with an
    /// error, which the final error then names.
    pub structured: bool,
}

/// The next step after a decoder failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// The decoder never had the request: the same request on another decoder,
    /// not counted as a resume.
    Reconnect,
    /// Nothing reached the client yet: the client's own body on another
    /// decoder (a resume).
    FailOver,
    /// Continue after the tokens the client has (a resume).
    Resume,
    /// End the request with this error message.
    Fail(String),
}

/// The resume decision: what to do after `failure`, given the request's
/// progress and the policy. Pure, so that every cause is tested alone.
pub fn decide(failure: &Failure, progress: Progress, policy: ResumePolicy) -> Next {
    if !failure.cause.reached_decoder() {
        if progress.connect_failures >= policy.max_connect_failures {
            return Next::Fail(format!(
                "{}; no decoder reachable after {} tries",
                failure.message, progress.connect_failures
            ));
        }
        return Next::Reconnect;
    }
    if let (Some(blocker), true) = (policy.blocker, progress.generated > 0) {
        return Next::Fail(format!(
            "{}; a request with {blocker} cannot be resumed after its first token",
            failure.message
        ));
    }
    if progress.resumes >= policy.max_resumes {
        // A decoder that cannot fast-forward a structured request's grammar
        // over the generated tokens (its connector refuses, or the grammar
        // rejects them) finishes the continuation with an error, which reads
        // as a 5xx: say what it likely was.
        let structured = if policy.structured
            && progress.generated > 0
            && failure.cause == super::failure::Cause::ServerError
        {
            "; the structured output could not be continued (a decoder ends a continuation with an error when its connector cannot replay the grammar over the generated tokens: the decoder's log names why)"
        } else {
            ""
        };
        return Next::Fail(format!(
            "{}; gave up after {} resumes{structured}",
            failure.message, policy.max_resumes
        ));
    }
    if progress.generated == 0 {
        Next::FailOver
    } else {
        Next::Resume
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pd::failure::Cause;

    #[test]
    fn chat_resumes_as_completions_on_prompt_plus_generated() {
        let body = ClientBody::of(
            json!({"model":"m","messages":[{"role":"user","content":"hi"}],
            "max_completion_tokens":10,"temperature":0,"seed":7,"min_tokens":4,"stream":false}),
        );
        let kv = with_epoch(&json!({"transfer_id":"t","resume_epoch":0}), 1);
        let out: Value = serde_json::from_slice(
            &resume_body(Route::Chat, &body, &[1, 2], &[9, 8, 7], &kv).to_bytes(),
        )
        .expect("JSON");
        assert_eq!(out["prompt"], json!([1, 2, 9, 8, 7]));
        assert_eq!(out["max_tokens"], 7);
        assert_eq!(out["min_tokens"], 1);
        assert_eq!(out["temperature"], 0);
        assert_eq!(out["seed"], 7);
        assert_eq!(out["stream"], true);
        assert_eq!(out["kv_transfer_params"]["resume_epoch"], 1);
        assert!(out.get("messages").is_none());
        assert!(out.get("max_completion_tokens").is_none());
        assert_eq!(out["logprobs"], Value::Null);
        let with_logprobs =
            ClientBody::of(json!({"model":"m","messages":[],"logprobs":true,"top_logprobs":3}));
        let out: Value = serde_json::from_slice(
            &resume_body(Route::Chat, &with_logprobs, &[1], &[2], &kv).to_bytes(),
        )
        .expect("JSON");
        assert_eq!(out["logprobs"], 3);
        assert!(out.get("top_logprobs").is_none());
    }

    #[test]
    fn requests_with_uncarried_state_are_not_resumable_mid_stream() {
        let blocked = |body: Value| mid_stream_blocker(Route::Completions, &ClientBody::of(body));
        let chat = |body: Value| mid_stream_blocker(Route::Chat, &ClientBody::of(body));
        // Each choice continues as its own sequence.
        assert_eq!(blocked(json!({"n": 2})), None);
        // vLLM 0.32 has no best_of (accepted and ignored): one sequence.
        assert_eq!(blocked(json!({"best_of": 3})), None);
        assert_eq!(blocked(json!({"logprobs": 2})), None);
        // The first decoder sends the prompt's logprobs and the echo.
        assert_eq!(blocked(json!({"prompt_logprobs": 1})), None);
        assert_eq!(blocked(json!({"echo": true})), None);
        // Structured output resumes: the decoder replays its grammar over
        // the generated tokens (`generated_tokens`).
        assert_eq!(blocked(json!({"guided_json": {"type":"object"}})), None);
        assert_eq!(
            chat(json!({"response_format": {"type": "json_object"}})),
            None
        );
        assert_eq!(blocked(json!({"n": 1, "temperature": 0.5})), None);
        assert_eq!(blocked(json!({"logprobs": null, "echo": false})), None);
        // Tools continue through the tokens API, a tool choice vLLM serves
        // with structured output too; tools with logprobs do not.
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        assert_eq!(chat(json!({"tools": tools})), None);
        assert_eq!(chat(json!({"tools": tools, "tool_choice": "auto"})), None);
        assert_eq!(
            chat(json!({"tools": tools, "tool_choice": "required"})),
            None
        );
        assert_eq!(
            chat(
                json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
            ),
            None
        );
        assert_eq!(
            chat(json!({"tools": tools, "logprobs": true})),
            Some("logprobs and tools")
        );
        assert_eq!(
            chat_continuation(&ClientBody::of(json!({"logprobs": true}))),
            ChatContinuation::Completions
        );
        assert_eq!(
            chat_continuation(&ClientBody::of(json!({"logprobs": false}))),
            ChatContinuation::Tokens
        );
        assert_eq!(
            chat_continuation(&ClientBody::of(json!({}))),
            ChatContinuation::Tokens
        );
    }

    #[test]
    fn structured_output_is_told_apart() {
        let completions =
            |body: Value| structured_output(Route::Completions, &ClientBody::of(body));
        let chat = |body: Value| structured_output(Route::Chat, &ClientBody::of(body));
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        for key in [
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ] {
            assert!(completions(json!({key: "x"})), "{key}");
        }
        assert!(completions(json!({"structured_outputs": {"regex": "a+"}})));
        assert!(completions(
            json!({"response_format": {"type": "json_schema", "json_schema": {}}})
        ));
        assert!(chat(json!({"response_format": {"type": "json_object"}})));
        assert!(chat(json!({"tools": tools, "tool_choice": "required"})));
        assert!(chat(
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
        ));
        assert!(!chat(json!({"tools": tools, "tool_choice": "auto"})));
        assert!(!chat(json!({"response_format": {"type": "text"}})));
        assert!(!completions(
            json!({"structured_outputs": null, "temperature": 0})
        ));
    }

    #[test]
    fn a_continuation_says_how_many_prompt_tokens_are_generated() {
        let kv = with_epoch(&json!({"transfer_id": "t", "resume_epoch": 0}), 2);
        let body = ClientBody::of(json!({"model": "m", "prompt": "hi",
            "structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 8}));
        let out: Value = serde_json::from_slice(
            &resume_body(Route::Completions, &body, &[1, 2, 3], &[9, 8], &kv).to_bytes(),
        )
        .expect("JSON");
        assert_eq!(out["prompt"], json!([1, 2, 3, 9, 8]));
        assert_eq!(
            out["kv_transfer_params"],
            json!({"transfer_id": "t", "resume_epoch": 2, "generated_tokens": 2})
        );
        // The grammar's request goes to the decoder as the client sent it.
        assert_eq!(out["structured_outputs"], json!({"choice": ["yes", "no"]}));
    }

    #[test]
    fn a_structured_request_that_no_decoder_continues_fails_by_name() {
        let mid = Progress {
            generated: 7,
            resumes: 3,
            connect_failures: 0,
        };
        let structured = ResumePolicy {
            structured: true,
            ..POLICY
        };
        let finished_with_error = failure(Cause::ServerError);
        assert!(matches!(
            decide(&finished_with_error, mid, structured),
            Next::Fail(m) if m.contains("gave up after 3 resumes")
                && m.contains("the structured output could not be continued")
        ));
        // A crash is not the grammar's doing, nor is a plain request's error.
        assert!(matches!(
            decide(&failure(Cause::Reset), mid, structured),
            Next::Fail(m) if !m.contains("structured")
        ));
        assert!(matches!(
            decide(&finished_with_error, mid, POLICY),
            Next::Fail(m) if !m.contains("structured")
        ));
        // Resumes left: a structured request resumes like any other.
        let early = Progress { resumes: 1, ..mid };
        assert_eq!(
            decide(&finished_with_error, early, structured),
            Next::Resume
        );
    }

    const POLICY: ResumePolicy = ResumePolicy {
        max_resumes: 3,
        max_connect_failures: 4,
        blocker: None,
        structured: false,
    };

    fn failure(cause: Cause) -> Failure {
        Failure::new("d0", cause, "boom")
    }

    #[test]
    fn a_failed_connect_is_not_a_resume() {
        let progress = Progress {
            generated: 5,
            resumes: 3,
            connect_failures: 0,
        };
        // Even with every resume spent and a blocker, the request goes on.
        let policy = ResumePolicy {
            blocker: Some("n > 1"),
            ..POLICY
        };
        assert_eq!(
            decide(&failure(Cause::Connect), progress, policy),
            Next::Reconnect
        );
        let exhausted = Progress {
            connect_failures: 4,
            ..progress
        };
        assert!(matches!(
            decide(&failure(Cause::Connect), exhausted, policy),
            Next::Fail(m) if m.contains("no decoder reachable")
        ));
    }

    #[test]
    fn every_cause_that_reached_a_decoder_fails_over_then_resumes() {
        for cause in Cause::ALL.into_iter().filter(|c| c.reached_decoder()) {
            let fresh = Progress::default();
            assert_eq!(
                decide(&failure(cause), fresh, POLICY),
                Next::FailOver,
                "{cause:?}"
            );
            let mid = Progress {
                generated: 7,
                resumes: 2,
                connect_failures: 3,
            };
            assert_eq!(
                decide(&failure(cause), mid, POLICY),
                Next::Resume,
                "{cause:?}"
            );
            let spent = Progress { resumes: 3, ..mid };
            assert!(
                matches!(decide(&failure(cause), spent, POLICY), Next::Fail(m) if m.contains("gave up after 3 resumes")),
                "{cause:?}"
            );
            let blocked = ResumePolicy {
                blocker: Some("logprobs"),
                ..POLICY
            };
            assert!(
                matches!(decide(&failure(cause), mid, blocked), Next::Fail(m) if m.contains("logprobs")),
                "{cause:?}"
            );
            // Before the first token a blocked request still fails over.
            assert_eq!(
                decide(&failure(cause), fresh, blocked),
                Next::FailOver,
                "{cause:?}"
            );
        }
    }
}
