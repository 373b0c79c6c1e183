"""bench/run scale: many concurrent streams through one router.

For each count of STREAMS (default 1000 5000 10000), that many streamed
completions are opened at once (connex-loadgen, one request per connection)
through one connex-router to one prefill and 4 slow mock decoders (200 ms per
token, 32 tokens: every stream is in flight for ~6 s at the same time). While
they run, the router's resident memory is sampled every 100 ms; its CPU time is
read from /proc before and after. Each count gets a fresh cluster. Reported per
count: failures (must be 0), the router's peak RSS above its idle RSS (a fresh
router's) per in-flight stream, and router CPU per token relayed. The last
line is `rss_per_stream_kib=<x>` at the largest count.

Over HTTP/1.1 every stream needs two sockets in the router (client and
decoder), beside its pooled idle connections: the count that fits is bounded
by the open-file limit. The script raises its own limit (which the router, the
mocks and the load generator inherit) to what the largest count needs, the
hard limit included where it may (root with CAP_SYS_RESOURCE). A count whose
HTTP/1.1 sockets do not fit runs with its clients on HTTP/2 instead (the
router with `--http2`, 256 streams per client connection: one socket per
stream in the router, the decoder's), and the line says so (`clients=http2`);
`SCALE_HTTP2=1` puts every count on HTTP/2. A count that does not fit even so
is lowered to the largest that does (`asked=`): a run never ends in EMFILE
failures.

Usage: python3 bench/scale.py BIN_DIR [STREAMS...]
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

TOKENS = 32
DECODE_US = "200000"
DECODERS = 4
H2_STREAMS = 256
# Every count on HTTP/2 (else only those whose HTTP/1.1 sockets do not fit).
ALL_HTTP2 = os.environ.get("SCALE_HTTP2") == "1"


def start(name, argv, logs, procs):
    log = open(os.path.join(logs, f"scale-{name}.log"), "w")
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "CONNEX_LOG": "warn"},
    )
    procs.append(proc)
    deadline = time.monotonic() + 20
    internal = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "internal API on " in line:
            internal = line.split("internal API on ", 1)[1].strip()
        if "listening on " in line:
            return proc, line.split("listening on ", 1)[1].strip(), internal
    raise RuntimeError(f"{name} did not start; see {log.name}")


def wait_ready(internal, count):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        req = urllib.request.Request(
            f"{internal}/admin/instances", headers={"authorization": "Bearer bench"}
        )
        with urllib.request.urlopen(req) as reply:
            if sum(i["state"] == "ready" for i in json.load(reply)["data"]) >= count:
                return
        time.sleep(0.05)
    raise RuntimeError("engines did not register")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# Open files the router needs beyond two per stream: up to 1,024 pooled idle
# connections to the prefill (reqwest's pool, `pool_max_idle_per_host`), its
# listeners, epoll and the like.
FD_RESERVE = 1024 + 256


def raise_open_files(streams):
    """Raises RLIMIT_NOFILE for this process and its children so that
    `streams` fit; returns the limit in force."""
    need = sockets(streams, ALL_HTTP2)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
            return need
        except (ValueError, OSError) as err:
            print(
                f"scale: cannot raise the open-file hard limit {hard} to {need} "
                f"({err}; raising it needs CAP_SYS_RESOURCE)",
                flush=True,
            )
    limit = hard if hard == resource.RLIM_INFINITY else min(hard, max(need, soft))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    return limit


def sockets(streams, http2):
    """Open files the router needs for `streams`: a decoder connection each,
    and a client connection each (HTTP/1.1) or per H2_STREAMS (HTTP/2)."""
    clients = -(-streams // H2_STREAMS) if http2 else streams
    return streams + clients + FD_RESERVE


def fitting(streams, limit, http2):
    """The largest count up to `streams` whose sockets fit in `limit` open files
    (lowered in steps of 100)."""
    if limit == resource.RLIM_INFINITY or sockets(streams, http2) <= limit:
        return streams
    fit = streams
    while fit > 0 and sockets(fit, http2) > limit:
        fit -= 100
    return max(0, fit)


def run(bin_dir, router, pid, streams, asked, http2):
    idle = rss_kib(pid)
    cpu_before = cpu_s(pid)
    peak = [idle]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out = subprocess.run(
            [
                f"{bin_dir}/connex-loadgen",
                "--url",
                f"{router}/v1/completions",
                "--label",
                f"scale{streams}",
                "--stream",
                "--requests",
                str(streams),
                "--concurrency",
                str(streams),
                "--max-tokens",
                str(TOKENS),
                "--timeout-s",
                "180",
                "--http2-streams-per-connection",
                str(H2_STREAMS if http2 else 0),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        done.set()
        sampler.join()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The load generator's first errors, when there were any.
    sys.stdout.write(out.stderr)
    cpu = cpu_s(pid) - cpu_before
    failures = result["errors"] + (streams - result["ok"] - result["errors"])
    per_stream = (peak[0] - idle) / streams
    print(
        f"scale streams={streams}{'' if asked == streams else f' asked={asked}'} "
        f"clients={'http2' if http2 else 'http1'} "
        f"ok={result['ok']} failures={failures} "
        f"timed_out={result['timed_out']} "
        f"seconds={result['seconds']:.1f} router_idle_rss_mib={idle / 1024:.1f} "
        f"router_peak_rss_mib={peak[0] / 1024:.1f} rss_per_stream_kib={per_stream:.1f} "
        f"router_cpu_ms_per_token={cpu * 1e3 / (streams * TOKENS):.4f}",
        flush=True,
    )
    return failures, per_stream


def cluster(bin_dir, logs, per_peer, procs, http2):
    """A fresh router, one prefill and the decoders; the router's process and
    its client URL."""
    router_proc, router, internal = start(
        "router",
        [
            f"{bin_dir}/connex-router",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--internal-listen",
            "127.0.0.1:0",
            "--admin-token",
            "bench",
        ]
        + (["--http2", "--http2-max-streams", str(H2_STREAMS)] if http2 else []),
        logs,
        procs,
    )
    engine = [f"{bin_dir}/connex-mock-engine", "--model", "mock", "--router", internal]
    # Every decoder pulls from the prefill's KV holder, all from 127.0.0.1:
    # the holder's per-peer connection cap (512) is for many hosts.
    start(
        "prefill",
        engine + ["--role", "prefill", "--holder-max-connections-per-peer", per_peer],
        logs,
        procs,
    )
    for i in range(DECODERS):
        start(
            f"d{i}",
            engine + ["--role", "decode", "--id", f"d{i}", "--decode-us-per-token", DECODE_US],
            logs,
            procs,
        )
    wait_ready(internal, 1 + DECODERS)
    return router_proc, router


def main():
    bin_dir = sys.argv[1]
    counts = [int(n) for n in sys.argv[2:]] or [1000, 5000, 10000]
    limit = raise_open_files(max(counts))
    print(
        f"scale: open-file limit {limit} (each stream needs 2 in the router over "
        f"HTTP/1.1, 1 over HTTP/2, plus {FD_RESERVE} for pools and listeners); load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    logs = tempfile.mkdtemp(prefix="connex-scale-")
    per_peer = str(2 * max(counts) + FD_RESERVE)
    failed = 0
    per_stream = 0.0
    # A fresh cluster per count: the idle RSS each count is measured from is
    # a fresh router's, not what the previous count left in pools and the
    # allocator (which made later counts look cheaper than they are).
    for asked in counts:
        http2 = ALL_HTTP2 or fitting(asked, limit, False) < asked
        if http2 and not ALL_HTTP2:
            print(
                f"scale: {asked} HTTP/1.1 streams need {sockets(asked, False)} open "
                f"files in the router (limit {limit}); their clients speak HTTP/2",
                flush=True,
            )
        streams = fitting(asked, limit, http2)
        procs = []
        try:
            router_proc, router = cluster(bin_dir, logs, per_peer, procs, http2)
            failures, per_stream = run(bin_dir, router, router_proc.pid, streams, asked, http2)
            failed += failures
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    print(f"rss_per_stream_kib={per_stream:.1f}")
    if failed:
        sys.exit(f"scale: {failed} streams failed (logs in {logs})")


if __name__ == "__main__":
    main()
