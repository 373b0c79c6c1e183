"""The official `openai` client talks to connex-router as to any OpenAI server."""

import contextlib
import json
import subprocess
import time
import urllib.request

import openai
import pytest
from connex_harness import MockEngine, Router, free_port, mock_cluster


def client(router: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0)


def test_non_stream_completion(cluster):
    reply = client(cluster).completions.create(model="mock", prompt="Hello", max_tokens=7)
    assert reply.object == "text_completion"
    assert reply.usage.completion_tokens == 7
    assert len(reply.choices[0].text.split()) == 7
    assert reply.choices[0].finish_reason == "length"


def test_stream_chat(cluster):
    api = client(cluster)
    messages = [{"role": "user", "content": "Say something"}]
    whole = api.chat.completions.create(model="mock", messages=messages, max_tokens=6)
    stream = api.chat.completions.create(
        model="mock",
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, ids = [], None, set()
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 6
    assert len(ids) == 1


def test_errors_are_openai_errors(cluster):
    api = client(cluster)
    try:
        api.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as err:
        assert "no-such-model" in str(err)
    else:
        raise AssertionError("unknown model was accepted")
    try:
        api.completions.create(model="mock", prompt="x", max_tokens=-3)
    except openai.BadRequestError as err:
        assert err.status_code == 400
    else:
        raise AssertionError("negative max_tokens was accepted")


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture
def crashing_decoder_cluster():
    """A router with a prefill, a decoder `d0` that dies after 10 tokens of a
    stream and a healthy `d1`, both serving vLLM's tokens API; round-robin
    sends the first request to d0. Yields the client and internal URLs."""
    # Paced: every token reaches the router before d0 dies.
    common = ["--enable-scale-out", "--decode-us-per-token", "1000"]
    engines = [
        ("prefill", common),
        ("decode", [*common, "--id", "d0", "--crash-after-tokens", "10"]),
        ("decode", [*common, "--id", "d1"]),
    ]
    with mock_cluster(["--decode-policy", "round_robin"], engines) as router:
        yield router.url, router.internal


def streamed_answer(api: openai.OpenAI) -> dict:
    """A reasoning chat with two tools, streamed, as the client puts it together."""
    stream = api.chat.completions.create(
        model="mock",
        messages=[{"role": "user", "content": "Weather and time in Paris?"}],
        max_tokens=16,
        tools=TOOLS,
        reasoning_effort="low",
        stream=True,
    )
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": None, "arguments": ""})
                if call.function and call.function.name:
                    entry["name"] = call.function.name
                entry["arguments"] += (call.function and call.function.arguments) or ""
            finish = choice.finish_reason or finish
    return {"reasoning": reasoning, "content": content, "calls": calls, "finish": finish}


def test_a_stream_with_reasoning_and_tools_survives_its_decoder(crashing_decoder_cluster):
    router, internal = crashing_decoder_cluster
    api = client(router)
    # d0 dies after 10 tokens: 8 of reasoning, then the opening of both calls.
    resumed = streamed_answer(api)
    # d0 is gone: the same request now runs on d1 uninterrupted.
    whole = streamed_answer(api)
    assert resumed["reasoning"] == whole["reasoning"] and len(whole["reasoning"]) > 10
    assert resumed["content"] == whole["content"] == ""
    assert [(c["name"], c["arguments"]) for c in resumed["calls"].values()] == [
        (c["name"], c["arguments"]) for c in whole["calls"].values()
    ]
    assert [c["name"] for c in whole["calls"].values()] == ["get_weather", "get_time"]
    assert resumed["finish"] == whole["finish"] == "length"
    # Both calls opened on d0, before it died: their ids are the ones d0 gave.
    assert [c["id"] for c in resumed["calls"].values()] == [
        c["id"] for c in whole["calls"].values()
    ]
    with urllib.request.urlopen(f"{internal}/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    resumes = [line for line in metrics.splitlines() if line.startswith("connex_resumes_total")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in resumes) == 1, resumes


def test_the_api_key_is_what_the_openai_client_sends():
    key = "sk-python-tier-0001"
    with mock_cluster(["--api-key", key], [("prefill", []), ("decode", [])]) as cluster:
        router = cluster.url
        keyed = openai.OpenAI(base_url=f"{router}/v1", api_key=key, max_retries=0)
        reply = keyed.chat.completions.create(
            model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.usage.completion_tokens == 3
        assert [m.id for m in keyed.models.list()] == ["mock"]
        for wrong in ("sk-someone-else-01", ""):
            other = openai.OpenAI(base_url=f"{router}/v1", api_key=wrong or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as refused:
                other.completions.create(model="mock", prompt="x", max_tokens=1)
            assert refused.value.status_code == 401
        # The probes stay open to the orchestrator.
        with urllib.request.urlopen(f"{router}/health", timeout=5) as health:
            assert health.status == 200


WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def test_responses_through_the_openai_client_stream_and_not(cluster):
    api = client(cluster)
    whole = api.responses.create(
        model="mock",
        input="Weather?",
        max_output_tokens=10,
        tools=WEATHER,
        reasoning={"effort": "low"},
    )
    # The mock answers until max_output_tokens: incomplete, as OpenAI says of it.
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert whole.usage.output_tokens == 10
    # Streamed: the client's own event models parse every event.
    kinds, done = [], None
    with api.responses.stream(
        model="mock",
        input="Weather?",
        max_output_tokens=10,
        tools=WEATHER,
        reasoning={"effort": "low"},
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        done = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert done.status == "incomplete"
    assert [item.type for item in done.output] == ["reasoning", "function_call"]
    assert done.output[1].arguments == whole.output[1].arguments
    # The next turn through previous_response_id, and the stored response.
    call = done.output[1]
    after = api.responses.create(
        model="mock",
        previous_response_id=done.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        max_output_tokens=4,
    )
    assert after.previous_response_id == done.id
    assert api.responses.retrieve(done.id).id == done.id
    api.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(done.id)


def test_a_background_response_is_retrieved_as_a_stream_from_any_event(cluster):
    api = client(cluster)
    queued = api.responses.create(
        model="mock", input="In the background", background=True, max_output_tokens=12
    )
    assert queued.background and queued.status in ("queued", "in_progress")
    events = list(api.responses.retrieve(queued.id, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    later = list(api.responses.retrieve(queued.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in later] == numbers[4:]
    assert api.responses.retrieve(queued.id).usage.output_tokens == 12


def test_a_background_response_outlives_its_router_through_the_openai_client(tmp_path):
    """Two routers on one Redis (`--response-store`): the official client
    streams a background response from router A, A is killed, and the same
    client reattaches to router B with `starting_after`; B took the generation
    over, and the events the client gets are each once and end completed."""
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    with contextlib.ExitStack() as parts:
        parts.callback(redis.wait)
        parts.callback(redis.kill)
        common = ["--model", "mock", "--enable-scale-out", "--decode-us-per-token", "30000"]
        prefill = parts.enter_context(MockEngine("--role", "prefill", *common))
        decoder = parts.enter_context(MockEngine("--role", "decode", *common))
        with urllib.request.urlopen(f"{prefill.url}/mock/stats", timeout=5) as reply:
            ctrl = json.load(reply)["ctrl"]
        flags = ["--static-model", "mock", "--prefill", f"{prefill.url},{ctrl}"]
        flags += ["--decode", decoder.url, "--response-store", f"redis://127.0.0.1:{port}"]
        flags += ["--response-lease-ms", "600"]
        a = parts.enter_context(Router(*flags, admin_token=None))
        b = parts.enter_context(Router(*flags, admin_token=None))
        a_url, b_url = a.url, b.url
        for url in (a_url, b_url):
            deadline = time.monotonic() + 10
            while not urllib.request.urlopen(f"{url}/ready", timeout=5).status == 200:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        created = client(a_url).responses.create(
            model="mock", input="Outlive your router", background=True, max_output_tokens=60
        )
        seen = []
        with client(a_url).responses.retrieve(created.id, stream=True) as events:
            for event in events:
                seen.append(event)
                if len(seen) == 10:
                    break
        a.kill()
        rest = list(
            client(b_url).responses.retrieve(
                created.id, stream=True, starting_after=seen[-1].sequence_number
            )
        )
        everything = seen + rest
        assert [e.sequence_number for e in everything] == list(range(len(everything)))
        assert everything[-1].type == "response.completed"
        assert everything[-1].response.usage.output_tokens == 60
        assert client(b_url).responses.retrieve(created.id).status == "incomplete"
