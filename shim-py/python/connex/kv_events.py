"""Forwards an engine's KV cache events to the router, for `cache_aware` routing.

vLLM publishes its KV cache events over ZMQ when `--kv-events-config` enables
them (`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557"}`; vLLM binds a wildcard endpoint and connects to a
`tcp://host:port` one, which the forwarder then binds): multipart messages
(topic, 8-byte big-endian sequence number, msgpack payload of a
`KVEventBatch` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`). A
`KvEventForwarder` subscribes to that socket, turns each event into JSON with
vLLM's own field names (bytes hashes as hex) and hands batches to `send` (the
agent posts them to `POST /v1/instances/{id}/kv-events` with its heartbeat
credential).

Bounded: at most `max_pending` events wait; past it, or when a sequence number
is skipped (events lost), the batch is replaced by one `AllBlocksCleared`, so
that the router's index is never wrong, only emptier until new blocks are stored.
pyzmq and msgspec are vLLM's own dependencies; they are imported only here.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("connex.kv_events")

CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}

Decode = Callable[[bytes], list[dict[str, Any]]]


def jsonable(value: Any) -> Any:
    """A decoded event field as JSON: bytes as hex, tuples as lists."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def make_decoder(batch_type: type) -> Decode:
    """A payload decoder for `batch_type` (vLLM's `KVEventBatch`): each event
    as a dict of its fields, tagged with `type` (its class name)."""
    import msgspec

    decoder: Any = msgspec.msgpack.Decoder(type=batch_type)

    def decode(payload: bytes) -> list[dict[str, Any]]:
        batch = decoder.decode(payload)
        events = []
        for event in batch.events:
            fields = {k: jsonable(v) for k, v in msgspec.structs.asdict(event).items()}
            events.append({"type": type(event).__name__, **fields})
        return events

    return decode


def vllm_decoder() -> Decode:
    """The decoder of the installed vLLM's own event types (field names and
    order follow whatever vLLM version is installed)."""
    from vllm.distributed.kv_events import KVEventBatch

    return make_decoder(KVEventBatch)


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds `endpoint` (a wildcard, `::`, ipc or
    inproc: vLLM's `ZmqEventPublisher._is_bind_endpoint`) or connects to it
    (`tcp://host:port`: then the subscriber must bind it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connect_endpoint(endpoint: str) -> str:
    """The address to connect to for a publisher's bind `endpoint`
    (`tcp://*:5557` binds every interface; the engine is on this host)."""
    return endpoint.replace("://*", "://127.0.0.1").replace("://0.0.0.0", "://127.0.0.1")


def loopback_bind(endpoint: str) -> str:
    """The endpoint the forwarder binds for a publisher that connects to
    `endpoint`, on loopback only: whatever reaches it feeds this engine's entry
    in the router's prefix index (with the agent's credential), so it must not
    listen on the network. `tcp://0.0.0.0:PORT` (a publisher connecting there
    reaches loopback) binds `tcp://127.0.0.1:PORT`; another host that is not
    loopback is refused (ValueError)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if host in ("0.0.0.0", ""):
        return f"tcp://127.0.0.1:{port}"
    if host == "localhost":
        return endpoint
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"KV event endpoint {endpoint}: the publisher connects there, so the forwarder "
            "would bind it and listen on the network; use tcp://127.0.0.1:PORT"
        )
    return endpoint


class KvEventForwarder:
    """Subscribes to a ZMQ KV event publisher and forwards its events, on a daemon
    thread, every `flush_s` or `batch` events, through `send` (False: keep them
    and try again)."""

    def __init__(
        self,
        endpoint: str,
        send: Callable[[list[dict[str, Any]]], bool],
        decode: Decode | None = None,
        topic: str = "",
        flush_s: float = 0.05,
        batch: int = 1024,
        max_pending: int = 4096,
    ) -> None:
        # The SUB side mirrors vLLM's PUB side: connect to a publisher that
        # binds, bind where it connects (`tcp://127.0.0.1:5557`, which keeps
        # the feed on loopback).
        self.bind = not publisher_binds(endpoint)
        self.endpoint = loopback_bind(endpoint) if self.bind else connect_endpoint(endpoint)
        self.send = send
        self.decode = decode or vllm_decoder()
        self.topic = topic
        self.flush_s = flush_s
        self.batch = batch
        self.max_pending = max_pending
        self.pending: list[dict[str, Any]] = []
        self.last_seq: int | None = None
        # Batches that could not be decoded, and times events were dropped.
        self.errors = 0
        self.resets = 0
        self.forwarded = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> KvEventForwarder:
        self._thread = threading.Thread(target=self.run, name="connex-kv-events", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def run(self) -> None:
        import zmq

        context: Any = zmq.Context.instance()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        if self.bind:
            socket.bind(self.endpoint)
        else:
            socket.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        last_flush = time.monotonic()
        try:
            while not self._stop.is_set():
                if poller.poll(timeout=int(self.flush_s * 1000)):
                    self.receive(socket.recv_multipart())
                due = time.monotonic() - last_flush >= self.flush_s
                if self.pending and (due or len(self.pending) >= self.batch):
                    self.flush()
                    last_flush = time.monotonic()
        finally:
            socket.close()

    def receive(self, parts: list[bytes]) -> None:
        """One published message: (topic, sequence, payload)."""
        if len(parts) != 3:
            self.errors += 1
            return
        _, seq_bytes, payload = parts
        seq = int.from_bytes(seq_bytes, "big")
        if self.last_seq is not None and seq != self.last_seq + 1:
            logger.warning("KV events %d..%d lost; the router's index is reset", self.last_seq, seq)
            self.reset()
        self.last_seq = seq
        try:
            events = self.decode(payload)
        except Exception as err:  # a version mismatch must not stop the engine
            self.errors += 1
            logger.warning("undecodable KV event batch (%s); the router's index is reset", err)
            self.reset()
            return
        self.pending.extend(events)
        if len(self.pending) > self.max_pending:
            self.reset()

    def reset(self) -> None:
        self.resets += 1
        self.pending = [dict(CLEARED)]

    def flush(self) -> None:
        events, self.pending = self.pending[: self.batch], self.pending[self.batch :]
        try:
            sent = self.send(events)
        except Exception as err:  # the router may be away; keep them
            logger.debug("KV events not forwarded: %s", err)
            sent = False
        if sent:
            self.forwarded += len(events)
        else:
            self.pending = events + self.pending
            if len(self.pending) > self.max_pending:
                self.reset()
