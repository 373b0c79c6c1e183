"""bench/run tenants: what a noisy tenant costs a quiet one, fair queueing vs FIFO.

One router (--max-concurrent-requests SLOTS), one mock prefill and one mock
decoder (TOKENS tokens of DECODE_US each a request), two keys:
  noisy  NOISY closed-loop clients: about ten times its fair share (weight 1
         of 4) of what the slots serve, so requests always wait for a slot;
  quiet  one request every QUIET_EVERY_S (open loop, well under its share,
         weight 3), QUIET requests a round, its time to first token measured.
Two set-ups take turns for ROUNDS rounds:
  fifo   both keys in one tenant: one queue, first come first served (what
         admission was before tenants: the same slots, one line);
  fair   two tenants, weights 3:1: per-tenant queues, weighted fair share.
Prints the quiet tenant's TTFT p50/p99 per set-up (medians over rounds) and
last `quiet_tenant_p99_ttft_ratio_fair_vs_fifo=<x>` (target <= 0.3).

Usage: python3 bench/tenants.py BIN_DIR [ROUNDS]
"""

import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bounds import Cluster  # noqa: E402
from procs import Procs  # noqa: E402

SLOTS = 4
DECODE_US = 5000
TOKENS = 8
NOISY = 32
QUIET = 120
QUIET_EVERY_S = 0.1
NOISY_KEY = "sk-bench-noisy-01"
QUIET_KEY = "sk-bench-quiet-01"

TENANTS = {
    "fifo": f'[[tenant]]\nname = "shared"\nkeys = ["{NOISY_KEY}", "{QUIET_KEY}"]\n',
    "fair": (
        f'[[tenant]]\nname = "noisy"\nkeys = ["{NOISY_KEY}"]\nweight = 1\n\n'
        f'[[tenant]]\nname = "quiet"\nkeys = ["{QUIET_KEY}"]\nweight = 3\n'
    ),
}


class TenantCluster(Cluster):
    """A router with the tenants file `tenants`, a prefill and one decoder."""

    def __init__(self, bin_dir, logs, name, tenants):
        Procs.__init__(self, logs)
        try:
            _, self.router = self.start(
                f"{name}-router",
                [f"{bin_dir}/connex-router", "serve", "--listen", "127.0.0.1:0"]
                + ["--internal-listen", "127.0.0.1:0", "--admin-token", "bench"]
                + ["--tenants-file", tenants, "--max-concurrent-requests", str(SLOTS)],
            )
            engine = [f"{bin_dir}/connex-mock-engine", "--model", "mock", "--router", self.internal]
            self.start(f"{name}-prefill", engine + ["--role", "prefill"])
            decoder = engine + ["--role", "decode", "--decode-us-per-token", str(DECODE_US)]
            self.start(f"{name}-decode", decoder)
            self.wait_ready(2)
        except BaseException:
            self.stop()
            raise


def ttft(router, key, i):
    """Seconds to the first streamed token of one request (None if it failed)."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "mock", "prompt": f"bench {i}", "max_tokens": TOKENS, "stream": True}
    started = time.monotonic()
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"content-type": "application/json", "authorization": f"Bearer {key}"},
        )
        reply = conn.getresponse()
        if reply.status != 200:
            reply.read()
            return None
        first = None
        for line in reply:
            if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
                first = time.monotonic() - started
        return first
    finally:
        conn.close()


def run(cluster):
    """The quiet tenant's TTFTs while the noisy one saturates the slots."""
    stop = threading.Event()

    def noisy(n):
        i = 0
        while not stop.is_set():
            ttft(cluster.router, NOISY_KEY, f"noisy {n} {i}")
            i += 1

    workers = [threading.Thread(target=noisy, args=(n,)) for n in range(NOISY)]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # the queue fills
    results, threads = [], []
    lock = threading.Lock()

    def quiet(i):
        t = ttft(cluster.router, QUIET_KEY, f"quiet {i}")
        with lock:
            results.append(t)

    for i in range(QUIET):
        thread = threading.Thread(target=quiet, args=(i,))
        thread.start()
        threads.append(thread)
        time.sleep(QUIET_EVERY_S)
    for thread in threads:
        thread.join()
    stop.set()
    for worker in workers:
        worker.join()
    served = [t for t in results if t is not None]
    if len(served) < QUIET:
        raise RuntimeError(f"{QUIET - len(served)} quiet requests failed")
    served.sort()
    return served[len(served) // 2], served[min(len(served) - 1, int(len(served) * 0.99))]


def main():
    bin_dir = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    logs = tempfile.mkdtemp(prefix="connex-bench-tenants-")
    p50s = {mode: [] for mode in TENANTS}
    p99s = {mode: [] for mode in TENANTS}
    for r in range(rounds):
        for mode, text in TENANTS.items():
            path = os.path.join(logs, f"{mode}.toml")
            with open(path, "w") as f:
                f.write(text)
            cluster = TenantCluster(bin_dir, logs, f"{mode}{r}", path)
            try:
                p50, p99 = run(cluster)
            finally:
                cluster.stop()
            p50s[mode].append(p50)
            p99s[mode].append(p99)
            print(f"round {r} {mode}: quiet ttft p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
    for mode in TENANTS:
        p50, p99 = statistics.median(p50s[mode]), statistics.median(p99s[mode])
        print(f"{mode}_quiet_ttft_p50_ms={p50 * 1000:.1f}")
        print(f"{mode}_quiet_ttft_p99_ms={p99 * 1000:.1f}")
    ratio = statistics.median(p99s["fair"]) / statistics.median(p99s["fifo"])
    print(f"quiet_tenant_p99_ttft_ratio_fair_vs_fifo={ratio:.3f}")


if __name__ == "__main__":
    main()
