"""Chats with reasoning and tool calls through P/D, resumed across a decoder kill
(issue 26), on real vLLM engines.

The engines serve reasoning_model.py's model (trained to answer five fixed chats
with reasoning, then text or two pythonic tool calls) with vLLM's own parsers
(`--reasoning-parser deepseek_r1 --tool-call-parser pythonic
--enable-auto-tool-choice`) and the tokens API a router resumes chats through
(`--enable-scale-out`). A router of its own, one prefill and two decoders
(registered by the connector's agent, as in test_pd.py). The reference is the
prefill engine asked without `kv_transfer_params`: a plain engine (the connector
leaves such requests alone), which saves a fourth engine.

- Through P/D without a failure, each chat's answer, streamed and not, equals the
  plain engine's: reasoning, content, tool calls (names, arguments, indices),
  finish_reason, usage, token ids.
- The tokens API a continuation goes through (render, generate from prompt +
  the ids the client has, one streaming derender per chunk with a state rebuilt
  from the chunks the client got), by hand on one engine, continues each chat
  from its kill point to the uninterrupted answer (docs/resume-notes-tokens-api.md).
- One decoder is SIGKILLed while it streams all five chats, each streamed and
  non-streamed, plus one through the official `openai` client: each answer is cut
  at the kill point its chat is named after (mid-reasoning, at `</think>`,
  mid-content, inside a tool call's arguments, between the two calls:
  reasoning_model.kill_regions) and must still equal the uninterrupted answer,
  with the ids of tool calls already sent kept; every request is resumed once,
  from the prefill's hold, which is pulled again and not recomputed.

Responses and Messages without a failure come after the kill tests (on the
decoder left), each against the plain engine's own answer. Then the killed
decoder is started again and the official openai and anthropic clients'
Responses and Messages streams (mid-reasoning, inside a call's arguments) are
cut by the other decoder's kill: each equals the plain engine's answer, each
resumed once from the hold. The cluster's engines serve this module only and
are stopped at its end.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import harness
import httpx
import openai
import paused_scheduler
import pytest
import reasoning_model as rm
import test_pd
from conftest import connex_kv

PREFILL, D1, D2 = "rz_prefill", "rz_d1", "rz_d2"
# Each engine's connector role and CPU core.
ROLES = {PREFILL: ("kv_producer", 0), D1: ("kv_consumer", 1), D2: ("kv_consumer", 0)}
ENGINE_ARGS = [*rm.PARSER_ARGS, "--enable-scale-out"]
# The decoders' scheduler pauses each request at a token count while the kill
# test asks (paused_scheduler.py; kill_batch), from this folder.
HERE = Path(__file__).resolve().parent
PAUSED_ARGS = ["--scheduler-cls", "paused_scheduler.PausedScheduler"]
MODES = ("stream", "non-stream")
# How long one batch may run before the kill test gives up on it (seconds).
BATCH_S = 240


class ReasoningCluster:
    """connex-router + prefill + two decoders serving the reasoning model."""

    # No test here waits for an expiry; the kill test pauses a decoder's
    # streams for four minutes at most.
    RETAIN_S = 300.0

    def __init__(self, fleet) -> None:
        model = rm.ensure()
        # The kill test's paused streams (kill_batch) send nothing while the
        # rest of their batch reaches its kill points (up to four minutes on a
        # loaded machine), and the batch of 13 opens on one decoder at once.
        self.router = harness.Router(
            "--decode-open-timeout-ms",
            "120000",
            "--stall-timeout-ms",
            "300000",
        )
        self.fleet, self.model = fleet, model
        self.pause_dir = Path(tempfile.mkdtemp(prefix="connex-pause-"))
        wanted = {name: self.engine(name) for name in ROLES}
        try:
            with paused_scheduler_importable():
                self.engines = fleet.ensure(wanted)
            self.router.wait_instances(set(wanted))
        except BaseException:
            self.router.stop()
            raise

    def engine(self, name: str) -> harness.Engine:
        role, core = ROLES[name]
        engine = harness.Engine(
            name,
            core=core,
            model=self.model,
            served_model_name=rm.MODEL_NAME,
            extra_args=ENGINE_ARGS + (self.paused_args(name) if name in (D1, D2) else []),
        )
        engine.kv_config = connex_kv(
            role,
            engine,
            retain_s=self.RETAIN_S,
            router=self.router.internal,
            url=engine.url,
            instance_id=name,
        )
        return engine

    def restart(self, name: str) -> None:
        """A new engine in place of `name` (killed), registered under its name.
        The dead one is removed through the admin API first, as an operator
        would: its id stays taken until its heartbeat expires, and a
        registrant without its credential cannot replace it."""
        self.fleet.engines.pop(name).stop()
        self.pause_file(name).unlink(missing_ok=True)
        self.router.admin_delete(f"instances/{name}")
        with paused_scheduler_importable():
            engine = self.engines[name] = self.fleet.ensure({name: self.engine(name)})[name]
        harness.wait_for(
            lambda: any(
                i["id"] == name and i["url"] == engine.url and i["state"] == "ready"
                for i in self.router.instances()
            ),
            60,
            f"the new {name} to register",
        )

    def pause_file(self, name: str) -> Path:
        """Where the kill test writes the token count at which decoder `name`
        pauses its requests (paused_scheduler.py)."""
        return self.pause_dir / name

    def paused_args(self, name: str) -> list[str]:
        config = {paused_scheduler.PAUSE_KEY: str(self.pause_file(name))}
        return [*PAUSED_ARGS, "--additional-config", json.dumps(config)]

    def __getitem__(self, name: str) -> harness.Engine:
        return self.engines[name]

    @property
    def plain(self) -> harness.Engine:
        """The reference: the prefill, asked without kv_transfer_params."""
        return self.engines[PREFILL]

    def ctrl(self) -> str:
        extra = self.engines[PREFILL].kv_config["kv_connector_extra_config"]
        return f"127.0.0.1:{extra['ctrl_port']}"

    def only(self, decoder: str) -> None:
        """Routes new requests to `decoder` alone (the other is drained)."""
        for name in (D1, D2):
            self.router.admin_post(f"instances/{name}/{'activate' if name == decoder else 'drain'}")


@contextlib.contextmanager
def paused_scheduler_importable() -> Iterator[None]:
    """Engines started meanwhile import paused_scheduler (from this folder)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [before])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module")
def cluster(fleet):
    cluster = ReasoningCluster(fleet)
    try:
        yield cluster
    finally:
        cluster.router.stop()
        for name in (PREFILL, D1, D2):
            engine = fleet.engines.pop(name, None)
            if engine is not None:
                engine.stop()


# ---- clients ------------------------------------------------------------------------


def body(case: str, mode: str) -> dict:
    extra = {"return_token_ids": True}
    if mode == "stream":
        extra |= {"stream": True, "stream_options": {"include_usage": True}}
    return rm.chat_body(case, **extra)


def accumulate(events) -> dict:
    """A chat stream as a client accumulates it (the OpenAI SDKs' way): the text
    fields concatenated, tool calls by index, the last finish_reason, usage,
    token ids. A tool call whose id changes between its deltas is an error."""
    out = {
        "reasoning": "",
        "reasoning_content": "",
        "content": "",
        "tool_calls": {},
        "finish_reason": None,
        "usage": None,
        "token_ids": [],
        "prompt_token_ids": None,
        "roles": 0,
        "errors": [],
    }
    for event in events:
        if "error" in event:
            out["errors"].append(event["error"])
            continue
        if event.get("usage"):
            out["usage"] = event["usage"]
        if event.get("prompt_token_ids"):
            out["prompt_token_ids"] = event["prompt_token_ids"]
        for choice in event.get("choices", []):
            if choice["index"] != 0:
                out["errors"].append(f"a choice of index {choice['index']}")
            delta = choice.get("delta") or {}
            out["roles"] += bool(delta.get("role"))
            for key in ("reasoning", "reasoning_content", "content"):
                out[key] += delta.get(key) or ""
            for call in delta.get("tool_calls") or []:
                mine = out["tool_calls"].setdefault(
                    call["index"], {"id": None, "type": None, "name": "", "arguments": ""}
                )
                if call.get("id"):
                    if mine["id"] not in (None, call["id"]):
                        out["errors"].append(f"tool call {call['index']}'s id changed: {call}")
                    mine["id"] = call["id"]
                if call.get("type"):
                    mine["type"] = call["type"]
                function = call.get("function") or {}
                mine["name"] += function.get("name") or ""
                mine["arguments"] += function.get("arguments") or ""
            out["token_ids"] += choice.get("token_ids") or []
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
    return out


def stream(url: str, case: str, request_id: str | None = None) -> dict:
    events = []
    headers = {"X-Request-Id": request_id} if request_id else {}
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body(case, "stream"),
        headers=headers,
        timeout=BATCH_S,
    ) as reply:
        if reply.status_code != 200:
            reply.read()
            return {"errors": [f"HTTP {reply.status_code}: {reply.text}"]}
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return accumulate(events)


def complete(url: str, case: str, request_id: str | None = None) -> dict:
    headers = {"X-Request-Id": request_id} if request_id else {}
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json=body(case, "non-stream"),
        headers=headers,
        timeout=BATCH_S,
    )
    if reply.status_code != 200:
        return {"errors": [f"HTTP {reply.status_code}: {reply.text}"]}
    return reply.json()


def openai_stream(url: str, case: str, request_id: str) -> dict:
    """The official client, as an application uses it: stream=True, tools."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=BATCH_S)
    messages, tools, _, _ = rm.CASES[case]
    out = {"reasoning": "", "content": "", "tool_calls": {}, "finish_reason": None, "usage": None}
    out |= {"token_ids": [], "errors": []}
    try:
        chunks = client.chat.completions.create(
            model=rm.MODEL_NAME,
            messages=messages,
            tools=tools,
            temperature=0,
            max_tokens=400,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
            extra_headers={"X-Request-Id": request_id},
        )
        for chunk in chunks:
            if chunk.usage is not None:
                out["usage"] = chunk.usage.model_dump(exclude_none=True)
            for choice in chunk.choices:
                delta = choice.delta
                out["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
                out["content"] += delta.content or ""
                for call in delta.tool_calls or []:
                    mine = out["tool_calls"].setdefault(
                        call.index, {"id": None, "type": None, "name": "", "arguments": ""}
                    )
                    if call.id:
                        if mine["id"] not in (None, call.id):
                            out["errors"].append(f"tool call {call.index}'s id changed: {call}")
                        mine["id"] = call.id
                    mine["type"] = call.type or mine["type"]
                    if call.function is not None:
                        mine["name"] += call.function.name or ""
                        mine["arguments"] += call.function.arguments or ""
                out["token_ids"] += (choice.model_extra or {}).get("token_ids") or []
                if choice.finish_reason:
                    out["finish_reason"] = choice.finish_reason
    except openai.APIError as err:
        out["errors"].append(repr(err))
    return out


# ---- comparisons ----------------------------------------------------------------------


def calls_of(message_calls) -> list[tuple]:
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message_calls]


def streamed_calls(accumulated: dict) -> list[tuple]:
    calls = accumulated["tool_calls"]
    assert sorted(calls) == list(range(len(calls))), f"tool call indices {sorted(calls)}"
    return [(calls[i]["type"], calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def assert_expected(case: str, reasoning, content, calls) -> None:
    """What the model was trained to answer, as vLLM's parsers split it."""
    want_reasoning, want_content, want_calls = rm.EXPECTED[case]
    assert reasoning == want_reasoning
    assert (content or None) == want_content
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == want_calls


def without_reasoning_count(answer: dict) -> dict:
    """`answer` without its usage's `completion_tokens_details`: after a
    resume the engine that finished the answer only saw its own part, and
    vLLM's reasoning-token count is its parser's (docs/resume.md, "Limits"):
    the router does not make it up. Every other usage field is compared."""
    answer = copy.deepcopy(answer)
    if isinstance(answer.get("usage"), dict):
        answer["usage"].pop("completion_tokens_details", None)
    return answer


def assert_stream_equal(got: dict, want: dict, resumed: bool = False) -> None:
    assert not got["errors"], got["errors"]
    if resumed:
        got, want = without_reasoning_count(got), without_reasoning_count(want)
    for key in ("reasoning", "reasoning_content", "content", "finish_reason", "usage"):
        assert got[key] == want[key], f"{key}: got {got[key]!r}, the plain engine {want[key]!r}"
    assert streamed_calls(got) == streamed_calls(want)
    assert got["token_ids"] == want["token_ids"]
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    assert got["roles"] == 1
    for call in got["tool_calls"].values():
        assert call["id"], f"a tool call without an id: {call}"


def comparable(answer: dict) -> dict:
    """A non-stream answer without what differs between any two answers of one
    engine (test_faithful.py): id, created, system_fingerprint, tool call ids."""
    answer = {
        k: copy.deepcopy(v)
        for k, v in answer.items()
        if k not in ("id", "created", "system_fingerprint")
    }
    for choice in answer.get("choices", []):
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            assert call.pop("id", None), f"a tool call without an id: {call}"
    return answer


def differences(got, want, path: str = "") -> list[str]:
    """Where two JSON values differ, one line per leaf (a readable assertion)."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [
            line
            for key in sorted(got.keys() | want.keys())
            for line in differences(
                got.get(key, "<absent>"), want.get(key, "<absent>"), f"{path}.{key}"
            )
        ]
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return [
            line
            for i, (a, b) in enumerate(zip(got, want, strict=True))
            for line in differences(a, b, f"{path}[{i}]")
        ]
    return [] if got == want else [f"{path}: got {got!r}, the plain engine {want!r}"]


def assert_complete_equal(got: dict, want: dict, resumed: bool = False) -> None:
    assert "errors" not in got, got["errors"]
    if resumed:
        got, want = without_reasoning_count(got), without_reasoning_count(want)
    ids = [c["id"] for c in got["choices"][0]["message"].get("tool_calls") or []]
    assert len(set(ids)) == len(ids), ids
    wrong = differences(comparable(got), comparable(want))
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def reference(cluster) -> dict:
    """Each chat's plain answer (no P/D), streamed and not."""
    answers = every_chat(cluster.plain.url)
    return {key: harness.outcome(answer) for key, answer in answers.items()}


def every_chat(url: str) -> dict:
    """Each case's chat, streamed and not, all asked of `url` at once (the
    model's answers do not depend on their batch: reasoning_model.py); the
    results as `harness.concurrently` gives them."""
    return harness.concurrently(
        {
            (case, mode): (lambda c=case, m=mode: CLIENTS[m](url, c))
            for case in rm.CASES
            for mode in MODES
        }
    )


# ---- the model and vLLM's parsers -------------------------------------------------------


@pytest.mark.parametrize("case", list(rm.CASES))
def test_the_plain_engine_parses_the_models_answer(reference, case):
    """vLLM's own parsers split the trained answer into reasoning, content and
    tool calls, streamed and not, and both agree."""
    streamed = reference[case, "stream"]
    assert not streamed["errors"], streamed["errors"]
    assert_expected(case, streamed["reasoning"], streamed["content"], streamed_calls(streamed))
    message = reference[case, "non-stream"]["choices"][0]["message"]
    assert_expected(
        case,
        message.get("reasoning"),
        message.get("content"),
        calls_of(message.get("tool_calls") or []),
    )
    finish = "tool_calls" if rm.EXPECTED[case][2] else "stop"
    assert (
        streamed["finish_reason"]
        == reference[case, "non-stream"]["choices"][0]["finish_reason"]
        == finish
    )
    assert streamed["token_ids"] == reference[case, "non-stream"]["choices"][0]["token_ids"]
    assert streamed["usage"] == {
        k: v for k, v in reference[case, "non-stream"]["usage"].items() if v is not None
    }


# ---- through P/D, no failure ------------------------------------------------------------


@pytest.fixture(scope="module")
def through_pd(cluster) -> dict:
    """Each chat through P/D, streamed and not, all at once."""
    # d1 serves, so that d2 has nothing of these prompts cached when the kill
    # test resumes on it: its resumes must pull the prompt from the hold.
    cluster.only(D1)
    return every_chat(cluster.router.url)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(rm.CASES))
def test_chat_through_pd_equals_the_plain_engine(through_pd, reference, case, mode):
    got = harness.outcome(through_pd[case, mode])
    if mode == "stream":
        assert_stream_equal(got, reference[case, mode])
    else:
        assert_complete_equal(got, reference[case, mode])


# ---- Responses and Messages through P/D, against the plain engine's own routes ----------


def responses_body(case: str, **extra) -> dict:
    """The case as a Responses request (vLLM 0.32 serves /v1/responses too)."""
    messages, tools, _, _ = rm.CASES[case]
    body = {"model": rm.MODEL_NAME, "input": messages, "temperature": 0, "max_output_tokens": 400}
    if tools is not None:
        body["tools"] = [{"type": "function", **tool["function"]} for tool in tools]
    return body | extra


def messages_body(case: str, **extra) -> dict:
    """The case as an Anthropic Messages request (vLLM serves /v1/messages too)."""
    messages, tools, _, _ = rm.CASES[case]
    body = {"model": rm.MODEL_NAME, "messages": messages, "temperature": 0, "max_tokens": 400}
    if tools is not None:
        body["tools"] = [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in tools
        ]
    return body | extra


def response_items(response: dict) -> list[tuple]:
    """A response's output as what a client reads of it (ids left out)."""
    items = []
    for item in response["output"]:
        if item["type"] == "reasoning":
            items.append(("reasoning", "".join(c["text"] for c in item.get("content") or [])))
        elif item["type"] == "message":
            items.append(("text", "".join(c["text"] for c in item["content"])))
        elif item["type"] == "function_call":
            items.append(("call", item["name"], json.loads(item["arguments"])))
        else:
            items.append((item["type"],))
    return items


def message_blocks(message: dict) -> list[tuple]:
    """A message's content as what a client reads of it (ids left out)."""
    blocks = []
    for block in message["content"]:
        if block["type"] == "thinking":
            blocks.append(("thinking", block["thinking"]))
        elif block["type"] == "text":
            blocks.append(("text", block["text"]))
        elif block["type"] == "tool_use":
            blocks.append(("tool_use", block["name"], block["input"]))
        else:
            blocks.append((block["type"],))
    return blocks


def responses_stream(url: str, case: str, request_id: str | None = None) -> dict:
    """A Responses stream of `case` through the official client: its items."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=BATCH_S)
    headers = {"x-request-id": request_id} if request_id else {}
    with api.responses.stream(**responses_body(case), extra_headers=headers) as events:
        for _ in events:
            pass
        final = events.get_final_response().model_dump()
    return {"errors": [], "items": response_items(final), "status": final["status"]}


def messages_stream(url: str, case: str, request_id: str | None = None) -> dict:
    """A Messages stream of `case` through the official client: its blocks."""
    api = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=BATCH_S)
    body = messages_body(case)
    # This client version takes no `temperature` argument: sent as it is.
    body["extra_body"] = {"temperature": body.pop("temperature")}
    headers = {"x-request-id": request_id} if request_id else {}
    with api.messages.stream(**body, extra_headers=headers) as events:
        final = events.get_final_message().model_dump()
    return {"errors": [], "blocks": message_blocks(final), "stop_reason": final["stop_reason"]}


# ---- the tokens API a chat continuation goes through ------------------------------------


def sse_events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=BATCH_S) as reply:
        assert reply.status_code == 200, reply.read()
        return [
            json.loads(line[len("data: ") :])
            for line in reply.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


def post_json(url: str, path: str, body: dict) -> dict:
    reply = httpx.post(f"{url}{path}", json=body, timeout=BATCH_S)
    assert reply.status_code == 200, f"{path}: {reply.text}"
    return reply.json()


def continue_chat(url: str, case: str, seen: list[dict]) -> list[dict]:
    """What a router does to continue a chat stream on another engine after the
    client got the chunks `seen` (docs/resume-notes-tokens-api.md): render the
    client's body, generate from prompt + the ids seen, and derender each new
    chunk with a state rebuilt from the chunks seen, their boundaries included.
    Returns the derendered chunks."""
    chat = body(case, "stream")
    rendered = post_json(url, "/v1/chat/completions/render", chat)
    prompt = rendered["token_ids"]
    chunks = [c for event in seen for c in event.get("choices", []) if c.get("token_ids")]
    ids = [i for c in chunks for i in c["token_ids"]]
    calls = accumulate(seen)["tool_calls"]
    params = rendered["sampling_params"] | {
        "max_tokens": rendered["sampling_params"]["max_tokens"] - len(ids)
    }
    state = {
        "output_token_ids": ids,
        "output_chunk_lens": [len(c["token_ids"]) for c in chunks],
        "role_sent": True,
        "tools_streamed": bool(calls),
        "last_tool_call_ids": [calls[i]["id"] for i in sorted(calls)],
    }
    out = []
    generated = sse_events(
        url,
        "/inference/v1/generate",
        {
            "model": rm.MODEL_NAME,
            "token_ids": prompt + ids,
            "sampling_params": params,
            "stream": True,
        },
    )
    for event in generated:
        choice = (event.get("choices") or [{}])[0]
        sent = dict(event)
        if choice.get("finish_reason") == "stop" and not isinstance(choice.get("stop_reason"), str):
            # The stop token's text is not part of the answer; derender's parser
            # path would decode it (docs/resume-notes-tokens-api.md, gotcha 1).
            sent["choices"] = [choice | {"token_ids": choice["token_ids"][:-1]}]
        reply = post_json(
            url,
            "/v1/chat/completions/derender",
            {
                "stream": True,
                "model": rm.MODEL_NAME,
                "generate_chunk": sent,
                "stream_state": state,
                "prompt_token_ids": prompt,
                "prompt_tokens": len(prompt),
                "chat_request": chat,
            },
        )
        state = reply["stream_state"]
        chunk = reply["chunk"]
        for mine, theirs in zip(chunk["choices"], event.get("choices") or [], strict=True):
            mine["token_ids"] = theirs.get("token_ids")
        out.append(chunk)
    return out


def continued_at_kill_points(url: str, case: str) -> tuple[dict, list[tuple]]:
    """A chat's uninterrupted answer, and for each of its kill points (its
    region's ends and KILL_AT): the cut, the chunks the client got up to it,
    and the answer continued from there through the tokens API."""
    events = sse_events(url, "/v1/chat/completions", body(case, "stream"))
    low, high = rm.kill_regions()[case]
    continued = []
    for cut in sorted({low, rm.KILL_AT, high}):
        count, seen = 0, []
        for event in events:
            count += sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
            if count > cut:
                break
            seen.append(event)
        continued.append((cut, seen, accumulate(seen + continue_chat(url, case, seen))))
    return accumulate(events), continued


@pytest.fixture(scope="module")
def continuations(cluster) -> dict:
    """`continued_at_kill_points` of every case, all at once."""
    return harness.concurrently(
        {case: (lambda c=case: continued_at_kill_points(cluster.plain.url, c)) for case in rm.CASES}
    )


@pytest.mark.parametrize("case", list(rm.CASES))
def test_the_tokens_api_continues_a_chat_cut_at_its_kill_point(continuations, case):
    """The mechanism the router resumes a chat with, by hand on one engine:
    the chunks a client got up to the kill point, then a continuation through
    render, generate and streaming derender, accumulate to the uninterrupted
    answer (reasoning, content, tool calls with the ids already sent)."""
    want, continued = harness.outcome(continuations[case])
    for cut, seen, got in continued:
        for key in ("reasoning", "content", "finish_reason", "token_ids"):
            assert got[key] == want[key], (cut, key, got[key], want[key])
        assert streamed_calls(got) == streamed_calls(want), cut
        sent = accumulate(seen)["tool_calls"]
        assert all(got["tool_calls"][i]["id"] == c["id"] for i, c in sent.items() if c["id"]), cut
        assert got["roles"] == 1


# ---- one decoder killed at every kill point ---------------------------------------------

# Chat in every mode at every kill point, and the official openai client's
# stream cut inside a call's arguments. (Responses and Messages streams have a
# batch of their own, at the end of this module, cut by the other decoder's
# kill.)
KILLED = [(case, mode) for case in rm.CASES for mode in MODES] + [("arguments", "openai")]

# Each request mode's client: (url, case, request id) to the answer as compared.
CLIENTS = {
    "stream": stream,
    "non-stream": complete,
    "openai": openai_stream,
    "responses": responses_stream,
    "messages": messages_stream,
}


def journal(router: harness.Router, ids: dict[str, tuple]) -> dict[str, dict]:
    """The router's journal entries of the requests `ids` (X-Request-Id values;
    the journal's id is the client's plus a suffix of the router's)."""
    out = {}
    for entry in router.requests():
        mine = entry["request_id"]
        for rid in ids:
            if mine == rid or mine.startswith(f"{rid}-"):
                out[rid] = entry
    return out


def kill_batch(
    cluster, requests: list[tuple[str, str]] = KILLED, victim: str = D1, heir: str = D2
) -> dict:
    """Streams every request (case, mode) from `victim` (d1) at once, with each
    at its kill point SIGKILLs it, `heir` taking over; returns each request's
    answer and where the router had it just before d1 died (its journal's
    generated tokens, what the continuation starts from: read before the kill,
    and at most KILL_AT after it, inside the region either way).

    d1's scheduler pauses every request at rm.KILL_AT generated tokens, the
    one count inside every kill region (paused_scheduler.py): each request
    stops there whenever d1 admitted it, and d1 is killed once the router's
    journal has every request in its region (rm.kill_regions), which it
    cannot leave: d1 computes no further token. (Stepping d1 by freezing and
    thawing it, as before, depended on timing: on a loaded machine a thaw ran
    past narrow regions and the batch was tried again, 45-90 s a try.) The
    router withholds chunks that bring no text (a tool call's markup before
    it parses), so the journal may stand a few tokens before KILL_AT: the
    regions are where a request can be cut, between the two calls right after
    the first call's `'),`."""
    d1, regions = cluster[victim], rm.kill_regions()
    tag = uuid.uuid4().hex[:8]
    ids = {f"kill-{tag}-{case}-{mode}": (case, mode) for case, mode in requests}
    answers: dict[tuple, dict] = {}
    cut: dict[tuple, int] = {}

    def run(request_id: str, case: str, mode: str) -> None:
        client = CLIENTS[mode]
        try:
            answers[case, mode] = client(cluster.router.url, case, request_id)
        except Exception as err:  # reported by the request's test
            answers[case, mode] = {"errors": [repr(err)]}

    def lined_up() -> bool:
        entries = journal(cluster.router, ids)
        cut.clear()
        cut.update({ids[rid]: e["generated_tokens"] for rid, e in entries.items()})
        decoders = {ids[rid]: e["decoder"] for rid, e in entries.items()}
        assert set(decoders.values()) <= {victim, None}, decoders
        assert all(cut[k] <= regions[k[0]][1] for k in cut), (cut, regions)
        ready = len(cut) == len(ids) and all(cut[k] >= regions[k[0]][0] for k in cut)
        # Lined up means every stream is on the victim: none resumed yet.
        assert not ready or set(decoders.values()) == {victim}, decoders
        return ready

    cluster.only(victim)
    pause = cluster.pause_file(victim)
    pause.write_text(str(rm.KILL_AT))
    threads = [
        threading.Thread(target=run, args=(rid, case, mode), daemon=True)
        for rid, (case, mode) in ids.items()
    ]
    try:
        for thread in threads:
            thread.start()
        try:
            harness.wait_for(lined_up, BATCH_S, "the batch at its kill points")
        except AssertionError as err:
            raise AssertionError(
                f"{err}: journal at {sorted(cut.items())}, regions {regions}"
            ) from None
        print(f"killing {victim} with the router at {sorted(cut.items())}")
        cluster.router.admin_post(f"instances/{heir}/activate")
        d1.kill(signal.SIGKILL)
    finally:
        pause.unlink(missing_ok=True)
        for thread in threads:
            thread.join(BATCH_S)
    return {"answers": answers, "cut": dict(cut)}


@pytest.fixture(scope="module")
def killed(cluster, reference) -> dict:
    ctrl = cluster.ctrl()
    prefill = cluster[PREFILL]
    before = {
        "stats": test_pd.stats(ctrl),
        "prefills": prefill.metric("vllm:request_success_total"),
        "resumes": cluster.router.metric("connex_resumes_total", absent=0.0),
        "reprefills": cluster.router.metric("connex_reprefills_total", absent=0.0),
        "d2_pulls": cluster[D2].metric("connex_kv_pulls_total", absent=0.0),
        "d2_failed": cluster[D2].metric("connex_kv_pull_failures_total", absent=0.0),
    }
    outcome = kill_batch(cluster)
    harness.wait_for(lambda: not cluster[D1].alive(), 10, "the killed decoder to exit")
    outcome["before"] = before
    print(f"cut at {outcome['cut']}")
    return outcome


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(rm.CASES))
def test_a_chat_cut_at_its_kill_point_resumes_as_if_uninterrupted(killed, reference, case, mode):
    """The decoder died with this chat at its kill point (the test's name for
    the case: mid-reasoning, at </think>, mid-content, inside a tool call's
    arguments, between two tool calls); the other decoder finished it, and the
    client's answer is the uninterrupted one, tool call ids included."""
    low, high = rm.kill_regions()[case]
    assert low <= killed["cut"][case, mode] <= high, killed["cut"]
    got = killed["answers"][case, mode]
    if mode == "stream":
        assert_stream_equal(got, reference[case, mode], resumed=True)
    else:
        assert_complete_equal(got, reference[case, mode], resumed=True)


def test_the_openai_client_streams_tool_calls_unchanged_across_a_kill(killed, reference):
    got = killed["answers"]["arguments", "openai"]
    assert not got["errors"], got["errors"]
    want = reference["arguments", "stream"]
    assert got["reasoning"] == want["reasoning"]
    assert (got["content"] or None) == (want["content"] or None)
    assert streamed_calls(got) == streamed_calls(want)
    assert all(call["id"] for call in got["tool_calls"].values())
    assert got["finish_reason"] == want["finish_reason"] == "tool_calls"
    assert without_reasoning_count(got)["usage"] == without_reasoning_count(want)["usage"]
    assert got["token_ids"] == want["token_ids"]


def test_every_cut_chat_was_resumed_once_from_the_hold(cluster, killed):
    """One resume per request, no second prefill: the decoder that took over
    pulled the prompt KV the prefill still held, and every hold was released
    once."""
    ctrl, before = cluster.ctrl(), killed["before"]
    count = len(KILLED)
    assert cluster.router.metric("connex_resumes_total") - before["resumes"] == count
    assert cluster.router.metric("connex_reprefills_total", absent=0.0) == before["reprefills"]
    assert cluster[PREFILL].metric("vllm:request_success_total") - before["prefills"] == count
    harness.wait_for(
        lambda: test_pd.stats(ctrl)["releases"] - before["stats"]["releases"] >= count,
        20,
        "the holds' releases",
    )
    after = test_pd.stats(ctrl)
    # d2, which had none of these prompts cached, pulled the prompt KV of the
    # continuations it took (at least one per chat: two continuations of one
    # chat may share a local prefix hit) from the prefill's holds.
    harness.wait_for(
        lambda: (
            cluster[D2].metric("connex_kv_pulls_total", absent=0.0) - before["d2_pulls"]
            >= len(rm.CASES)
        ),
        20,
        "d2's pulls on its /metrics",
    )
    pulled = cluster[D2].metric("connex_kv_pulls_total") - before["d2_pulls"]
    assert after["pulls"] - before["stats"]["pulls"] >= pulled
    assert cluster[D2].metric("connex_kv_pull_failures_total", absent=0.0) == before["d2_failed"]
    assert after["releases"] - before["stats"]["releases"] == count
    assert after["holds"] == before["stats"]["holds"]


# ---- Responses and Messages through P/D (after the kill tests: on d2) ---------------------
# Each case against the plain engine's own /v1/responses and /v1/messages
# answers. After the kill tests, so that d1 is left to the kill batch alone.


def responses_and_messages(cluster) -> dict:
    """Every case as Responses and as Messages: the plain engine's own answer
    (`want`), the router's (`got`) and the router's stream through the
    official client (`streamed`), all asked at once."""
    headers = {"anthropic-version": "2023-06-01"}

    def messages(url: str, case: str) -> dict:
        reply = httpx.post(
            f"{url}/v1/messages", json=messages_body(case), headers=headers, timeout=BATCH_S
        )
        return reply.json()

    calls = {}
    plain, router = cluster.plain.url, cluster.router.url
    for case in rm.CASES:
        calls["responses", case, "want"] = lambda c=case: post_json(
            plain, "/v1/responses", responses_body(c)
        )
        calls["responses", case, "got"] = lambda c=case: post_json(
            router, "/v1/responses", responses_body(c)
        )
        calls["responses", case, "streamed"] = lambda c=case: responses_stream(router, c)
        calls["messages", case, "want"] = lambda c=case: messages(plain, c)
        calls["messages", case, "got"] = lambda c=case: messages(router, c)
        calls["messages", case, "streamed"] = lambda c=case: messages_stream(router, c)
    return harness.concurrently(calls)


@pytest.fixture(scope="module")
def translated(cluster, killed) -> dict:
    # After the chat kill batch, which leaves d1 dead: d2 serves. (Before it,
    # d2 would have these prompts cached, and the kill test's resumes on d2
    # must pull them from the hold.)
    return responses_and_messages(cluster)


@pytest.mark.parametrize("case", list(rm.CASES))
def test_responses_through_pd_equal_the_plain_engines(translated, case):
    want, got, streamed = (
        harness.outcome(translated["responses", case, part]) for part in ("want", "got", "streamed")
    )
    assert response_items(got) == response_items(want), (got, want)
    assert got["status"] == want["status"]
    assert got["usage"]["output_tokens"] == want["usage"]["output_tokens"]
    reasoning, content, calls = rm.EXPECTED[case]
    assert response_items(got)[0] == ("reasoning", reasoning)
    # Streamed through the official client: the same items.
    assert streamed["items"] == response_items(want)


@pytest.mark.parametrize("case", list(rm.CASES))
def test_messages_through_pd_equal_the_plain_engines(translated, case):
    want, got, streamed = (
        harness.outcome(translated["messages", case, part]) for part in ("want", "got", "streamed")
    )
    assert message_blocks(got) == message_blocks(want), (got, want)
    assert got["stop_reason"] == want["stop_reason"]
    assert got["usage"]["output_tokens"] == want["usage"]["output_tokens"]
    # Streamed through the official client: the same blocks.
    assert streamed["blocks"] == message_blocks(want)
    assert streamed["stop_reason"] == want["stop_reason"]


# ---- Responses and Messages streams across a decoder kill ------------------------------
# The official clients' streams, cut mid-reasoning and inside a function call's
# arguments: d1 (killed above) is started again, d2 streams the four and is
# killed, d1 takes over. Each answer must equal the plain engine's own.

KILLED_TRANSLATED = [
    (case, mode) for case in ("reasoning", "arguments") for mode in ("responses", "messages")
]


@pytest.fixture(scope="module")
def killed_translated(cluster, killed) -> dict:
    # After the chat kill batch (`killed`), which leaves d1 dead.
    cluster.restart(D1)
    before = {
        "resumes": cluster.router.metric("connex_resumes_total", absent=0.0),
        "reprefills": cluster.router.metric("connex_reprefills_total", absent=0.0),
    }
    outcome = kill_batch(cluster, KILLED_TRANSLATED, victim=D2, heir=D1)
    harness.wait_for(lambda: not cluster[D2].alive(), 10, "the killed decoder to exit")
    outcome["before"] = before
    print(f"cut at {outcome['cut']}")
    return outcome


@pytest.mark.parametrize("case", ["reasoning", "arguments"])
def test_a_responses_stream_cut_by_a_decoder_kill_equals_the_plain_engines(
    translated, killed_translated, case
):
    low, high = rm.kill_regions()[case]
    assert low <= killed_translated["cut"][case, "responses"] <= high, killed_translated["cut"]
    got = killed_translated["answers"][case, "responses"]
    assert not got["errors"], got["errors"]
    want = harness.outcome(translated["responses", case, "want"])
    assert got["items"] == response_items(want)
    assert got["status"] == want["status"] == "completed"


@pytest.mark.parametrize("case", ["reasoning", "arguments"])
def test_a_messages_stream_cut_by_a_decoder_kill_equals_the_plain_engines(
    translated, killed_translated, case
):
    low, high = rm.kill_regions()[case]
    assert low <= killed_translated["cut"][case, "messages"] <= high, killed_translated["cut"]
    got = killed_translated["answers"][case, "messages"]
    assert not got["errors"], got["errors"]
    want = harness.outcome(translated["messages", case, "want"])
    assert got["blocks"] == message_blocks(want)
    assert got["stop_reason"] == want["stop_reason"]


def test_every_cut_responses_and_messages_stream_was_resumed_once_from_the_hold(
    cluster, killed_translated
):
    before = killed_translated["before"]
    resumed = cluster.router.metric("connex_resumes_total") - before["resumes"]
    assert resumed == len(KILLED_TRANSLATED)
    assert cluster.router.metric("connex_reprefills_total", absent=0.0) == before["reprefills"]
