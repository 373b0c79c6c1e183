"""connex.agent keeps engines registered with a real connex-router."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import harness
import httpx
import pytest
from connex.agent import Agent


def by_id(router: harness.Router) -> dict[str, dict]:
    return {i["id"]: i for i in router.instances()}


@pytest.fixture
def router():
    router = harness.Router("--heartbeat-ttl-s", "2")
    yield router
    router.stop()


class StubEngine:
    """An HTTP server answering /health (switchable) and /metrics like vLLM."""

    def __init__(self) -> None:
        self.healthy = True
        self.health_checks = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path == "/health":
                    stub.health_checks += 1
                    self.send_response(200 if stub.healthy else 503)
                    self.end_headers()
                elif self.path == "/metrics":
                    body = b'vllm:num_requests_running{model_name="m"} 3.0\n'
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self.send_response(404)
                    self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_cli_agent_registers_a_vllm_engine_and_deregisters_on_sigterm(router, plain):
    agent = subprocess.Popen(
        [
            harness.PYTHON,
            "-m",
            "connex.agent",
            "--router",
            router.internal,
            "--role",
            "decode",
            "--url",
            plain.url,
            "--model",
            harness.MODEL_NAME,
            "--id",
            "d-cli",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        instance = harness.wait_for(lambda: by_id(router).get("d-cli"), 15, "registration")
        assert instance["url"] == plain.url
        assert instance["role"] == "decode"
        assert instance["model"] == harness.MODEL_NAME
        models = httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == [harness.MODEL_NAME]
        # Heartbeats keep it alive well past the 2 s TTL: ready at every look.
        until = time.monotonic() + 3
        while time.monotonic() < until:
            instance = by_id(router)["d-cli"]
            assert instance["state"] == "ready"
            assert instance["last_heartbeat_ms_ago"] < 2000
            time.sleep(0.2)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=15) == 0
        assert "d-cli" not in by_id(router)
    finally:
        agent.kill()
        agent.wait()


def test_agent_registers_again_when_the_router_forgets_it(router):
    engine = StubEngine()
    agent = Agent(
        router.internal, "prefill", engine.url, "m", ctrl="127.0.0.1:7001", instance_id="p1"
    )
    agent.start()
    try:
        instance = harness.wait_for(lambda: by_id(router).get("p1"), 10, "registration")
        assert instance["ctrl"] == "127.0.0.1:7001"
        assert instance["role"] == "prefill"
        reply = httpx.delete(
            f"{router.internal}/admin/instances/p1",
            headers={"Authorization": f"Bearer {router.admin_token}"},
        )
        assert reply.status_code in (200, 204)
        harness.wait_for(lambda: "p1" in by_id(router), 5, "re-registration")
        assert agent.registrations == 2
    finally:
        agent.stop()
        engine.close()
    assert "p1" not in by_id(router)


def test_agent_waits_for_a_healthy_engine_and_lets_a_sick_one_die(router):
    engine = StubEngine()
    engine.healthy = False
    agent = Agent(router.internal, "decode", engine.url, "m", instance_id="d1").start()
    try:
        # The agent has asked the engine three times, and was told "not healthy".
        harness.wait_for(lambda: engine.health_checks >= 3, 10, "health checks")
        assert "d1" not in by_id(router), "registered an engine that is not healthy"
        engine.healthy = True
        harness.wait_for(lambda: by_id(router).get("d1", {}).get("state") == "ready", 10, "ready")
        # Unhealthy: no heartbeats, so the router's TTL marks it dead ...
        engine.healthy = False
        harness.wait_for(lambda: by_id(router)["d1"]["state"] == "dead", 10, "dead")
        # ... and it comes back when the engine does.
        engine.healthy = True
        harness.wait_for(lambda: by_id(router)["d1"]["state"] == "ready", 10, "alive again")
    finally:
        agent.stop()
        engine.close()


def test_agent_load_stats_come_from_engine_metrics():
    engine = StubEngine()
    try:
        from connex.agent import metrics_load

        assert metrics_load(engine.url) == {"running": 3, "waiting": 0}
    finally:
        engine.close()
