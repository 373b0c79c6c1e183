"""The mock engine's KV events over ZMQ (`--kv-events-publish`), read as any
reader of vLLM's feed reads them: a pyzmq SUB socket, each message decoded with
vLLM's own `KVEventBatch` type (the installed vLLM's msgspec decoder, through
the decoder Connex's agent uses), so that vllm-router's `kv_aware`
(`--pd-kv-events URL=ENDPOINT`) can be pointed at the mocks.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq
from connex.kv_events import vllm_decoder
from connex_harness import ROOT, MockEngine, free_port

BLOCK = 16


@pytest.fixture
def mock() -> Iterator[tuple[str, str]]:
    """A mock engine with a prefix cache publishing its events; yields its
    URL and the ZMQ endpoint it publishes on."""
    with MockEngine(
        "--role",
        "both",
        "--prefix-cache-blocks",
        "1000",
        "--block-size",
        str(BLOCK),
        "--kv-events-publish",
        "tcp://127.0.0.1:0",
    ) as engine:
        endpoint = engine.kv_events
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0"), endpoint
        yield engine.url, endpoint


def complete(url: str, prompt: str) -> None:
    body = json.dumps({"model": "mock", "prompt": prompt, "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


def subscriber(endpoint: str) -> zmq.Socket:
    """A SUB socket on every topic of `endpoint`, as vLLM's readers open one."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt_string(zmq.SUBSCRIBE, "")
    socket.connect(endpoint)
    return socket


def receive(socket: zmq.Socket, timeout_s: float = 5.0) -> list[bytes] | None:
    if socket.poll(int(timeout_s * 1000)):
        return socket.recv_multipart()
    return None


def test_mock_kv_events_decode_as_vllm_event_batches(mock):
    url, endpoint = mock
    decode = vllm_decoder()
    socket = subscriber(endpoint)
    try:
        # A PUB socket sends nothing until the subscriber is connected: prime
        # with throwaway prompts until the first batch comes through.
        first = None
        deadline = time.monotonic() + 15
        while first is None and time.monotonic() < deadline:
            complete(url, f"warm-up {time.monotonic_ns()} " + "w" * 40)
            first = receive(socket, 0.3)
        assert first is not None, "no KV event batch published"
        while receive(socket, 0.3) is not None:
            pass

        prompt = "S" * (BLOCK * 6) + "tail"
        complete(url, prompt)
        parts = receive(socket)
        assert parts is not None and len(parts) == 3
        topic, seq_bytes, payload = parts
        assert topic == b"" and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        (stored,) = decode(payload)
        assert stored["type"] == "BlockStored"
        assert stored["block_size"] == BLOCK
        assert len(stored["block_hashes"]) == 6
        # The whole blocks' token ids (the mock's tokens are the prompt's bytes).
        assert stored["token_ids"] == [ord("S")] * (BLOCK * 6)
        assert stored["parent_block_hash"] is None
        assert stored["medium"] == "GPU"

        # The same prefix and two more blocks: only the new blocks are
        # stored, chained to the cached prefix's last block; the next number.
        complete(url, "S" * (BLOCK * 6) + "T" * (BLOCK * 2))
        parts = receive(socket)
        assert parts is not None
        assert int.from_bytes(parts[1], "big") == seq + 1
        (more,) = decode(parts[2])
        assert more["type"] == "BlockStored"
        assert more["parent_block_hash"] == stored["block_hashes"][-1]
        assert more["token_ids"] == [ord("T")] * (BLOCK * 2)
    finally:
        socket.close()


def test_evictions_are_published_as_block_removed():
    engine = MockEngine(
        "--prefix-cache-blocks",
        "2",
        "--block-size",
        str(BLOCK),
        "--kv-events-publish",
        "tcp://127.0.0.1:0",
    )
    url, endpoint = engine.url, engine.kv_events
    decode = vllm_decoder()
    socket = subscriber(endpoint)
    try:
        events: list[dict] = []
        deadline = time.monotonic() + 15
        attempt = 0
        while not events and time.monotonic() < deadline:
            # A new prompt each time: the subscriber may miss the first batches
            # (ZMQ's slow joiner), and a prompt already cached publishes nothing.
            complete(url, f"{attempt:0{BLOCK * 2}d}")
            attempt += 1
            parts = receive(socket, 0.3)
            if parts is not None:
                events = decode(parts[2])
        assert events, "no KV event batch published"
        while (parts := receive(socket, 0.3)) is not None:
            events += decode(parts[2])
        # A third block goes past the cap of two: the oldest is evicted.
        complete(url, "B" * BLOCK)
        parts = receive(socket)
        assert parts is not None
        types = [e["type"] for e in decode(parts[2])]
        assert types == ["BlockStored", "BlockRemoved"]
    finally:
        socket.close()
        engine.stop()


VLLM_ROUTER = ROOT / ".venv" / "bin" / "vllm-router"


def test_vllm_router_kv_aware_follows_the_mock_events():
    """vllm-router's `kv_aware` fed by the mocks' events (`--pd-kv-events`):
    a prompt the second prefill computed (sent to it directly) is routed
    there, although with no cache information it would take the first (the
    least loaded, ties to the first)."""
    procs: list[subprocess.Popen | MockEngine] = []

    def mock(*args: str) -> str:
        engine = MockEngine("--model", "mock", *args)
        procs.append(engine)
        return engine.url

    try:
        prefills = []
        events = []
        for _ in range(2):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            url = mock(
                "--role",
                "prefill",
                "--prefix-cache-blocks",
                "1000",
                "--block-size",
                str(BLOCK),
                "--kv-events-publish",
                endpoint,
            )
            prefills.append(url)
            events += ["--pd-kv-events", f"{url}={endpoint}"]
        decode = mock("--role", "decode")
        port = free_port()
        args = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port)]
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        args += ["--vllm-pd-disaggregation", "--log-level", "warning"]
        args += ["--prefill", prefills[0], "--prefill", prefills[1], "--decode", decode]
        args += ["--prefill-policy", "kv_aware", "--decode-policy", "round_robin", *events]
        procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{router}/v1/models", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm-router did not start"
            time.sleep(0.2)

        prompt = "You are assistant seven; answer briefly. " * 24
        # The subscriber connects in the background: store the prompt on the
        # second prefill (directly) until vllm-router credits its blocks.
        served = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            stamp = f"{time.monotonic_ns()} "
            complete(prefills[1], stamp + prompt)
            time.sleep(0.3)
            before = computed(prefills)
            complete(router, stamp + prompt + "question?")
            after = computed(prefills)
            served = [i for i in range(2) if after[i] > before[i]]
            if served == [1]:
                break
        assert served == [1], "vllm-router kv_aware did not follow the mock's KV events"
        # The second prefill computed only the new tail, not the prefix.
        assert after[1] - before[1] < BLOCK * 2, (before, after)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def computed(prefills: list[str]) -> list[int]:
    """Prompt tokens each mock prefill has computed so far."""
    totals = []
    for url in prefills:
        with urllib.request.urlopen(f"{url}/mock/stats", timeout=5) as reply:
            records = json.load(reply)["requests"]
        totals.append(sum(r["computed_prompt_tokens"] for r in records))
    return totals
