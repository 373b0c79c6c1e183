"""The load stats the agent sends with heartbeats, read from an engine's
Prometheus metrics as vLLM exposes them (the router's load_aware and
cache_aware policies steer by them)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from connex.agent import engine_load, metrics_load

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_requests_running_total_bogus NaN
"""


@pytest.fixture
def engine() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = VLLM_METRICS.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_metrics_load_sums_requests_and_takes_the_fullest_kv_cache(engine: str) -> None:
    assert metrics_load(engine) == {"running": 5, "waiting": 7, "kv_usage": 0.75}


def test_engine_load_never_reports_fewer_running_than_the_connector_has(engine: str) -> None:
    assert engine_load(engine, inflight=9)["running"] == 9
    assert engine_load(engine, inflight=1)["running"] == 5


def test_engine_load_without_metrics_reports_the_connectors_count() -> None:
    # Nothing listens on port 9 of loopback.
    assert engine_load("http://127.0.0.1:9", inflight=4, timeout_s=0.5) == {"running": 4}
