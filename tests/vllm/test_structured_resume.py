"""Structured output resumed across a real decoder kill (issue 43), on real
vLLM engines serving the project's tiny model.

A router of its own, one prefill and two decoders (registered by the
connector's agent). The reference is the prefill engine asked without
`kv_transfer_params` (a plain engine: the connector leaves such requests
alone), as in test_reasoning_resume.py.

The model's weights are random, so a grammar decides what it can say: the
schemas here leave it few choices (enums, booleans, a regex, a choice), which
makes every answer end well before `max_tokens` and come out the same on
every run. The answers are long enough (40-90 tokens) to be cut twice.

One batch of requests streams from d1, each paused at its own kill point by
d1's scheduler (paused_scheduler.py, the request's `vllm_xargs`); once the
router's journal has every request at its point, d1 is SIGKILLed and d2
continues them all. Each kind is cut at two points: a JSON answer inside a
string value and between two members (positions found in the reference's
tokens), a regex or choice answer at a third and two thirds of it. Kinds:
chat `response_format` json_schema; completions `structured_outputs` json,
regex and choice; chat `tool_choice` required and a named function;
Responses `text.format` json_schema and Messages `tool_choice` any and tool
(these two protocols carry no `vllm_xargs`: cut at the batch's one count);
the official openai client's `chat.completions.parse`. Each answer must equal
the uninterrupted one (text or tool calls, token ids, finish_reason) and
parse against its schema; each request was resumed once, from the prefill's
hold, which d2 pulled, and d2's connector says it fast-forwarded the grammar.

Structured output under a reasoning parser (a kill inside the reasoning and
one inside the JSON) is cut in test_reasoning_resume.py's kill batch, on its
reasoning model's cluster: no engines of its own.
"""

from __future__ import annotations

import json
import re
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import harness
import httpx
import jsonschema
import openai
import paused_scheduler
import pydantic
import pytest
import test_pd
from conftest import TOOL_ARGS, connex_kv
from test_reasoning_resume import accumulate, journal, paused_scheduler_importable
from transformers import AutoTokenizer

PREFILL, D1, D2 = "so_prefill", "so_d1", "so_d2"
ROLES = {PREFILL: ("kv_producer", 0), D1: ("kv_consumer", 1), D2: ("kv_consumer", 0)}
# Chats continue through the tokens API (render, generate, derender). A JSON
# grammar admits whitespace between tokens by default, which a random-weight
# model takes to the end of max_tokens: the engines' grammars admit none.
ENGINE_ARGS = [
    *TOOL_ARGS,
    "--enable-scale-out",
    "--structured-outputs-config",
    json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
]
PAUSED_ARGS = ["--scheduler-cls", "paused_scheduler.PausedScheduler"]
# Responses and Messages carry no vllm_xargs: they pause at the batch's count,
# inside a tool call's arguments (vLLM streams nothing of a required call
# before them) and inside the JSON answer's strings.
BATCH_PAUSE_AT = 40
MAX_TOKENS = 160
# How long the batch may take to line up at its kill points (seconds).
BATCH_S = 240
# How long the journal must stand still for a batch short of its regions to
# count as paused (seconds).
STILL_S = 3.0

CITIES = ["Paris de France", "Rio de Janeiro", "Kuala Lumpur"]
MOTTOS = ["fluctuat nec mergitur", "ordem e progresso", "bersekutu bertambah mutu"]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": CITIES},
        "motto": {"type": "string", "enum": MOTTOS},
        "warm": {"type": "boolean"},
        "season": {"type": "string", "enum": ["early spring", "late autumn"]},
    },
    "required": ["city", "motto", "warm", "season"],
    "additionalProperties": False,
}
REGEX = r"(alpha|beta|gamma)( (one|two|three)){6}\."
CHOICES = [
    "the quick brown fox jumps over the lazy dog, twice, before breakfast",
    "a stitch in time saves nine, as every careful tailor has always known",
]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": CITIES},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "detail": {"type": "string", "enum": ["hourly forecast", "daily summary"]},
    },
    "required": ["city", "unit", "detail"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER},
}


class City(pydantic.BaseModel):
    """The openai client's parse model: SCHEMA's shape."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris de France", "Rio de Janeiro", "Kuala Lumpur"]
    motto: Literal["fluctuat nec mergitur", "ordem e progresso", "bersekutu bertambah mutu"]
    warm: bool
    season: Literal["early spring", "late autumn"]


# ---- the cluster ----------------------------------------------------------------------


class StructuredCluster:
    """connex-router + prefill + two decoders serving the tiny model, the
    decoders' scheduler pausable (paused_scheduler.py)."""

    RETAIN_S = 300.0

    def __init__(self, fleet) -> None:
        # The batch's paused streams send nothing until all are lined up.
        self.router = harness.Router(
            "--decode-open-timeout-ms", "120000", "--stall-timeout-ms", "300000"
        )
        self.fleet = fleet
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
        extra = list(ENGINE_ARGS)
        if role == "kv_consumer":
            config = {paused_scheduler.PAUSE_KEY: str(self.pause_file(name))}
            extra += [*PAUSED_ARGS, "--additional-config", json.dumps(config)]
        engine = harness.Engine(name, core=core, extra_args=extra)
        engine.kv_config = connex_kv(
            role,
            engine,
            retain_s=self.RETAIN_S,
            router=self.router.internal,
            url=engine.url,
            instance_id=name,
        )
        return engine

    def pause_file(self, name: str) -> Path:
        return self.pause_dir / name

    def __getitem__(self, name: str) -> harness.Engine:
        return self.engines[name]

    @property
    def plain(self) -> harness.Engine:
        """The reference: the prefill, asked without kv_transfer_params."""
        return self.engines[PREFILL]

    def only(self, decoder: str) -> None:
        for name in (D1, D2):
            self.router.admin_post(f"instances/{name}/{'activate' if name == decoder else 'drain'}")


@pytest.fixture(scope="module")
def cluster(fleet):
    cluster = StructuredCluster(fleet)
    try:
        yield cluster
    finally:
        cluster.router.stop()
        for name in ROLES:
            engine = fleet.engines.pop(name, None)
            if engine is not None:
                engine.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(harness.model_dir()))


# ---- the kinds --------------------------------------------------------------------------


def user(tag: str, text: str) -> list[dict]:
    # The tag first: no two requests share a prompt prefix, so d2 must pull
    # every continuation's prompt from its hold.
    return [{"role": "user", "content": f"[{tag}] {text}"}]


def chat(tag: str, **extra) -> dict:
    return {
        "model": harness.MODEL_NAME,
        "messages": user(tag, "Pick a city and describe it."),
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | extra


def completion(tag: str, stream: bool = True, **extra) -> dict:
    body = {
        "model": harness.MODEL_NAME,
        "prompt": f"[{tag}] The answer, as asked:",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "return_token_ids": True,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body | extra


# kind: (route, body builder from a tag, how its answer is read: "json" a
# JSON document against SCHEMA, "tool" tool calls against WEATHER, "regex",
# "choice"). The kill points of each: ("string", "between") for JSON,
# ("third", "two thirds") otherwise.
KINDS = {
    "chat json_schema": (
        "chat",
        lambda tag: chat(
            tag,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
            },
        ),
        "json",
    ),
    "completions json": (
        "completions",
        lambda tag: completion(tag, structured_outputs={"json": SCHEMA}),
        "json",
    ),
    "completions json non-stream": (
        "completions",
        lambda tag: completion(tag, stream=False, structured_outputs={"json": SCHEMA}),
        "json",
    ),
    "completions regex": (
        "completions",
        lambda tag: completion(tag, structured_outputs={"regex": REGEX}),
        "regex",
    ),
    "completions choice": (
        "completions",
        lambda tag: completion(tag, structured_outputs={"choice": CHOICES}),
        "choice",
    ),
    "chat tool_choice required": (
        "chat",
        lambda tag: chat(tag, tools=[TOOL], tool_choice="required", parallel_tool_calls=False),
        "tool",
    ),
    "chat tool_choice named": (
        "chat",
        lambda tag: chat(
            tag,
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        ),
        "tool",
    ),
}
POINTS = {"json": ("string", "between"), "tool": ("string", "between")}
POINTS |= {"regex": ("third", "two thirds"), "choice": ("third", "two thirds")}


def read_json_text(text: str) -> object:
    document = json.loads(text)
    jsonschema.validate(document, SCHEMA)
    return document


# ---- answers as a client reads them ---------------------------------------------------


def post(url: str, path: str, body: dict, request_id: str | None = None) -> dict:
    headers = {"X-Request-Id": request_id} if request_id else {}
    reply = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=BATCH_S)
    if reply.status_code != 200:
        return {"errors": [f"HTTP {reply.status_code}: {reply.text}"]}
    return reply.json()


def events(url: str, path: str, body: dict, request_id: str | None = None) -> list[dict]:
    headers = {"X-Request-Id": request_id} if request_id else {}
    out = []
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=BATCH_S) as reply:
        if reply.status_code != 200:
            reply.read()
            return [{"error": f"HTTP {reply.status_code}: {reply.text}"}]
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
    return out


def ask(url: str, kind: str, body: dict, request_id: str | None = None) -> dict:
    """`body` of `kind` asked of `url`: the answer as compared (text or tool
    calls, token ids, finish_reason, errors)."""
    route = KINDS[kind][0]
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if not body.get("stream"):
        answer = post(url, path, body, request_id)
        if "errors" in answer:
            return answer
        (choice,) = answer["choices"]
        return {
            "text": choice["text"],
            "token_ids": choice["token_ids"],
            "finish_reason": choice["finish_reason"],
            "errors": [],
        }
    got = events(url, path, body, request_id)
    if route == "chat":
        chat_answer = accumulate(got)
        calls = chat_answer["tool_calls"]
        return {
            "text": chat_answer["content"],
            "calls": [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)],
            "token_ids": chat_answer["token_ids"],
            "finish_reason": chat_answer["finish_reason"],
            "errors": chat_answer["errors"],
        }
    out = {"text": "", "token_ids": [], "finish_reason": None, "errors": []}
    for event in got:
        if "error" in event:
            out["errors"].append(event["error"])
        for choice in event.get("choices", []):
            out["text"] += choice.get("text") or ""
            out["token_ids"] += choice.get("token_ids") or []
            out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    return out


def responses_body(tag: str) -> dict:
    return {
        "model": harness.MODEL_NAME,
        "input": user(tag, "Pick a city and describe it."),
        "temperature": 0,
        "max_output_tokens": MAX_TOKENS,
        "text": {
            "format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
        },
    }


def responses_text(response: dict) -> str:
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    return "".join(part["text"] for part in message["content"])


def responses_stream(url: str, request_id: str) -> dict:
    """The official client's Responses stream: the final response's text."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=BATCH_S)
    with api.responses.stream(
        **responses_body("responses"), extra_headers={"x-request-id": request_id}
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response().model_dump()
    return {"text": responses_text(final), "status": final["status"], "errors": []}


MESSAGES_CHOICES = {
    "messages tool_choice any": {"type": "any"},
    "messages tool_choice tool": {"type": "tool", "name": "get_weather"},
}


def messages_body(kind: str) -> dict:
    return {
        "model": harness.MODEL_NAME,
        "messages": user(kind, "What is the weather?"),
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "tools": [{"name": "get_weather", "description": "The weather.", "input_schema": WEATHER}],
        "tool_choice": MESSAGES_CHOICES[kind],
    }


def messages_stream(url: str, kind: str, request_id: str) -> dict:
    """A Messages stream (raw SSE, as the anthropic client reads it): the
    tool_use blocks' names and inputs, and the stop reason."""
    blocks: dict[int, dict] = {}
    stop = None
    body = messages_body(kind) | {"stream": True}
    headers = {"x-request-id": request_id, "anthropic-version": "2023-06-01"}
    errors = []
    with httpx.stream(
        "POST", f"{url}/v1/messages", json=body, headers=headers, timeout=BATCH_S
    ) as reply:
        if reply.status_code != 200:
            reply.read()
            return {"errors": [f"HTTP {reply.status_code}: {reply.text}"]}
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "error":
                errors.append(event)
            elif event["type"] == "content_block_start":
                block = event["content_block"]
                blocks[event["index"]] = {
                    "type": block["type"],
                    "name": block.get("name"),
                    "json": "",
                }
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                blocks[event["index"]]["json"] += delta.get("partial_json") or ""
            elif event["type"] == "message_delta":
                stop = event["delta"].get("stop_reason") or stop
    return {"blocks": message_tool_uses(blocks), "stop_reason": stop, "errors": errors}


def message_tool_uses(blocks: dict[int, dict]) -> list[tuple]:
    return [
        (b["name"], json.loads(b["json"]) if b["json"] else {})
        for _, b in sorted(blocks.items())
        if b["type"] == "tool_use"
    ]


def plain_message(url: str, kind: str) -> dict:
    """The plain engine's own /v1/messages answer: its tool_use blocks."""
    reply = httpx.post(
        f"{url}/v1/messages",
        json=messages_body(kind),
        headers={"anthropic-version": "2023-06-01"},
        timeout=BATCH_S,
    )
    assert reply.status_code == 200, reply.text
    message = reply.json()
    uses = [(b["name"], b["input"]) for b in message["content"] if b["type"] == "tool_use"]
    return {"blocks": uses, "stop_reason": message["stop_reason"]}


def openai_parse(url: str, request_id: str | None = None, pause_at: int | None = None) -> dict:
    """The official client's `chat.completions.parse` with a pydantic model."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=BATCH_S)
    extra: dict = {"return_token_ids": True}
    if pause_at is not None:
        extra["vllm_xargs"] = {paused_scheduler.PAUSE_AT_KEY: pause_at}
    try:
        completion = api.chat.completions.parse(
            model=harness.MODEL_NAME,
            messages=user("parse", "Pick a city and describe it."),
            response_format=City,
            temperature=0,
            max_tokens=MAX_TOKENS,
            extra_body=extra,
            extra_headers={"x-request-id": request_id} if request_id else None,
        )
    except openai.APIError as err:
        return {"errors": [repr(err)]}
    choice = completion.choices[0]
    return {
        "parsed": choice.message.parsed,
        "text": choice.message.content,
        "token_ids": (choice.model_extra or {}).get("token_ids"),
        "finish_reason": choice.finish_reason,
        "errors": [],
    }


# ---- where an answer is cut -------------------------------------------------------------


def json_states(text: str) -> list[tuple[bool, str]]:
    """For each prefix length of a JSON text: whether it ends inside a
    string, and the last character outside strings before it."""
    states = [(False, "")]
    inside, escaped, last = False, False, ""
    for char in text:
        if inside:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                inside = False
                last = '"'
        elif char == '"':
            inside = True
        elif not char.isspace():
            last = char
        states.append((inside, last))
    return states


def kill_region(tokenizer, ids: list[int], point: str) -> tuple[int, int]:
    """The range (inclusive) of counts k of the answer's tokens at which a
    cut is at `point`: inside a string value (after its first character,
    before its closing quote) or between two members (after a `,`, before the
    next key's quote) of a JSON answer; near a third or two thirds of any
    answer. The longest such run of counts (the last, between members)."""
    n = len(ids)
    if point in ("third", "two thirds"):
        at = n // 3 if point == "third" else 2 * n // 3
        return at - 1, at + 1
    texts = [tokenizer.decode(ids[:k]) for k in range(n + 1)]
    full = texts[-1]
    states = json_states(full)

    def at_point(k: int) -> bool:
        end = len(texts[k])
        inside, last = states[end]
        if point == "string":
            # Inside a value's string, one character in at least.
            opened = full.rfind('"', 0, end)
            return inside and opened < end - 1 and full[:opened].rstrip().endswith(":")
        return not inside and last == "," and not full[end:].lstrip().startswith(",")

    runs: list[tuple[int, int]] = []
    for k in range(1, n):
        if at_point(k):
            if runs and runs[-1][1] == k - 1:
                runs[-1] = (runs[-1][0], k)
            else:
                runs.append((k, k))
    assert runs, f"no cut {point} in {full!r} ({n} tokens)"
    if point == "between":
        # The last: vLLM streams a required tool call's first members (its
        # name) only once its arguments start, and a router can only
        # continue from tokens it was sent.
        return runs[-1]
    return max(runs, key=lambda r: r[1] - r[0])


# ---- the reference and the batch ----------------------------------------------------------

CUT = [(kind, point) for kind, spec in KINDS.items() for point in POINTS[spec[2]]]
CUT += [("responses", "batch"), *[(kind, "batch") for kind in MESSAGES_CHOICES]]
CUT += [("openai parse", "string")]


def body_of(kind: str, point: str) -> dict:
    return KINDS[kind][1](f"{kind} {point}")


@pytest.fixture(scope="module")
def reference(cluster) -> dict:
    """Each request's uninterrupted answer: the plain engine's."""
    url = cluster.plain.url
    calls = {
        (kind, point): (lambda k=kind, p=point: ask(url, k, body_of(k, p)))
        for kind, point in CUT
        if kind in KINDS
    }
    calls["responses", "batch"] = lambda: post(url, "/v1/responses", responses_body("responses"))
    for kind in MESSAGES_CHOICES:
        calls[kind, "batch"] = lambda k=kind: plain_message(url, k)
    calls["openai parse", "string"] = lambda: openai_parse(url)
    return harness.concurrently(calls)


@pytest.fixture(scope="module")
def killed(cluster, reference, tokenizer) -> dict:
    """The batch, each request cut at its point (`kill_region` of its
    reference's tokens), d1 SIGKILLed, d2 finishing them."""
    regions: dict[tuple, tuple[int, int]] = {}
    for kind, point in CUT:
        if point == "batch":
            continue
        want = harness.outcome(reference[kind, point])
        assert not want["errors"], (kind, want["errors"])
        regions[kind, point] = kill_region(tokenizer, want["token_ids"], point)
    before = {
        "stats": test_pd.stats(cluster[PREFILL].ctrl),
        "prefills": cluster[PREFILL].metric("vllm:request_success_total"),
        "resumes": cluster.router.metric("connex_resumes_total", absent=0.0),
        "reprefills": cluster.router.metric("connex_reprefills_total", absent=0.0),
        "d2_pulls": cluster[D2].metric("connex_kv_pulls_total", absent=0.0),
        "d2_failed": cluster[D2].metric("connex_kv_pull_failures_total", absent=0.0),
    }
    tag = uuid.uuid4().hex[:8]
    ids = {f"so-{tag}-{i}": key for i, key in enumerate(CUT)}
    answers: dict[tuple, dict] = {}
    cut: dict[tuple, int] = {}
    seen: list[tuple[float, dict]] = []

    def pause_at(key: tuple) -> int:
        if key not in regions:
            return BATCH_PAUSE_AT
        low, high = regions[key]
        return (low + high + 1) // 2

    def run(request_id: str, key: tuple) -> None:
        kind, point = key
        url = cluster.router.url
        try:
            if kind == "responses":
                answers[key] = responses_stream(url, request_id)
            elif kind in MESSAGES_CHOICES:
                answers[key] = messages_stream(url, kind, request_id)
            elif kind == "openai parse":
                answers[key] = openai_parse(url, request_id, pause_at(key))
            else:
                body = body_of(kind, point)
                body["vllm_xargs"] = {paused_scheduler.PAUSE_AT_KEY: pause_at(key)}
                answers[key] = ask(url, kind, body, request_id)
        except Exception as err:  # reported by the request's test
            answers[key] = {"errors": [repr(err)]}

    def lined_up() -> bool:
        entries = journal(cluster.router, ids)
        cut.clear()
        cut.update({ids[rid]: e["generated_tokens"] for rid, e in entries.items()})
        decoders = {ids[rid]: e["decoder"] for rid, e in entries.items()}
        assert set(decoders.values()) <= {D1, None}, decoders
        for key, count in cut.items():
            assert count <= pause_at(key), (key, count, pause_at(key))
        if len(cut) < len(ids) or not all(cut.values()):
            return False
        if all(cut[k] >= regions[k][0] for k in cut if k in regions):
            return True
        # The router may withhold a few tokens of a tool call that do not
        # parse yet: once nothing moved for STILL_S, every stream is at its
        # pause (the tests then check where each was cut).
        seen.append((time.monotonic(), dict(cut)))
        return any(t <= seen[-1][0] - STILL_S and c == cut for t, c in seen)

    cluster.only(D1)
    pause = cluster.pause_file(D1)
    pause.write_text(str(BATCH_PAUSE_AT))
    threads = [
        threading.Thread(target=run, args=(rid, key), daemon=True) for rid, key in ids.items()
    ]
    try:
        for thread in threads:
            thread.start()
        try:
            harness.wait_for(lined_up, BATCH_S, "the batch at its kill points")
        except AssertionError as err:
            raise AssertionError(f"{err}: journal at {cut}, regions {regions}") from None
        print(f"killing {D1} with the router at {sorted(cut.items())}")
        cluster.router.admin_post(f"instances/{D2}/activate")
        cluster[D1].kill(signal.SIGKILL)
    finally:
        pause.unlink(missing_ok=True)
        for thread in threads:
            thread.join(BATCH_S)
    harness.wait_for(lambda: not cluster[D1].alive(), 10, "the killed decoder to exit")
    return {"answers": answers, "cut": dict(cut), "regions": regions, "before": before}


# ---- the tests ------------------------------------------------------------------------------

# Found by this module (2026-12-07): every JSON object continued on d2 wrote
# its members in alphabetical order from the cut on (`..."season":..,"warm":..}`
# where the schema, and so the uninterrupted answer, has `"warm"` first): the
# router rebuilt the continuation's body through serde_json's sorted map, and
# xgrammar writes an object's members in the schema's order. The router now
# keeps every object's order (docs/architecture.md, "Wire contracts").


def assert_parses(kind: str, answer: dict) -> None:
    """What a client checks of the answer: its schema, regex or choices."""
    shape = KINDS[kind][2]
    if shape == "json":
        read_json_text(answer["text"])
    elif shape == "tool":
        ((name, arguments),) = answer["calls"]
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)
    elif shape == "regex":
        assert re.fullmatch(REGEX, answer["text"]), answer["text"]
    else:
        assert answer["text"] in CHOICES, answer["text"]


@pytest.mark.parametrize(
    ("kind", "point"),
    [k for k in CUT if k[0] in KINDS],
    ids=[f"{k}-{p}" for k, p in CUT if k in KINDS],
)
def test_a_structured_answer_cut_by_a_decoder_kill_equals_the_uninterrupted_one(
    reference, killed, kind, point
):
    want = harness.outcome(reference[kind, point])
    low, high = killed["regions"][kind, point]
    assert low <= killed["cut"][kind, point] <= high, (killed["cut"][kind, point], low, high)
    got = killed["answers"][kind, point]
    assert not got["errors"], got["errors"]
    assert_parses(kind, want)
    assert got == want


def test_the_openai_clients_parse_across_a_kill(reference, killed):
    want = harness.outcome(reference["openai parse", "string"])
    got = killed["answers"]["openai parse", "string"]
    assert not got["errors"], got["errors"]
    low, high = killed["regions"]["openai parse", "string"]
    assert low <= killed["cut"]["openai parse", "string"] <= high
    assert isinstance(got["parsed"], City)
    assert got == want


def test_a_responses_json_schema_stream_cut_by_a_kill_equals_the_plain_engines(reference, killed):
    want = harness.outcome(reference["responses", "batch"])
    got = killed["answers"]["responses", "batch"]
    assert not got["errors"], got["errors"]
    assert 0 < killed["cut"]["responses", "batch"] <= BATCH_PAUSE_AT
    assert got["status"] == want["status"] == "completed"
    assert got["text"] == responses_text(want)
    read_json_text(got["text"])


# Compared as the client's parsed input (a dict).
@pytest.mark.parametrize("kind", list(MESSAGES_CHOICES))
def test_a_messages_tool_choice_stream_cut_by_a_kill_equals_the_plain_engines(
    reference, killed, kind
):
    want = harness.outcome(reference[kind, "batch"])
    got = killed["answers"][kind, "batch"]
    assert not got["errors"], got["errors"]
    assert 0 < killed["cut"][kind, "batch"] <= BATCH_PAUSE_AT
    assert got["blocks"] == want["blocks"]
    assert got["stop_reason"] == want["stop_reason"] == "tool_use"
    ((name, arguments),) = got["blocks"]
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER)


def test_every_cut_request_was_resumed_once_from_the_hold_and_its_grammar_replayed(cluster, killed):
    """One resume per request, no second prefill; d2 pulled every prompt from
    the prefill's hold (no two share a prefix), and its connector
    fast-forwarded each request's grammar over the tokens d1 had generated."""
    before, count = killed["before"], len(CUT)
    assert cluster.router.metric("connex_resumes_total") - before["resumes"] == count
    assert cluster.router.metric("connex_reprefills_total", absent=0.0) == before["reprefills"]
    assert cluster[PREFILL].metric("vllm:request_success_total") - before["prefills"] == count
    harness.wait_for(
        lambda: (
            cluster[D2].metric("connex_kv_pulls_total", absent=0.0) - before["d2_pulls"] >= count
        ),
        20,
        "d2's pulls on its /metrics",
    )
    assert cluster[D2].metric("connex_kv_pull_failures_total", absent=0.0) == before["d2_failed"]
    harness.wait_for(
        lambda: (
            test_pd.stats(cluster[PREFILL].ctrl)["releases"] - before["stats"]["releases"] >= count
        ),
        20,
        "the holds' releases",
    )
    replayed = re.findall(
        r"structured output continued after (\d+) generated tokens", cluster[D2].log_text()
    )
    assert len(replayed) == count, replayed
    assert "structured output cannot be continued" not in cluster[D2].log_text()
