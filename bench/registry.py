"""`bench/run registry`: membership at cluster scale, on loopback.

1. Propagation through etcd: two router replicas A and B on one real etcd. For
   each of REGISTRATIONS instances (role both, a model of its own, pointing at a
   mock engine), the time from the registration call on A to the first completion
   for that model answered 200 by B ("routable on B"), polled back to back on one
   keep-alive connection. p50 / p99.
2. Routing overhead with 1,000 registered instances vs 10: two routers on the
   same etcd under different prefixes, one with 10 instances, one with 1,000
   (half prefill, half decode, all serving model `mock`, all pointing at the same
   prefill and decode mocks), loaded alternately with the same closed-loop
   streamed completions (connex-loadgen). Median of the rounds.

The last line is `propagation_p99_ms=<x>`.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from procs import Procs

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "target" / "release"
OUT = ROOT / "bench" / "out"
TOKEN = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_etcd(procs: Procs, data: Path) -> str:
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    log = open(OUT / "registry-etcd.log", "w")  # noqa: SIM115
    procs.procs.append(
        subprocess.Popen(
            [
                "etcd",
                "--name",
                "bench",
                "--data-dir",
                str(data),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"bench={peer}",
            ],
            stdout=log,
            stderr=log,
        )
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if b'"health":"true"' in request(client, "GET", "/health")[1]:
                return client
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit("etcd did not start; see bench/out/registry-etcd.log")


class Conn:
    """One keep-alive HTTP/1.1 connection to a base URL."""

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        self.conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        reply = self.conn.getresponse()
        return reply.status, reply.read()


def request(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    conn = Conn(base)
    try:
        return conn.call(method, path, body)
    finally:
        conn.conn.close()


def router(procs: Procs, name: str, etcd: str, prefix: str) -> tuple[str, str]:
    """A router replica: (client URL, internal URL)."""
    _, url = procs.start(name, [
        str(BIN / "connex-router"), "serve", "--listen", "127.0.0.1:0",
        "--internal-listen", "127.0.0.1:0",
        "--admin-token", TOKEN, "--etcd", etcd, "--etcd-prefix", prefix,
        # No heartbeats in the bench: leases outlive it.
        "--heartbeat-ttl", "1h",
    ])  # fmt: skip
    return url, procs.internal


def register(conn: Conn, body: dict) -> None:
    status, reply = conn.call("POST", "/admin/instances", body)
    if status != 201:
        raise SystemExit(f"registration failed: {status} {reply!r}")


def engine_ctrl(url: str) -> str:
    """A mock engine's holder control address (a prefill registers it: the
    router uses a prefill's hold only when its answer names that holder)."""
    with urllib.request.urlopen(f"{url}/mock/stats") as reply:
        return json.load(reply)["ctrl"]


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * p + 0.999999) - 1)]


def propagation(procs: Procs, etcd: str, count: int) -> list[float]:
    _, a = router(procs, "a", etcd, "/propagation")
    b, _ = router(procs, "b", etcd, "/propagation")
    mock = str(BIN / "connex-mock-engine")
    _, both = procs.start("both", [mock, "--role", "both", "--model", "m"])
    both_ctrl = engine_ctrl(both)
    on_a, on_b = Conn(a), Conn(b)
    times = []
    for i in range(count):
        model = f"bench-{i}"
        probe = {"model": model, "prompt": "hi", "max_tokens": 1}
        started = time.perf_counter()
        register(
            on_a, {"id": f"p{i}", "role": "both", "url": both, "model": model, "ctrl": both_ctrl}
        )
        deadline = started + 10
        while True:
            status, _ = on_b.call("POST", "/v1/completions", probe)
            if status == 200:
                break
            if time.perf_counter() > deadline:
                raise SystemExit(f"{model} not routable on B after 10 s (last status {status})")
        times.append((time.perf_counter() - started) * 1e3)
    return times


def overhead(procs: Procs, etcd: str, requests: int, concurrency: int, rounds: int) -> dict:
    _, prefill = procs.start("prefill", [str(BIN / "connex-mock-engine"), "--role", "prefill"])
    _, decode = procs.start("decode", [str(BIN / "connex-mock-engine"), "--role", "decode"])
    prefill_ctrl = engine_ctrl(prefill)
    targets = {}
    for n in (10, 1000):
        url, internal = router(procs, f"r{n}", etcd, f"/overhead-{n}")
        conn = Conn(internal)
        for i in range(n):
            role, engine = ("prefill", prefill) if i % 2 == 0 else ("decode", decode)
            ctrl = prefill_ctrl if role == "prefill" else None
            register(
                conn, {"id": f"i{i:04}", "role": role, "url": engine, "model": "mock", "ctrl": ctrl}
            )
        _, ready = request(url, "GET", "/ready")
        if json.loads(ready)["instances"] != n:
            raise SystemExit(f"router r{n} does not list {n} instances: {ready!r}")
        targets[n] = url

    def load(n: int, count: int) -> dict:
        done = subprocess.run(
            [str(BIN / "connex-loadgen"), "--url", f"{targets[n]}/v1/completions",
             "--label", str(n), "--stream", "--requests", str(count),
             "--concurrency", str(concurrency), "--max-tokens", "32", "--timeout-s", "120"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        run = json.loads(done.stdout)
        if run["errors"] or run["timed_out"]:
            raise SystemExit(f"{n} instances: errors in the load run: {run}")
        return run

    for n in targets:
        load(n, 200)  # warm-up: connections, caches
    runs: dict[int, list[dict]] = {10: [], 1000: []}
    for r in range(rounds):
        for n in targets:
            runs[n].append(load(n, requests))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return {
        n: {k: statistics.median(run[k] for run in rs) for k in ("req_s", "p50_ms", "p99_ms")}
        for n, rs in runs.items()
    }


def main() -> None:
    # A SIGTERM ends the run through the `finally` below, which stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    count, requests, concurrency, rounds = (int(a) for a in sys.argv[1:5])
    OUT.mkdir(parents=True, exist_ok=True)
    if not shutil.which("etcd"):
        raise SystemExit("etcd is missing: apt-get install etcd-server")
    procs = Procs(str(OUT), log_prefix="registry-")
    data = Path(tempfile.mkdtemp(prefix="connex-bench-etcd-"))
    try:
        etcd = start_etcd(procs, data)
        times = propagation(procs, etcd, count)
        medians = overhead(procs, etcd, requests, concurrency, rounds)
    finally:
        procs.stop()
        shutil.rmtree(data, ignore_errors=True)
    with open(OUT / "registry.json", "w") as f:
        json.dump({"propagation_ms": times, "overhead": medians}, f)
    p50, p99 = pct(times, 0.50), pct(times, 0.99)
    print(f"registry: propagation through etcd (register on A -> routable on B), n={count}")
    print(f"  p50 {p50:.2f} ms   p99 {p99:.2f} ms   max {max(times):.2f} ms")
    print(
        f"routing overhead: {requests} streamed completions x 32 tokens, "
        f"concurrency {concurrency}, median of {rounds} rounds"
    )
    for n, m in medians.items():
        print(
            f"  {n:>4} instances {m['req_s']:8.1f} req/s   p50 {m['p50_ms']:7.2f} ms"
            f"   p99 {m['p99_ms']:7.2f} ms"
        )
    print(f"throughput_1000_vs_10_ratio={medians[1000]['req_s'] / medians[10]['req_s']:.3f}")
    print(f"p99_1000_vs_10_ratio={medians[1000]['p99_ms'] / medians[10]['p99_ms']:.3f}")
    print(f"propagation_p50_ms={p50:.2f}")
    print(f"propagation_p99_ms={p99:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("CONNEX_LOG", "warn")
    main()
