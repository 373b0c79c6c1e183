"""bench/run vllm_resume: the client-visible gap when a decoder dies mid-stream.

Real vLLM engines on CPU (the tiny test Llama) with the ConnexConnector, behind
connex-router: one prefill, three decoders. For prompts of 128, 512 and 1024
tokens, a stream of MAX_TOKENS greedy tokens is cut at token KILL_AT by SIGKILL of
its decoder, and the router resumes it on another decoder, which either
- pulls the prompt KV from the prefill's hold (`resume`), or
- finds the hold gone (the bench releases it just before the kill) and recomputes
  prompt + generated tokens itself (`reprefill`, vLLM's kv_load_failure_policy
  recompute: the cost a lost hold has).
The gap is the longest wait for a token the client sees from the kill on (the
chunks already in flight arrive first, then the stream stalls until the new
decoder answers). Both modes run in the same run, alternating,
and every resumed stream is checked against an uninterrupted one. The killed
decoder is restarted in the background for later trials.

Then the same resume at the largest size with decoders of TP 2 behind the TP 1
prefill (heterogeneous TP: each decoder rank pulls the prefill's blocks and
keeps its half of the KV heads), beside the equal-TP row: the gap, and the
pull's bytes per second (the resuming decoder's `connex_kv_pulled_bytes` over
its `connex_kv_pull_seconds`, all ranks).

    python bench/vllm_resume.py [--sizes 128,512,1024] [--rounds 1] [--no-hetero]
Last line: vllm_resume_gap_ratio=<reprefill gap / resume gap at the largest size>
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import harness  # noqa: E402
import httpx  # noqa: E402
from connex import _transfer  # noqa: E402

MAX_TOKENS = 120
KILL_AT = 30


def kv_config(role: str, router: str, engine: harness.Engine) -> dict:
    return {
        "kv_connector": "ConnexConnector",
        "kv_connector_module_path": "connex.adapters.vllm.pd_connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "ctrl_port": harness.free_port(),
            "retain_s": 60,
            # As measured in docs/bench.md (before staged holds became the default).
            "hold": "in_place",
            "router": router,
            "url": engine.url,
            "instance_id": engine.name,
        },
    }


def make_engine(name: str, role: str, router: str, core: int, tp: int = 1) -> harness.Engine:
    engine = harness.Engine(name, core=core)
    if role == "kv_consumer":
        # A decoder that has seen a context would find it in its prefix cache and
        # measure nothing: every resume must really pull or recompute.
        engine.extra_args = ["--no-enable-prefix-caching"]
    if tp > 1:
        engine.extra_args += [
            "--tensor-parallel-size",
            str(tp),
            "--distributed-executor-backend",
            "mp",
        ]
        engine.threads_bind = "nobind"
    engine.kv_config = kv_config(role, router, engine)
    return engine


def warm_up(engine: harness.Engine) -> None:
    """An engine's first requests are slow (lazy initialisation): not what is measured."""
    engine.wait_ready()
    for n in (16, 600):
        harness.complete(engine.url, prompt_ids(n, 1), 4)


def prompt_ids(n: int, seed: int) -> list[int]:
    return [1] + [(seed * 7919 + i * 104729) % 2000 + 40 for i in range(n - 1)]


class Bench:
    def __init__(self) -> None:
        self.router = harness.Router("--heartbeat-ttl-s", "3")
        url = self.router.internal
        self.prefill = make_engine("prefill", "kv_producer", url, 0)
        self.decoders = {
            name: make_engine(name, "kv_consumer", url, core)
            for name, core in (("d1", 1), ("d2", 0), ("d3", 1))
        }
        began = time.monotonic()
        harness.start_all([self.prefill, *self.decoders.values()])
        self.router.wait_instances({"prefill", *self.decoders})
        print(f"cluster up in {time.monotonic() - began:.0f}s", file=sys.stderr)
        for engine in [self.prefill, *self.decoders.values()]:
            warm_up(engine)
        self.restarts: list[threading.Thread] = []
        self.decoder_tp = 1
        self.last_killed: str | None = None

    def use_decoders(self, tp: int, names: tuple[str, ...]) -> None:
        """Replaces the decoders with `names`, each of TP size `tp`."""
        for thread in self.restarts:
            thread.join()
        self.restarts.clear()
        for engine in self.decoders.values():
            engine.stop()
        self.decoder_tp = tp
        self.decoders = {
            name: make_engine(name, "kv_consumer", self.router.internal, 0, tp) for name in names
        }
        harness.start_all(list(self.decoders.values()))
        self.router.wait_instances(set(self.decoders))
        for engine in self.decoders.values():
            warm_up(engine)

    def pulls(self, skip: str | None = None) -> dict[str, tuple[float, float]]:
        """Each serving decoder's pulled bytes and pull seconds so far (all its
        ranks), but `skip`'s (a decoder killed and starting again)."""
        out = {}
        for name, engine in self.decoders.items():
            if name == skip or not engine.alive():
                continue
            try:
                out[name] = (
                    engine.metric("connex_kv_pulled_bytes_total", absent=0.0),
                    engine.metric("connex_kv_pull_seconds_sum", absent=0.0),
                )
            except httpx.HTTPError:
                continue  # not serving (yet): it pulled nothing of this trial
        return out

    def ready_decoders(self) -> set[str]:
        return {
            i["id"]
            for i in self.router.instances()
            if i["state"] == "ready" and i["id"] in self.decoders
        }

    def wait_two_decoders(self) -> None:
        # A restarted decoder takes part only once warmed up.
        for thread in self.restarts:
            thread.join()
        self.restarts.clear()
        deadline = time.monotonic() + harness.START_TIMEOUT_S
        while len(self.ready_decoders()) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("decoders did not come back")
            time.sleep(0.5)

    def restart(self, name: str) -> None:
        old = self.decoders[name]
        old.stop()
        fresh = make_engine(name, "kv_consumer", self.router.internal, old.core, self.decoder_tp)
        self.decoders[name] = fresh
        thread = threading.Thread(target=lambda: warm_up(fresh.start()), daemon=True)
        thread.start()
        self.restarts.append(thread)

    def in_flight(self) -> dict | None:
        """The router's journal entry of the stream being measured, if it is
        still in flight (its decoder has not sent the last token yet)."""
        for entry in self.router.requests():
            if not entry.get("finished"):
                return entry
        return None

    def release_hold(self, entry: dict) -> None:
        """Makes the in-flight request's hold disappear, as an expiry would."""
        params = entry.get("kv_transfer_params") or {}
        _transfer.Reader(backend="tcp").release(params["remote_ctrl"], params["transfer_id"])

    def takeover_s(self) -> float:
        """Sum of the router's resume latencies: failure detected -> first token
        of the decoder that took over."""
        return self.router.metric("connex_resume_latency_seconds_sum", absent=0.0)

    def trial(self, ids: list[int], mode: str | None) -> tuple[list[int], float | None]:
        """One stream; with a mode, its decoder is killed at KILL_AT. Returns the
        tokens and the largest gap between two chunks after the kill (seconds),
        None when the stream had already left its decoder by then (the client
        lags on a loaded machine) and nothing was killed."""
        body = {
            "model": harness.MODEL_NAME,
            "prompt": ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        tokens: list[int] = []
        last = time.monotonic()
        gap = 0.0
        killed = None
        late = False
        with httpx.stream(
            "POST", f"{self.router.url}/v1/completions", json=body, timeout=600
        ) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()!r}")
            decoder = reply.headers["x-connex-decoder"]
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event}")
                now = time.monotonic()
                got = [t for c in event["choices"] for t in c.get("token_ids") or []]
                if not got:
                    continue
                if killed is not None:
                    # Chunks already in flight arrive right after the kill; the
                    # stall the client sees is the longest wait from then on.
                    gap = max(gap, now - last)
                tokens += got
                last = now
                if mode is not None and killed is None and not late and len(tokens) >= KILL_AT:
                    entry = self.in_flight()
                    if entry is None:
                        late = True
                        continue
                    if mode == "reprefill":
                        self.release_hold(entry)
                    killed = decoder
                    self.decoders[decoder].kill()
                    last = time.monotonic()
        self.last_killed = killed
        if killed is not None:
            self.restart(killed)
        return tokens, None if late else gap

    def stop(self) -> None:
        for engine in [self.prefill, *self.decoders.values()]:
            engine.stop()
        self.router.stop()


def main() -> int:
    # A SIGTERM ends the run through the `finally` below, which stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="128,512,1024")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-hetero", action="store_true", help="no TP 1 -> 2 row")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    harness.model_dir()
    bench = Bench()
    gaps: dict[tuple[int, str], list[float]] = {}
    takeovers: dict[tuple[int, str], list[float]] = {}
    # Of the resumes: (bytes, seconds) the resuming decoder pulled.
    rates: dict[tuple[int, str], list[tuple[float, float]]] = {}

    def measure(size: int, mode: str, want: list[int], ids: list[int]) -> None:
        for _ in range(3):
            bench.wait_two_decoders()
            before = bench.takeover_s()
            resumes = bench.router.metric("connex_resumes_total", absent=0.0)
            pulled = bench.pulls()
            got, gap = bench.trial(ids, mode)
            takeover = bench.takeover_s() - before
            if got != want:
                raise RuntimeError(f"{mode} at {size} tokens changed the output")
            resumed = bench.router.metric("connex_resumes_total", absent=0.0) - resumes
            if gap is not None and resumed == 1:
                break
            # The client lagged: the decoder had sent its last token
            # before the kill, so nothing was resumed. Not a sample.
            print(f"  {size:>5} tokens  {mode:<9} no resume: repeated", file=sys.stderr)
        else:
            raise RuntimeError(f"{mode} at {size} tokens: the kill never hit a stream")
        gaps.setdefault((size, mode), []).append(gap)
        takeovers.setdefault((size, mode), []).append(takeover)
        # The decoder that took over is one that was alive before and was not
        # killed: what it pulled since is the resume's pull.
        after = bench.pulls(skip=bench.last_killed)
        moved = [
            (after[n][0] - b[0], after[n][1] - b[1])
            for n, b in pulled.items()
            if n != bench.last_killed and n in after and after[n][0] > b[0]
        ]
        if moved:
            rates.setdefault((size, mode), []).append(moved[0])
        print(
            f"  {size:>5} tokens  {mode:<9} gap {gap * 1000:8.1f} ms"
            f"  (router: failure seen -> next token {takeover * 1000:7.1f} ms)",
            file=sys.stderr,
        )

    largest = max(sizes)
    try:
        for size in sizes:
            ids = prompt_ids(size, size)
            bench.wait_two_decoders()
            want, _ = bench.trial(ids, None)
            for round_ in range(args.rounds):
                # Alternate which mode goes first, so that neither always kills the
                # longer-lived decoder.
                order = ("resume", "reprefill")
                for mode in order if (round_ + sizes.index(size)) % 2 == 0 else order[::-1]:
                    measure(size, mode, want, ids)
        if not args.no_hetero:
            # The same prefill, decoders of TP 2: the TP 1 -> 2 row.
            bench.use_decoders(2, ("t1", "t2"))
            ids = prompt_ids(largest, largest)
            bench.wait_two_decoders()
            # TP 2 rounds differently: its own uninterrupted answer is the reference.
            want, _ = bench.trial(ids, None)
            for _ in range(args.rounds):
                measure(largest, "resume_tp2", want, ids)
    finally:
        bench.stop()
    print(
        f"vllm_resume: gap after a decoder SIGKILL at token {KILL_AT} of {MAX_TOKENS}, "
        f"median of {args.rounds} round(s); resume pulls the held prompt KV, "
        "reprefill recomputes prompt + generated tokens"
    )
    for size in sizes:
        resume = statistics.median(gaps[(size, "resume")])
        reprefill = statistics.median(gaps[(size, "reprefill")])
        took = [statistics.median(takeovers[(size, m)]) * 1000 for m in ("resume", "reprefill")]
        print(
            f"  prompt {size:>5}: resume {resume * 1000:8.1f} ms   "
            f"reprefill {reprefill * 1000:8.1f} ms   ratio {reprefill / resume:6.2f}   "
            f"(router takeover {took[0]:.0f} / {took[1]:.0f} ms)"
        )
    for mode, label in (("resume", "TP 1 -> 1"), ("resume_tp2", "TP 1 -> 2")):
        if (largest, mode) not in gaps:
            continue
        moved = rates.get((largest, mode), [])
        rate = statistics.median(b / s for b, s in moved if s > 0) if moved else float("nan")
        per = statistics.median(b for b, _ in moved) if moved else float("nan")
        print(
            f"  prompt {largest:>5}, resume {label}: gap "
            f"{statistics.median(gaps[(largest, mode)]) * 1000:8.1f} ms   pulled "
            f"{per / 1e6:6.2f} MB at {rate / 1e6:8.1f} MB/s (bytes over pull seconds, all ranks)"
        )
    ratio = statistics.median(gaps[(largest, "reprefill")]) / statistics.median(
        gaps[(largest, "resume")]
    )
    took = {m: statistics.median(takeovers[(largest, m)]) for m in ("resume", "reprefill")}
    print(f"vllm_resume_takeover_ratio={took['reprefill'] / took['resume']:.3f}")
    print(f"vllm_resume_gap_ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
