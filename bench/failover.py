"""bench/run router_failover: a background response outliving its router replica.

One Redis (Debian's redis-server), one mock prefill and two mock decoders (20
ms a token), router replicas on the shared response store with
`--response-lease-ms LEASE_MS`, the engines static to every replica.

Gap: ROUNDS times, a background response of 200 tokens starts on replica A; a
client streams it from A; after its 20th event A is SIGKILLed, and the client
reattaches to replica B with `starting_after` (the last sequence number it
had). The gap is the longest pause between two events the client saw from its
last one on A on (B sends at once what the store has, then the events of the
generation it took over); every event must come exactly once and the
response must complete. A
fresh A is started for the next round. Printed: p50 and max, then
`router_failover_gap_p50_ms=<x>` beside `response_lease_ms=<lease>` (the
takeover waits for the lease to expire, then for a look, an eighth of it).

CPU: the same streamed background Responses load (REQUESTS of 32 tokens,
CONCURRENCY at once) through a replica on the memory store and one on the
Redis store, taking turns for 3 rounds: the router CPU per request of each
(utime + stime, /proc), and `redis_vs_memory_router_cpu_ratio=<x>`; the bytes
Redis holds per background response token once they are done; then the same
load not in the background (the store then holds each finished response only).

Usage: python3 bench/failover.py BIN_DIR [ROUNDS] [LEASE_MS]
"""

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from procs import Procs

TOKENS = 200
KILL_AFTER = 20
DECODE_US = "20000"
REQUESTS = 300
CONCURRENCY = 16
CPU_TOKENS = 32
CPU_ROUNDS = 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.load(reply)


def post(url, path, body):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    reply = conn.getresponse()
    answer = reply.read()
    conn.close()
    return reply.status, answer


def events(url, path, method="GET", body=None):
    """Yields (arrival time, event) of an SSE stream."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    data = json.dumps(body) if body is not None else None
    conn.request(method, path, data, {"content-type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"{path}: {reply.status} {reply.read()[:200]!r}")
    try:
        while True:
            line = reply.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                yield time.monotonic(), json.loads(line[6:])
    finally:
        conn.close()


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    bin_dir = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    lease_ms = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    logs = tempfile.mkdtemp(prefix="connex-failover-")
    procs = Procs(logs)
    redis_port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", redis_port), 1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        engine = [f"{bin_dir}/connex-mock-engine", "--model", "mock"]
        _, prefill = procs.start("prefill", engine + ["--role", "prefill"])
        ctrl = get_json(f"{prefill}/mock/stats")["ctrl"]
        decoders = [
            procs.start(
                f"d{n}",
                engine
                + ["--role", "decode", "--enable-scale-out"]
                + ["--decode-us-per-token", DECODE_US],
            )[1]
            for n in range(2)
        ]
        redis_url = f"redis://127.0.0.1:{redis_port}"

        def replica(name, store=True):
            argv = [f"{bin_dir}/connex-router", "serve", "--listen", "127.0.0.1:0"]
            argv += ["--internal-listen", "127.0.0.1:0", "--static-model", "mock"]
            argv += ["--prefill", f"{prefill},{ctrl}", "--decode-policy", "round_robin"]
            for decoder in decoders:
                argv += ["--decode", decoder]
            if store:
                argv += ["--response-store", redis_url, "--response-lease-ms", str(lease_ms)]
            proc, url = procs.start(name, argv)
            deadline = time.monotonic() + 10
            while get_json(f"{url}/ready").get("ready") is not True:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not ready")
                time.sleep(0.05)
            return proc, url

        _, b = replica("b")
        gaps = []
        for n in range(rounds):
            a_proc, a = replica(f"a{n}")
            body = {
                "model": "mock",
                "input": f"failover round {n}",
                "background": True,
                "stream": True,
                "max_output_tokens": TOKENS,
            }
            seen = []
            last_time = None
            for at, event in events(a, "/v1/responses", "POST", body):
                seen.append(event)
                last_time = at
                if len(seen) >= KILL_AFTER:
                    break
            a_proc.kill()
            rid = seen[0]["response"]["id"]
            after = seen[-1]["sequence_number"]
            times = [last_time]
            for at, event in events(b, f"/v1/responses/{rid}?stream=true&starting_after={after}"):
                times.append(at)
                seen.append(event)
            numbers = [e["sequence_number"] for e in seen]
            assert numbers == list(range(len(seen))), f"round {n}: events not each once"
            assert seen[-1]["type"] == "response.completed", seen[-1]
            usage = seen[-1]["response"]["usage"]["output_tokens"]
            assert usage == TOKENS, usage
            # The longest pause the client saw from its last event on A on:
            # B first sends what the store had, then the takeover's events.
            gaps.append(
                max(later - earlier for earlier, later in zip(times, times[1:], strict=False))
                * 1000
            )
            print(f"  round {n + 1}/{rounds}: gap {gaps[-1]:.0f} ms", file=sys.stderr)

        # CPU per request: memory store vs Redis store, same load, turns.
        mem_proc, mem = replica("memory", store=False)
        red_proc, red = replica("redis")
        redis_cli = ["redis-cli", "-p", str(redis_port)]
        subprocess.run(redis_cli + ["FLUSHALL"], check=True, stdout=subprocess.DEVNULL)

        def used_memory():
            info = subprocess.run(
                redis_cli + ["INFO", "memory"], check=True, capture_output=True, text=True
            ).stdout
            line = next(x for x in info.splitlines() if x.startswith("used_memory:"))
            return int(line.split(":")[1])

        used_before = used_memory()
        targets = (("memory", mem_proc, mem), ("redis", red_proc, red))
        cpu = {(kind, name): [] for kind in ("background", "plain") for name in ("memory", "redis")}
        for background in (True, False):
            kind = "background" if background else "plain"
            for _ in range(CPU_ROUNDS):
                for name, proc, url in targets:
                    before = cpu_s(proc.pid)
                    load(url, background)
                    cpu[kind, name].append((cpu_s(proc.pid) - before) * 1000 / REQUESTS)
            if background:
                held = used_memory() - used_before
        tokens = CPU_ROUNDS * REQUESTS * CPU_TOKENS
        med = {key: statistics.median(values) for key, values in cpu.items()}
        mem_ms, red_ms = med["background", "memory"], med["background", "redis"]
        plain_ratio = med["plain", "redis"] / med["plain", "memory"]
        print(
            f"router_failover: {rounds} kills of the generating replica, lease {lease_ms} ms, "
            f"{TOKENS}-token background responses at {int(DECODE_US) // 1000} ms a token"
        )
        print(
            f"  reattach gap p50 {statistics.median(gaps):.0f} ms, max {max(gaps):.0f} ms "
            f"(target p50 <= lease + 200 ms)"
        )
        print(
            f"  streamed background Responses ({REQUESTS} x {CPU_TOKENS} tokens, concurrency "
            f"{CONCURRENCY}, median of {CPU_ROUNDS}): router cpu {mem_ms:.3f} ms/request on "
            f"the memory store, {red_ms:.3f} on Redis (events, checkpoints, leases)"
        )
        print(
            f"  the same not background (stored only): {med['plain', 'memory']:.3f} vs "
            f"{med['plain', 'redis']:.3f} ms/request, ratio {plain_ratio:.3f}"
        )
        print(
            f"  Redis bytes per background response token (events, checkpoint, stored "
            f"response): {held / tokens:.0f}"
        )
        print(f"redis_vs_memory_router_cpu_ratio={red_ms / mem_ms:.3f}")
        print(f"response_lease_ms={lease_ms}")
        print(f"router_failover_gap_p50_ms={statistics.median(gaps):.0f}")
    finally:
        procs.stop()
        redis.kill()
        redis.wait()


def load(url, background):
    """REQUESTS streamed responses (`background` or not), CONCURRENCY at once."""
    lock = threading.Lock()
    todo = list(range(REQUESTS))
    failures = []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                n = todo.pop()
            body = {
                "model": "mock",
                "input": f"load {n}",
                "background": background,
                "stream": True,
                "max_output_tokens": CPU_TOKENS,
            }
            last = None
            for _, event in events(url, "/v1/responses", "POST", body):
                last = event
            if not last or last["type"] != "response.completed":
                failures.append(last)

    threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]


if __name__ == "__main__":
    main()
