"""connex.agent against a scripted router: it survives whatever a round throws,
keeps heartbeating, and presents the credential the router issued.

The router here is a stub on purpose: these tests are about the agent's
reactions to replies a real router sends rarely (a cut body, a malformed field);
tests/vllm/test_agent.py runs the agent against the real connex-router.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from connex.agent import CREDENTIAL_HEADER, Agent
from connex.credentials import read_secret


class Stub:
    """An HTTP server whose replies are scripted per (method, path prefix); it
    records every router request with its headers. Serves the engine's /health too."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, str], object]] = []
        # (method, path prefix) -> list of replies, the last one repeated;
        # a reply is (status, body bytes, declared length or None).
        self.script: dict[tuple[str, str], list[tuple[int, bytes, int | None]]] = {}
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                if not self.path.startswith("/v1/"):  # the engine's /health, /metrics
                    status, raw, declared = 200, b"", None
                else:
                    with stub.lock:
                        stub.calls.append(
                            (
                                self.command,
                                self.path,
                                {k.lower(): v for k, v in self.headers.items()},
                                body,
                            )
                        )
                        status, raw, declared = stub.reply(self.command, self.path)
                self.send_response(status)
                self.send_header(
                    "content-length", str(declared if declared is not None else len(raw))
                )
                self.end_headers()
                self.wfile.write(raw)
                if declared is not None:
                    # A body cut short: the client sees an IncompleteRead.
                    self.close_connection = True

            do_GET = do_POST = do_DELETE = _serve  # noqa: N815 (http.server's names)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reply(self, method: str, path: str) -> tuple[int, bytes, int | None]:
        for (m, prefix), replies in self.script.items():
            if (
                m == method
                and path.startswith(prefix)
                and (path.endswith("/heartbeat") == prefix.endswith("/heartbeat"))
            ):
                return replies.pop(0) if len(replies) > 1 else replies[0]
        return 404, b"{}", None

    def calls_to(self, method: str, suffix: str = "") -> list:
        with self.lock:
            return [c for c in self.calls if c[0] == method and c[1].endswith(suffix)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def ok(body: dict) -> tuple[int, bytes, None]:
    return 200, json.dumps(body).encode(), None


def wait_until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def stub():
    stub = Stub()
    yield stub
    stub.close()


def test_agent_survives_malformed_replies_and_keeps_heartbeating(stub):
    stub.script[("POST", "/v1/instances/e1/heartbeat")] = [
        (200, b'{"ok": tr', 400),  # the connection dies mid-body: IncompleteRead
        ok({}),
    ]
    stub.script[("POST", "/v1/instances")] = [
        ok({"id": "e1", "lease_ttl_s": "soon"}),  # not a number: ValueError
        ok({"id": "e1", "credential": 5}),  # not a string: ValueError
        ok({"id": "e1", "lease_ttl_s": 0.3}),
    ]
    agent = Agent(stub.url, "decode", stub.url, "m", instance_id="e1").start()
    try:
        wait_until(lambda: agent.heartbeats >= 3)
        assert agent._thread is not None and agent._thread.is_alive()
        assert agent.errors == 2  # each failure logged and counted, then retried
        assert agent.registrations == 1
    finally:
        agent.stop()


def test_agent_presents_its_credential_on_heartbeat_reregistration_and_deregistration(stub):
    stub.script[("POST", "/v1/instances")] = [
        ok({"id": "e1", "lease_ttl_s": 0.3, "credential": "c-123"}),
    ]
    # The router forgets the instance once: the agent registers again, with its credential.
    stub.script[("POST", "/v1/instances/e1/heartbeat")] = [ok({}), (404, b"{}", None), ok({})]
    agent = Agent(stub.url, "decode", stub.url, "m", instance_id="e1", token="tok").start()
    try:
        wait_until(lambda: agent.registrations == 2 and agent.heartbeats >= 2)
    finally:
        agent.stop()
    first, again = stub.calls_to("POST", "/v1/instances")
    assert CREDENTIAL_HEADER not in first[2]  # none issued yet
    assert again[2][CREDENTIAL_HEADER] == "c-123"
    assert all(c[2][CREDENTIAL_HEADER] == "c-123" for c in stub.calls_to("POST", "/heartbeat"))
    (delete,) = stub.calls_to("DELETE")
    assert delete[1] == "/v1/instances/e1" and delete[2][CREDENTIAL_HEADER] == "c-123"
    assert all(c[2]["authorization"] == "Bearer tok" for c in stub.calls)


def test_agent_without_a_credential_sends_no_header(stub):
    stub.script[("POST", "/v1/instances")] = [ok({"id": "e1", "lease_ttl_s": 0.3})]
    stub.script[("POST", "/v1/instances/e1/heartbeat")] = [ok({})]
    agent = Agent(stub.url, "prefill", stub.url, "m", instance_id="e1").start()
    try:
        wait_until(lambda: agent.heartbeats >= 1)
    finally:
        agent.stop()
    assert all(CREDENTIAL_HEADER not in c[2] for c in stub.calls)


@pytest.mark.parametrize("source", ["file", "env"])
def test_cli_agent_reads_its_token_from_a_file_or_the_environment(stub, tmp_path, source):
    stub.script[("POST", "/v1/instances")] = [ok({"id": "e1", "lease_ttl_s": 0.3})]
    stub.script[("POST", "/v1/instances/e1/heartbeat")] = [ok({})]
    token = tmp_path / "token"
    token.write_text("from-file\n")
    env = dict(os.environ, CONNEX_REGISTER_TOKEN="from-env")
    args = [f"--token-file={token}"] if source == "file" else []
    agent = subprocess.Popen(
        [sys.executable, "-m", "connex.agent", "--router", stub.url, "--role", "decode"]
        + ["--url", stub.url, "--model", "m", *args],
        env=env,
    )
    try:
        wait_until(lambda: stub.calls_to("POST", "/heartbeat"))
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0
    finally:
        agent.kill()
        agent.wait()
    assert {c[2]["authorization"] for c in stub.calls} == {f"Bearer from-{source}"}
    assert stub.calls_to("DELETE")


def test_read_secret_prefers_value_then_file_then_env(tmp_path, monkeypatch):
    monkeypatch.setenv("X_SECRET", "env")
    path = tmp_path / "s"
    path.write_text("  file \n")
    assert read_secret("value", path, "X_SECRET") == "value"
    assert read_secret(None, path, "X_SECRET") == "file"
    assert read_secret(None, None, "X_SECRET") == "env"
    monkeypatch.setenv("X_SECRET", "")
    assert read_secret(None, None, "X_SECRET") is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret(None, empty)
    with pytest.raises(OSError):
        read_secret(None, tmp_path / "missing")


def test_the_deregister_file_takes_the_engine_out_of_a_real_router(tmp_path):
    """What the chart's preStop does: the file appears, the agent deregisters
    from the real router at once and registers no more."""
    from connex.agent import Agent
    from connex_harness import MockEngine, Router, wait_for

    with (
        Router("--heartbeat-ttl-s=60") as router,
        MockEngine("--role", "decode", "--model", "mock") as engine,
    ):
        stop_file = tmp_path / "deregister"
        agent = Agent(
            router.internal, "decode", engine.url, "mock", deregister_file=str(stop_file)
        ).start()
        wait_for(router.instance_ids, 10, "the agent to register", interval_s=0.05)
        stop_file.touch()
        wait_for(lambda: not router.instance_ids(), 5, "the agent to deregister", interval_s=0.05)
        assert agent._thread is not None
        agent._thread.join(timeout=5)
        assert agent.retired and not agent._thread.is_alive()
        time.sleep(0.5)
        assert not router.instance_ids(), "the agent registered again"


def test_refused_kv_events_are_dropped_and_the_routers_index_cleared_next(stub):
    """A batch the router refuses for good (4xx) is dropped, and the next
    batch starts with AllBlocksCleared: a lost BlockRemoved would otherwise
    leave the router's index claiming blocks the engine evicted. A failing
    router (5xx) keeps the batch for later."""
    from connex.kv_events import CLEARED, KvEventForwarder

    stub.script[("POST", "/v1/instances/e1/kv-events")] = [
        (413, b'{"error": {"message": "too large"}}', None),
        (503, b"{}", None),
        ok({}),
    ]
    stub.script[("POST", "/v1/instances")] = [ok({"id": "e1", "lease_ttl_s": 30})]
    agent = Agent(stub.url, "prefill", stub.url, "m", instance_id="e1")
    # The forwarder is driven by hand here (no ZMQ publisher): what matters is
    # what the agent does with the router's answers.
    forwarder = KvEventForwarder("tcp://127.0.0.1:1", agent.forward_kv_events, decode=lambda _: [])
    agent.kv_events = forwarder
    agent.start()
    try:
        wait_until(lambda: agent.registrations >= 1)
        stored = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None}
        forwarder.pending = [stored]
        forwarder.flush()  # 413: dropped, index to be cleared
        assert forwarder.pending == [CLEARED]
        forwarder.flush()  # 503: kept
        assert forwarder.pending == [CLEARED]
        forwarder.flush()  # 200: forwarded
        assert forwarder.pending == []
        sent = [body["events"] for _, _, _, body in stub.calls_to("POST", "/kv-events")]
        assert sent == [[stored], [CLEARED], [CLEARED]]
        assert forwarder.resets == 1
    finally:
        agent.stop()


def test_the_agent_follows_no_redirect_with_its_token_and_credential():
    # A redirect (from a router replaced by something else, or a proxy in
    # between) must not carry the register token and the instance credential
    # to wherever it points: urllib follows a 302 with every header but the
    # body's.
    seen: list[dict[str, str]] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def _serve(self):
            seen.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _serve  # noqa: N815 (http.server's names)

        def log_message(self, *args):
            pass

    elsewhere = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    target = f"http://127.0.0.1:{elsewhere.server_address[1]}/v1/instances"

    class Redirecting(BaseHTTPRequestHandler):
        def _serve(self):
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            self.send_response(302)
            self.send_header("location", target)
            self.send_header("content-length", "0")
            self.end_headers()

        do_GET = do_POST = do_DELETE = _serve  # noqa: N815 (http.server's names)

        def log_message(self, *args):
            pass

    router = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=router.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{router.server_address[1]}"
    try:
        agent = Agent(url, "decode", url, "m", instance_id="e1", token="tok")
        agent.credential = "c-123"
        agent.register()
        assert agent.registrations == 0, "a redirect is no registration"
        assert seen == [], f"followed the redirect with {seen}"
    finally:
        router.shutdown()
        router.server_close()
        elsewhere.shutdown()
        elsewhere.server_close()
