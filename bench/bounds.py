"""bench/run bounds: what abuse costs a router's memory, beside healthy streams.

A router with its default flags, one mock prefill and two mock decoders, under
each of three abuses, while 100 healthy streamed completions run beside it:
  bodies     8 concurrent 30 MB request bodies (prompts of 15 M token ids) to
             the served model, sent 3 times over;
  kv_events  1,000 registrants, each reporting 16,384 prompt blocks as KV
             events (16 M blocks offered to the prefix index);
  flood      a decoder that answers one token and then 512 KiB events of text
             without tokens, without end (every healthy stream it serves is
             resumed on the other decoder);
  responses  32 clients for 20 s, each sending background and stored
             Responses with the largest fields the limits allow (`metadata`
             of 16 pairs of 64-character keys and 512-character values,
             `reasoning` and `text` settings of 32 characters), 3 KiB of input
             a turn, stored turns chained by `previous_response_id` up to 8 deep,
             and reading each back as it is made: the background one's events
             by two readers at once, the stored ones twice each.
For each: the router's peak RSS above its idle RSS (VmHWM, /proc), the healthy
streams that failed (must be 0) and how the abuse was answered; then
`router_peak_rss_mib_under_abuse=<the largest of them all>`.
Then the Redis bytes one background response writes per generated token
beside its events (a router on a real redis-server; target <= 64):
`responses_redis_bytes_per_token=<x>`.

Usage: python3 bench/bounds.py BIN_DIR [CASE...]   (all cases without one)
"""

import http.client
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from procs import Procs

HEALTHY = 100
HEALTHY_TOKENS = 200
DECODE_US = "10000"
BODY_IDS = 15_000_000
REGISTRANTS = 1000
BLOCKS_PER_REGISTRANT = 16_384
RESPONSES_CLIENTS = 32
RESPONSES_SECONDS = 20
# A turn's input; 8 chained turns stay under the ~35 K-token prompt whose
# `prompt_token_ids` the decoder flood guard (pd/relay.rs) takes for a flood.
RESPONSES_INPUT_BYTES = 3 * 1024
RESPONSES_CHAIN = 8


class Cluster(Procs):
    """A router with its default flags, a prefill and decoders d0, d1."""

    def __init__(self, bin_dir, logs, name, d0_flags=()):
        super().__init__(logs)
        try:
            _, self.router = self.start(
                f"{name}-router",
                [f"{bin_dir}/connex-router", "serve", "--listen", "127.0.0.1:0"]
                + ["--internal-listen", "127.0.0.1:0", "--admin-token", "bench"],
            )
            self.router_pid = self.procs[0].pid
            engine = [f"{bin_dir}/connex-mock-engine", "--model", "mock", "--router", self.internal]
            # 1 byte of KV a token: the prefill holds the 15 M-token prompts.
            self.start(
                f"{name}-prefill", engine + ["--role", "prefill", "--kv-bytes-per-token", "1"]
            )
            decoder = engine + ["--role", "decode", "--decode-us-per-token", DECODE_US]
            decoder += ["--kv-bytes-per-token", "1"]
            self.start(f"{name}-d0", decoder + ["--id", "d0", *d0_flags])
            self.start(f"{name}-d1", decoder + ["--id", "d1"])
            self.wait_ready(3)
        except BaseException:
            self.stop()
            raise

    def rss_kib(self, field):
        with open(f"/proc/{self.router_pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"no {field}")


def post(url, path, body, headers=None, timeout=120, method="POST"):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, data, {"content-type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    answer = reply.read()
    conn.close()
    return reply.status, answer


def get(url, path, timeout=120):
    return post(url, path, None, timeout=timeout, method="GET")


class Healthy:
    """HEALTHY streamed completions, each run again as soon as it ends, until
    stopped; counts those that failed."""

    def __init__(self, router):
        self.router = router
        self.stopping = threading.Event()
        self.done = 0
        self.failed = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(HEALTHY)]
        for thread in self.threads:
            thread.start()

    def run(self, i):
        while not self.stopping.is_set():
            body = {
                "model": "mock",
                "prompt": f"healthy {i} {self.done}",
                "max_tokens": HEALTHY_TOKENS,
            }
            body.update({"stream": True, "return_token_ids": True})
            try:
                status, answer = post(self.router, "/v1/completions", body)
                tokens = answer.count(b'"token_ids":[') if status == 200 else 0
                ok = status == 200 and b'"error"' not in answer and tokens >= 1
                ok = ok and answer.rstrip().endswith(b"data: [DONE]")
            except OSError as err:
                ok, answer = False, str(err).encode()
            with self.lock:
                if ok:
                    self.done += 1
                else:
                    self.failed.append(answer[:300])

    def stop(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join()


def id_body(ids):
    return b'{"model":"mock","max_tokens":4,"prompt":[' + b",".join([b"7"] * ids) + b"]}"


def abuse_bodies(cluster):
    body = id_body(BODY_IDS)
    answers = {}
    for _ in range(3):
        results = []

        def send(results=results):
            try:
                results.append(post(cluster.router, "/v1/completions", body))
            except OSError:
                # Refused before the body was sent (503 past the budget):
                # the router closed the upload.
                results.append(("refused mid-upload", b""))

        threads = [threading.Thread(target=send) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for status, _ in results:
            answers[status] = answers.get(status, 0) + 1
    return "answers " + ", ".join(f"{n} x {s}" for s, n in sorted(answers.items(), key=str))


def abuse_kv_events(cluster):
    stored = 0
    for n in range(REGISTRANTS):
        url = f"http://127.0.0.1:{20000 + n}"
        status, answer = post(
            cluster.internal, "/v1/instances", {"role": "decode", "url": url, "model": "abuse"}
        )
        if status >= 300:
            return f"registration {n} refused: {status} {answer[:200]}"
        registered = json.loads(answer)
        path = f"/v1/instances/{registered['id']}/kv-events"
        credential = {"x-connex-credential": registered["credential"]}
        for batch in range(2):
            half = BLOCKS_PER_REGISTRANT // 2
            first = n * BLOCKS_PER_REGISTRANT + batch * half
            hashes = list(range(first, first + half))
            parent = None if batch == 0 else first - 1
            events = {
                "events": [
                    {
                        "type": "BlockStored",
                        "block_hashes": hashes,
                        "parent_block_hash": parent,
                        "token_ids": [(n + i) % 1000 for i in range(half)],
                        "block_size": 1,
                    }
                ]
            }
            status, _ = post(cluster.internal, path, events, credential)
            stored += half if status == 204 else 0
    req = urllib.request.Request(
        f"{cluster.internal}/admin/instances", headers={"authorization": "Bearer bench"}
    )
    with urllib.request.urlopen(req) as reply:
        held = sum(i.get("prefix_index_blocks", 0) for i in json.load(reply)["data"])
    return f"{stored} blocks reported, {held} indexed"


def abuse_flood(cluster):
    # d0 floods every stream it serves; the healthy load goes through it.
    time.sleep(15)
    with urllib.request.urlopen(f"{cluster.internal}/metrics") as reply:
        text = reply.read().decode()
    resumes = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("connex_resumes_total") and 'cause="protocol"' in line
    )
    return f"{resumes:.0f} streams cut from the flooding decoder and resumed"


def largest_fields():
    """The echoed fields of a Responses request at the limits the router holds."""
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    return {
        "metadata": metadata,
        "reasoning": {"effort": "low", "summary": "s" * 32},
        "text": {"format": {"type": "text"}, "verbosity": "v" * 32},
    }


def abuse_responses(cluster):
    stopping = time.monotonic() + RESPONSES_SECONDS
    counts = {}
    lock = threading.Lock()

    def count(what):
        with lock:
            counts[what] = counts.get(what, 0) + 1

    def client(n):
        try:
            turns(n)
        except OSError as err:
            count(f"connection error {err}")

    def turns(n):
        previous, depth, turn = None, 0, 0
        while time.monotonic() < stopping:
            turn += 1
            text = f"client {n} turn {turn} " + "x" * RESPONSES_INPUT_BYTES
            body = {"model": "mock", "input": text, "max_output_tokens": 16}
            body.update(largest_fields())
            status, answer = post(cluster.router, "/v1/responses", {**body, "background": True})
            count(f"background {status}")
            if status == 200:
                replay = f"/v1/responses/{json.loads(answer)['id']}?stream=true"
                readers = [
                    threading.Thread(
                        target=lambda path=replay: count(f"replay {get(cluster.router, path)[0]}")
                    )
                    for _ in range(2)
                ]
                for reader in readers:
                    reader.start()
                for reader in readers:
                    reader.join()
                count(f"read {get(cluster.router, replay.removesuffix('?stream=true'))[0]}")
            stored = {**body, "max_output_tokens": 8}
            if previous is not None:
                stored["previous_response_id"] = previous
            status, answer = post(cluster.router, "/v1/responses", stored)
            count(f"stored {status}")
            if status == 200:
                rid = json.loads(answer)["id"]
                for _ in range(2):
                    count(f"read {get(cluster.router, replay.removesuffix('?stream=true'))[0]}")
                depth += 1
                previous = rid if depth < RESPONSES_CHAIN else None
            if previous is None:
                depth = 0

    threads = [threading.Thread(target=client, args=(n,)) for n in range(RESPONSES_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return "answers " + ", ".join(f"{n} x {what}" for what, n in sorted(counts.items()))


CASES = [
    ("bodies", (), abuse_bodies),
    ("kv_events", (), abuse_kv_events),
    ("flood", ("--text-flood-after-tokens", "1"), abuse_flood),
    ("responses", (), abuse_responses),
]


RESPONSE_TOKENS = 1000


def free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_info(port, field):
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "INFO", "stats"], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        if line.startswith(field + ":"):
            return int(line.split(":", 1)[1])
    raise RuntimeError(f"redis INFO has no {field}")


def bulk(n):
    """Bytes of a RESP bulk string of `n` bytes: `$<n>\\r\\n<bytes>\\r\\n`."""
    return 1 + len(str(n)) + 2 + n + 2


def redis_event_bytes(port, response_id):
    """Bytes of the events of `response_id` as a writer sends them: each one's
    sequence number and JSON, as two arguments of the append."""
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "--no-raw", "XRANGE", f"connex:{{{response_id}}}:events"]
        + ["-", "+"],
        capture_output=True,
    ).stdout
    total = 0
    for line in out.splitlines():
        line = line.strip()
        # Each entry's value: `N) "{...}"` (quoted, escaped); its bytes are
        # those of the JSON the router sent.
        if line.endswith(b'}"') and b'"{' in line:
            quoted = line[line.index(b'"{') :]
            event = json.loads(quoted.decode())
            number = str(json.loads(event)["sequence_number"])
            total += bulk(len(event.encode())) + bulk(len(number))
    return total


def responses_redis_bytes_per_token(bin_dir, logs):
    """Redis bytes written per generated token of a background response,
    beside its events: everything the router sends Redis while the response
    runs (INFO total_net_input_bytes; less the idle rate of the takeover
    loop's looks, measured first), less the events as sent (each one's
    sequence number and JSON, framed as the append's arguments), over its
    tokens. One response of RESPONSE_TOKENS tokens on a decoder at DECODE_US
    per token, read by its streaming client (from the router's memory: no
    reads of Redis)."""
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        + ["--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs = Procs(logs, "responses-")
    try:
        deadline = time.monotonic() + 10
        while (
            subprocess.run(
                ["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True
            ).stdout.strip()
            != "PONG"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        _, router = procs.start(
            "router",
            [f"{bin_dir}/connex-router", "serve", "--listen", "127.0.0.1:0"]
            + ["--internal-listen", "127.0.0.1:0", "--admin-token", "bench"]
            + ["--response-store", f"redis://127.0.0.1:{port}"],
        )
        engine = [f"{bin_dir}/connex-mock-engine", "--model", "mock", "--router", procs.internal]
        procs.start("prefill", engine + ["--role", "prefill"])
        procs.start("decode", engine + ["--role", "decode", "--decode-us-per-token", DECODE_US])
        procs.wait_ready(2)
        idle_from = (redis_info(port, "total_net_input_bytes"), time.monotonic())
        time.sleep(3)
        idle_to = (redis_info(port, "total_net_input_bytes"), time.monotonic())
        idle_rate = (idle_to[0] - idle_from[0]) / (idle_to[1] - idle_from[1])
        body = {"model": "mock", "input": "Write at length.", "background": True}
        body.update({"stream": True, "max_output_tokens": RESPONSE_TOKENS})
        before = (redis_info(port, "total_net_input_bytes"), time.monotonic())
        status, answer = post(router, "/v1/responses", body, timeout=300)
        after = (redis_info(port, "total_net_input_bytes"), time.monotonic())
        if status != 200 or b"response.completed" not in answer:
            raise RuntimeError(f"the background response failed: {status} {answer[-300:]!r}")
        first = json.loads(answer.split(b"data: ", 1)[1].split(b"\n", 1)[0])
        response_id = first["response"]["id"]
        last = json.loads(answer.rsplit(b"data: ", 1)[1].split(b"\n", 1)[0])
        tokens = last["response"]["usage"]["output_tokens"]
        written = after[0] - before[0] - idle_rate * (after[1] - before[1])
        events = redis_event_bytes(port, response_id)
        per_token = (written - events) / tokens
        detail = (
            f"{tokens} tokens, {written / 1024:.1f} KiB written in "
            f"{after[1] - before[1]:.1f} s, {events / 1024:.1f} KiB of it events"
        )
        return per_token, detail
    finally:
        procs.stop()
        redis.kill()
        redis.wait()


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bin_dir = sys.argv[1]
    chosen = sys.argv[2:] or [name for name, _, _ in CASES]
    logs = tempfile.mkdtemp(prefix="connex-bench-bounds-")
    print(f"bounds: router peak RSS above idle under abuse, beside {HEALTHY} healthy streams")
    columns = ("idle_mib", "peak_mib", "above_mib", "failed", "served")
    print(f"  {'case':<10} " + " ".join(f"{c:>9}" for c in columns) + "  abuse")
    worst = 0.0
    for name, d0_flags, abuse in CASES:
        if name not in chosen:
            continue
        cluster = Cluster(bin_dir, logs, name, d0_flags)
        try:
            time.sleep(0.5)
            idle = cluster.rss_kib("VmRSS") / 1024
            healthy = Healthy(cluster.router)
            outcome = abuse(cluster)
            healthy.stop()
            peak = cluster.rss_kib("VmHWM") / 1024
        finally:
            cluster.stop()
        above = peak - idle
        worst = max(worst, above)
        values = (f"{idle:.1f}", f"{peak:.1f}", f"{above:.1f}", len(healthy.failed), healthy.done)
        print(f"  {name:<10} " + " ".join(f"{v:>9}" for v in values) + f"  {outcome}")
        for failure in healthy.failed[:3]:
            print(f"    failed: {failure!r}")
    print(f"router_peak_rss_mib_under_abuse={worst:.1f}")
    per_token, detail = responses_redis_bytes_per_token(bin_dir, logs)
    print(f"responses: Redis bytes per token beside the events: {per_token:.1f} ({detail})")
    print(f"responses_redis_bytes_per_token={per_token:.1f}")


if __name__ == "__main__":
    main()
