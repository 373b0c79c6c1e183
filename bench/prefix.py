"""`bench/run prefix`: prefix-aware routing on a shared-prefix workload.

SYSTEMS system prompts of PROMPT_TOKENS tokens (the mock tokenizes bytes), each
followed by USERS distinct user turns, arriving interleaved (every system
prompt's first user in a shuffled order, then every second user, ...) from CONCURRENCY closed-loop
clients, as streamed completions with text prompts (Connex tokenizes them
through an engine's /tokenize, its default, or, in the target so named, itself
with the mock model's tokenizer.json, `--tokenizer`). Four mock prefills with prefix caches
(`--prefix-cache-blocks`, 100 us per uncached token, block size 16) sized to
hold a third of the system prompts each, two mock decoders; each policy gets a
fresh cluster (cold caches) and the policies take turns for ROUNDS rounds:
Connex `--prefill-policy round_robin` vs `cache_aware` fed by the mocks' KV
events vs `cache_aware` with events off (`--kv-events false`: the router
indexes the prompts it sent) vs vllm-router's approximate `cache_aware`
(`--vllm-pd-disaggregation --prefill-policy cache_aware`, its defaults) and
its precise `kv_aware` fed by the same mocks' KV events over ZMQ
(`--kv-events-publish` on each mock prefill, `--pd-kv-events URL=ENDPOINT`,
block size 16 on both sides), when .venv has vllm-router. Reported per policy
(median over rounds): TTFT p50 / p99, prompt tokens the prefills computed, and
the router's mean /tokenize time.

The last lines are `prefix_ttft_p50_ratio_vs_round_robin=<x>` and, last,
`prefix_ttft_p50_ratio_vs_vllm_router_kv_aware=<y>`.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from procs import Procs

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TOKEN = "bench"
VLLM_ROUTER = ROOT / ".venv" / "bin" / "vllm-router"
BLOCK = 16
PREFILLS = 4


def get(url: str) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as reply:
        return json.loads(reply.read())


def metrics(internal: str) -> str:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    req = urllib.request.Request(f"{internal}/metrics", headers=auth)
    with urllib.request.urlopen(req, timeout=10) as reply:
        return reply.read().decode()


def sample(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == name
    )


def tokenizer_file(bin_dir: Path) -> Path:
    """The mock model's tokenizer.json (the mock writes it), for --tokenizer."""
    path = OUT / "mock-tokenizer.json"
    subprocess.run(
        [str(bin_dir / "connex-mock-engine"), "--write-tokenizer", str(path)], check=True
    )
    return path


def cluster(
    procs: Procs,
    bin_dir: Path,
    policy: str,
    cache_blocks: int,
    events: bool,
    tokenizer: Path | None,
) -> tuple[str, str, list[str]]:
    tokenizer_args = ["--tokenizer", f"mock={tokenizer}"] if tokenizer else []
    _, url = procs.start(
        f"router-{policy}-{events}",
        [
            str(bin_dir / "connex-router"),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--internal-listen",
            "127.0.0.1:0",
            "--admin-token",
            TOKEN,
            "--prefill-policy",
            policy,
            "--heartbeat-ttl",
            "3s",
            *tokenizer_args,
        ],
    )
    internal = procs.internal
    prefills = []
    for i in range(PREFILLS):
        _, engine = procs.start(
            f"prefill{i}-{policy}-{events}",
            [
                str(bin_dir / "connex-mock-engine"),
                "--role",
                "prefill",
                "--model",
                "mock",
                "--router",
                internal,
                "--prefix-cache-blocks",
                str(cache_blocks),
                "--block-size",
                str(BLOCK),
                "--prefill-us-per-token",
                "100",
                "--kv-events",
                str(events).lower(),
            ],
        )
        prefills.append(engine)
    for i in range(2):
        procs.start(
            f"decode{i}-{policy}-{events}",
            [
                str(bin_dir / "connex-mock-engine"),
                "--role",
                "decode",
                "--model",
                "mock",
                "--router",
                internal,
            ],
        )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ready = [i for i in get(f"{internal}/admin/instances")["data"] if i["state"] == "ready"]
        if len(ready) == PREFILLS + 2:
            return url, internal, prefills
        time.sleep(0.1)
    raise SystemExit("the cluster did not become ready")


def ttft(base: str, prompt: str) -> float:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": "mock", "prompt": prompt, "max_tokens": 4, "stream": True})
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise SystemExit(f"request failed: HTTP {reply.status} {reply.read()[:200]!r}")
    first = None
    for line in reply:
        if line.startswith(b"data: {") and first is None:
            first = time.perf_counter() - started
    conn.close()
    assert first is not None, "no token streamed"
    return first


def workload(systems: int, users: int, prompt_tokens: int) -> list[str]:
    # Distinct system prompts of prompt_tokens bytes each.
    heads = []
    for s in range(systems):
        unit = f"[system {s:02d}] You are assistant number {s:02d}; follow rule set {s:02d}. "
        heads.append((unit * (prompt_tokens // len(unit) + 1))[:prompt_tokens])
    # Every system prompt's u-th user arrives before any (u+1)-th, in a
    # shuffled order (fixed seed): a fixed cycle would line up with round
    # robin's and hand it affinity by accident.
    shuffle = random.Random(0).shuffle
    order = []
    for u in range(users):
        turn = list(range(systems))
        shuffle(turn)
        order.extend((s, u) for s in turn)
    return [f"{heads[s]}\nUser {u}: question {u} for {s}?" for s, u in order]


def vllm_router_cluster(
    procs: Procs, bin_dir: Path, policy: str, cache_blocks: int
) -> tuple[str, list[str]]:
    """The same mocks (not registering) behind vllm-router in P/D mode; for
    `kv_aware`, each prefill publishes its KV events on a ZMQ endpoint that
    vllm-router subscribes to."""
    engines: dict[str, list[str]] = {}
    events: dict[str, str] = {}
    for role, count in (("prefill", PREFILLS), ("decode", 2)):
        engines[role] = []
        for i in range(count):
            publish = []
            if policy == "kv_aware" and role == "prefill":
                publish = ["--kv-events-publish", f"tcp://127.0.0.1:{free_port()}"]
            _, url = procs.start(
                f"{role}{i}-vllm-router-{policy}",
                [
                    str(bin_dir / "connex-mock-engine"),
                    "--role",
                    role,
                    "--model",
                    "mock",
                    "--prefix-cache-blocks",
                    str(cache_blocks),
                    "--block-size",
                    str(BLOCK),
                    "--prefill-us-per-token",
                    "100",
                    *publish,
                ],
            )
            engines[role].append(url)
            if publish:
                events[url] = publish[1]
    port = free_port()
    args = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    args += ["--vllm-pd-disaggregation", "--log-level", "warning"]
    for url in engines["prefill"]:
        args += ["--prefill", url]
    for url in engines["decode"]:
        args += ["--decode", url]
    args += ["--prefill-policy", policy, "--decode-policy", "round_robin"]
    for url, endpoint in events.items():
        args += ["--pd-kv-events", f"{url}={endpoint}"]
    log = open(OUT / f"prefix-vllm-router-{policy}.log", "w")  # noqa: SIM115
    procs.procs.append(subprocess.Popen(args, stdout=log, stderr=log, text=True))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return url, engines["prefill"]
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("vllm-router did not start; see bench/out/prefix-vllm-router-*.log")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(bin_dir: Path, target: str, prompts: list[str], concurrency: int, blocks: int) -> dict:
    procs = Procs(str(OUT), log_prefix="prefix-")
    policy, _, events = target.partition(" ")
    try:
        if policy.startswith("vllm_router:"):
            url, prefills = vllm_router_cluster(procs, bin_dir, policy.split(":", 1)[1], blocks)
            internal = ""
        else:
            # Connex asks an engine's /tokenize (its default) unless the
            # target runs the model's tokenizer in the router (--tokenizer).
            tokenizer = tokenizer_file(bin_dir) if events == "(router tokenizer)" else None
            on = events != "(events off)"
            url, internal, prefills = cluster(procs, bin_dir, policy, blocks, on, tokenizer)
        results: list[float] = []
        lock = threading.Lock()
        queue = list(reversed(prompts))

        def client() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop()
                took = ttft(url, prompt)
                with lock:
                    results.append(took)

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        computed = sum(
            r["computed_prompt_tokens"]
            for p in prefills
            for r in get(f"{p}/mock/stats")["requests"]
        )
        text = metrics(internal) if internal else ""
        count = sample(text, "connex_tokenize_duration_seconds_count")
        tokenize_ms = 1000 * sample(text, "connex_tokenize_duration_seconds_sum") / max(count, 1)
        results.sort()
        return {
            "p50_ms": 1000 * statistics.median(results),
            "p99_ms": 1000 * results[min(len(results) - 1, int(len(results) * 0.99))],
            "computed_tokens": computed,
            "tokenize_ms": tokenize_ms,
        }
    finally:
        procs.stop()


def main() -> None:
    bin_dir = Path(sys.argv[1])
    rounds, systems, users, prompt_tokens, concurrency = (int(a) for a in sys.argv[2:7])
    OUT.mkdir(parents=True, exist_ok=True)
    prompts = workload(systems, users, prompt_tokens)
    # Each prefill's cache holds a third of the system prompts (plus the turns).
    blocks = max(1, systems // 3) * (prompt_tokens // BLOCK + 2)
    print(
        f"{len(prompts)} requests: {systems} system prompts of {prompt_tokens} tokens"
        f" x {users} users, {concurrency} clients; {PREFILLS} prefills with"
        f" {blocks}-block caches, 100 us/uncached token"
    )
    policies = [
        "round_robin",
        "cache_aware",
        "cache_aware (events off)",
        "cache_aware (router tokenizer)",
    ]
    if VLLM_ROUTER.exists():
        policies += ["vllm_router:cache_aware", "vllm_router:kv_aware"]
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for _ in range(rounds):
        for policy in policies:
            runs[policy].append(run(bin_dir, policy, prompts, concurrency, blocks))
    summary = {}
    for policy in policies:
        med = {k: statistics.median(r[k] for r in runs[policy]) for k in runs[policy][0]}
        summary[policy] = med
        print(
            f"{policy:30} ttft_p50_ms={med['p50_ms']:.1f} ttft_p99_ms={med['p99_ms']:.1f}"
            f" prefill_tokens_computed={med['computed_tokens']:.0f}"
            f" tokenize_ms={med['tokenize_ms']:.2f}"
        )
    base = summary["round_robin"]["p50_ms"]
    if "vllm_router:cache_aware" in summary:
        peer = summary["cache_aware"]["p50_ms"] / summary["vllm_router:cache_aware"]["p50_ms"]
        print(f"prefix_ttft_p50_ratio_vs_vllm_router_cache_aware={peer:.3f}")
    off = summary["cache_aware (events off)"]["p50_ms"] / base
    print(f"prefix_ttft_p50_ratio_events_off_vs_round_robin={off:.3f}")
    ratio = summary["cache_aware"]["p50_ms"] / base
    print(f"prefix_ttft_p50_ratio_vs_round_robin={ratio:.3f}")
    if "vllm_router:kv_aware" in summary:
        peer = summary["cache_aware"]["p50_ms"] / summary["vllm_router:kv_aware"]["p50_ms"]
        print(f"prefix_ttft_p50_ratio_vs_vllm_router_kv_aware={peer:.3f}")


if __name__ == "__main__":
    main()
