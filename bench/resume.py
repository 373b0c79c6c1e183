"""bench/run resume: the gap a client sees when its decoder dies mid-stream.

For prompts of 512, 2k, 8k and 32k tokens, a streamed completion is decoded by a
mock decoder that crashes after token 64; the router resumes it on the other
decoder. Two ways, in one run, taking turns for ROUNDS rounds (medians reported):
  resume     the prefill keeps its hold: the new decoder pulls the prompt KV and
             computes only the 64 generated tokens;
  reprefill  the prefill frees each hold on its first pull (`--hold-release
             after_pull`), so the router prefills prompt + 64 tokens again.
Prefill costs 100 us per computed token on every engine (decoders too, for what
they compute themselves); each token of KV is 1 KiB, really held and pulled.
The gap is the time between the last token before the crash and the first one
after it, as the client sees it. A chat row at 8k: the same crash in a streamed
chat with reasoning and two tools offered, which continues through the tokens
API (render, generate, one derender call per chunk: docs/resume.md), beside the
completions resume at the same prompt length
(`chat_tools_resume_gap_vs_completions_at_8k`). The last line is
`resume_gap_ratio_at_8k=<reprefill gap / resume gap>`.

Usage: python3 bench/resume.py BIN_DIR [ROUNDS]
"""

import http.client
import json
import os
import signal
import statistics
import sys
import tempfile
import time

from procs import Procs

PROMPTS = [512, 2048, 8192, 32768]
CRASH_AT = 64
MAX_TOKENS = 128
PREFILL_US = "100"
DECODE_US = "1000"
KV_BYTES = os.environ.get("CONNEX_BENCH_KV_BYTES", "1024")


class Cluster(Procs):
    """A router, a prefill and two decoders (d0 crashes at token 64)."""

    def __init__(self, bin_dir, logs, reprefill, scale_out=False):
        super().__init__(logs, log_prefix="resume-")
        # Half-started (a failure or a signal on the way): stop what runs.
        try:
            _, self.router = self.start(
                "router",
                [f"{bin_dir}/connex-router", "serve", "--listen", "127.0.0.1:0"]
                + ["--internal-listen", "127.0.0.1:0"]
                + ["--decode-policy", "round_robin", "--admin-token", "bench"],
            )
            # Registration and admin: the internal listener (self.internal),
            # printed first.
            engine = [f"{bin_dir}/connex-mock-engine", "--model", "mock", "--router", self.internal]
            engine += ["--prefill-us-per-token", PREFILL_US, "--kv-bytes-per-token", KV_BYTES]
            hold = ["--hold-release", "after_pull"] if reprefill else []
            # The decoders serve the tokens API (a chat continues through it).
            engine += ["--enable-scale-out"] if scale_out else []
            self.start("prefill", engine + ["--role", "prefill"] + hold)
            decoder = engine + ["--role", "decode", "--decode-us-per-token", DECODE_US]
            self.start("d0", decoder + ["--id", "d0", "--crash-after-tokens", str(CRASH_AT)])
            self.start("d1", decoder + ["--id", "d1"])
            self.wait_ready(3)
        except BaseException:
            self.stop()
            raise


def prompt_ids(length, seed):
    return [(i * 7 + seed) % 250 + 1 for i in range(length)]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def stream_gap(router, prompt, chat=False):
    """Streams one completion (or a chat with reasoning and tools, when
    `chat`: `prompt` is then its text); returns (gap at the failure, median
    gap) in ms."""
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": "mock", "max_tokens": MAX_TOKENS, "stream": True, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["tools"] = TOOLS
        body["reasoning_effort"] = "low"
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300]}")
    arrivals = []
    buffer = b""
    while True:
        data = reply.read1(65536)
        if not data:
            break
        now = time.perf_counter()
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            payload = event.removeprefix(b"data: ")
            if payload == b"[DONE]":
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk}")
            for _ in chunk["choices"][0].get("token_ids") or []:
                arrivals.append(now)
    conn.close()
    if len(arrivals) != MAX_TOKENS:
        raise RuntimeError(f"got {len(arrivals)} tokens of {MAX_TOKENS}")
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # The failure gap follows the last token the client got from d0: token
    # CRASH_AT, or a few before it when d0's last tokens were split ones whose
    # text it held back (the router then resumes before them, and they arrive
    # with the next decoder's). It is the largest gap of that short window.
    window = range(max(0, CRASH_AT - 8), CRASH_AT)
    at = max(window, key=lambda i: gaps[i])
    others = gaps[:at] + gaps[at + 1 :]
    return gaps[at], statistics.median(others)


def main():
    # A SIGTERM ends the run through the `finally` below, which stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bin_dir = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    logs = tempfile.mkdtemp(prefix="connex-bench-resume-")
    results = {(n, mode): [] for n in PROMPTS for mode in ("resume", "reprefill")}
    chat_gaps = []
    usual = []
    for round_ in range(rounds):
        for n in PROMPTS:
            for mode in ("resume", "reprefill"):
                cluster = Cluster(bin_dir, logs, reprefill=mode == "reprefill")
                try:
                    gap, typical = stream_gap(cluster.router, prompt_ids(n, round_))
                finally:
                    cluster.stop()
                results[(n, mode)].append(gap)
                usual.append(typical)
        # The chat of the same prompt length (the mock's tokens are bytes; the
        # chat template adds a few).
        cluster = Cluster(bin_dir, logs, reprefill=False, scale_out=True)
        try:
            text = "".join(chr(97 + i % 26) for i in prompt_ids(8192, round_))
            gap, _ = stream_gap(cluster.router, text, chat=True)
        finally:
            cluster.stop()
        chat_gaps.append(gap)
        print(f"round {round_ + 1}/{rounds} done", file=sys.stderr)
    print(
        f"resume: gap seen by the client when its decoder dies at token {CRASH_AT}, "
        f"median of {rounds} rounds"
    )
    typical = statistics.median(usual)
    print(
        f"  (prefill {PREFILL_US} us/token, KV {KV_BYTES} B/token, "
        f"usual gap between tokens {typical:.1f} ms)"
    )
    print(f"  {'prompt':>7} {'resume_ms':>10} {'reprefill_ms':>13} {'ratio':>7}")
    ratio_8k = None
    for n in PROMPTS:
        resume = statistics.median(results[(n, "resume")])
        reprefill = statistics.median(results[(n, "reprefill")])
        ratio = reprefill / resume
        if n == 8192:
            ratio_8k = ratio
        print(f"  {n:>7} {resume:>10.1f} {reprefill:>13.1f} {ratio:>7.1f}")
    chat = statistics.median(chat_gaps)
    completions_8k = statistics.median(results[(8192, "resume")])
    print(f"  chat with reasoning and tools, 8192-token prompt: resume {chat:.1f} ms")
    print(f"chat_tools_resume_gap_vs_completions_at_8k={chat / completions_8k:.2f}")
    print(f"resume_gap_ratio_at_8k={ratio_8k:.2f}")


if __name__ == "__main__":
    main()
