"""KV events from an engine's ZMQ publisher, in vLLM's wire format, forwarded
by the agent to a real connex-router, whose prefix index follows them
(`prefix_index_blocks` in the admin view): stores, removals, and a reset when
events were lost (a skipped sequence number).

The publisher here is a ZMQ PUB socket sending what vLLM's ZmqEventPublisher
sends: multipart (topic, 8-byte big-endian sequence number, msgpack of a
KVEventBatch with tagged, array-like events). The event types below are the
wire format as vLLM's own example subscriber declares it
(examples/online_serving/kv_events_subscriber.py); in vLLM the forwarder
decodes with vLLM's own types instead.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import pytest
import zmq
from connex.agent import Agent
from connex.kv_events import KvEventForwarder, make_decoder
from connex_harness import Router


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@pytest.fixture
def router() -> Iterator[str]:
    with Router() as router:
        yield router.internal


@pytest.fixture
def engine() -> Iterator[str]:
    """An engine whose /health answers (the agent registers it once it does)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def indexed_blocks(router: str) -> int:
    request = urllib.request.Request(
        f"{router}/admin/instances", headers={"Authorization": "Bearer t"}
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        return int(json.load(reply)["data"][0]["prefix_index_blocks"])


def eventually(check: Any, what: str, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_vllm_kv_events_reach_the_routers_prefix_index(router: str, engine: str) -> None:
    context = zmq.Context.instance()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    encoder = msgspec.msgpack.Encoder()
    seq = 0

    def publish(*events: KVCacheEvent, skip: int = 0) -> None:
        nonlocal seq
        seq += 1 + skip
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))
        publisher.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    agent = Agent(router, "prefill", engine, "mock").start()
    forwarder = KvEventForwarder(
        f"tcp://*:{port}", agent.forward_kv_events, decode=make_decoder(KVEventBatch)
    ).start()
    try:
        eventually(lambda: agent.instance_id is not None, "the agent registers")
        # A slow joiner: publish until the subscription is live.
        tokens = list(range(32))
        stored = BlockStored([b"\x01" * 32, b"\x02" * 32], None, tokens, 16, None, "GPU")
        deadline = time.monotonic() + 5
        while indexed_blocks(router) != 2:
            assert time.monotonic() < deadline, "stored blocks reach the index"
            publish(stored)
            time.sleep(0.1)
        # A child block after the second one, stored in a later step.
        publish(BlockStored([b"\x03" * 32], b"\x02" * 32, list(range(32, 48)), 16, None, "GPU"))
        eventually(lambda: indexed_blocks(router) == 3, "a chained block is indexed")
        publish(BlockRemoved([b"\x03" * 32], "GPU"))
        eventually(lambda: indexed_blocks(router) == 2, "a removed block leaves the index")
        # Blocks offloaded to CPU are not the engine's own cache: not indexed.
        publish(BlockStored([b"\x09" * 32], None, list(range(100, 116)), 16, None, "CPU"))
        # Lost events: the index is reset, then follows the new stores.
        publish(BlockStored([7], None, list(range(200, 216)), 16, None, None), skip=3)
        eventually(lambda: indexed_blocks(router) == 1, "a gap resets the index")
        assert forwarder.resets >= 1
        publish(AllBlocksCleared())
        eventually(lambda: indexed_blocks(router) == 0, "AllBlocksCleared empties the index")
    finally:
        forwarder.stop()
        agent.stop()
        publisher.close()


def test_the_forwarder_binds_where_vllm_connects() -> None:
    """vLLM's publisher binds `tcp://*:PORT` but connects to `tcp://HOST:PORT`
    (the subscriber binds it): the forwarder mirrors it, so an engine started
    with a loopback endpoint still reaches it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got: list[list[dict[str, Any]]] = []
    forwarder = KvEventForwarder(
        f"tcp://127.0.0.1:{port}",
        lambda events: got.append(events) or True,
        decode=make_decoder(KVEventBatch),
    ).start()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.connect(f"tcp://127.0.0.1:{port}")
    encoder = msgspec.msgpack.Encoder()
    try:
        deadline = time.monotonic() + 5
        seq = 0
        while not got:
            assert time.monotonic() < deadline, "events from a connecting publisher"
            seq += 1
            payload = encoder.encode(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            publisher.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            time.sleep(0.1)
        assert got[0][0]["type"] == "AllBlocksCleared"
    finally:
        publisher.close()
        forwarder.stop()


def test_the_forwarder_listens_on_loopback_only() -> None:
    """Whatever reaches the forwarder's socket feeds this engine's entry in
    the router's prefix index: given `tcp://0.0.0.0:PORT` (vLLM's publisher
    then connects over loopback) it binds loopback, not every interface, and
    an address on the network is refused. Before, it bound all interfaces."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    forwarder = KvEventForwarder(
        f"tcp://0.0.0.0:{port}", lambda events: True, decode=make_decoder(KVEventBatch)
    )
    assert forwarder.endpoint == f"tcp://127.0.0.1:{port}"
    forwarder.start()
    try:
        # Bound on loopback, where the publisher connects.
        deadline = time.monotonic() + 5
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the forwarder never bound loopback"
            time.sleep(0.05)
    finally:
        forwarder.stop()
    with pytest.raises(ValueError, match="listen on the network"):
        KvEventForwarder("tcp://10.1.2.3:5557", lambda events: True, decode=lambda _: [])
