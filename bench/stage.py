"""bench/run stage: what staged holds cost and buy on a prefill (vLLM on CPU).

Two prefill engines of the tiny test Llama, alike but for `hold`: `staged` (the
prompt blocks are copied to host memory in their step and go back to vLLM) and
`in_place` (a hold keeps the blocks until it ends). Both have the same KV cache
(`--num-gpu-blocks-override BLOCKS`), sized from the holds: by default the
HOLDS live holds take all of it in place but FREE blocks (BLOCKS = HOLDS *
blocks per prompt + FREE), as on a busy GPU whose long decodes keep their
prefill's holds; FREE = 16 leaves room for 8 of the 16 concurrent 2-block
prompts. For each engine, in alternation:

- `none`: PREFILLS P/D prefills (kv_transfer_params do_remote_decode, as the
  router sends them), CONCURRENCY at a time, each hold released right after its
  answer (as a decoder that pulled it and finished would): requests/s, and the
  median latency of a prefill alone (concurrency 1): the staging copy's cost;
- `live`: HOLDS holds created first and left alive (as decoders still running),
  then the same prefills: requests/s while they live.

The engine not being measured is stopped (SIGSTOP) meanwhile: an in-place
prefill with live holds steps all the time, which on a small machine would slow
the other engine down.

Last line: staged_vs_in_place_prefill_throughput_ratio=<staged / in_place req/s, HOLDS alive>

    python bench/stage.py [--rounds 1] [--holds 200] [--free 16] [--blocks N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import harness  # noqa: E402
from connex import _transfer  # noqa: E402

PROMPT_TOKENS = 60  # two blocks of 32
# Blocks one prefill takes (the prompt and its one generated token).
PROMPT_BLOCKS = -(-(PROMPT_TOKENS + 1) // harness.BLOCK_SIZE)
PREFILLS = 96
CONCURRENCY = 16


def engine(mode: str, blocks: int, core: int) -> harness.Engine:
    e = harness.Engine(
        f"stage_{mode}", core=core, extra_args=["--num-gpu-blocks-override", str(blocks)]
    )
    e.kv_config = {
        "kv_connector": "ConnexConnector",
        "kv_connector_module_path": "connex.adapters.vllm.pd_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "ctrl_port": harness.free_port(),
            "retain_s": 600,
            "hold": mode,
        },
    }
    return e


def ctrl(e: harness.Engine) -> str:
    assert e.kv_config is not None
    return f"127.0.0.1:{e.kv_config['kv_connector_extra_config']['ctrl_port']}"


class Prompts:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def next(self) -> list[int]:
        return [self.rng.randrange(16, 2000) for _ in range(PROMPT_TOKENS)]


def prefill(e: harness.Engine, prompt: list[int]) -> str:
    answer = harness.complete(
        e.url,
        prompt,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    return str(answer["kv_transfer_params"]["transfer_id"])


def cpu_seconds(e: harness.Engine) -> float:
    """CPU seconds used so far by the engine's processes (its process group:
    API server, EngineCore, worker), from /proc."""
    assert e.proc is not None
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command: state ppid pgrp ... utime (12th) stime (13th).
        if int(fields[2]) == e.proc.pid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def throughput(
    e: harness.Engine, prompts: Prompts, reader: _transfer.Reader
) -> tuple[float, float]:
    """Prefills/s for PREFILLS prefills, CONCURRENCY at a time, each hold
    released once answered; and prefills per CPU second of the engine (what a
    busy machine's other load does not inflate, unlike wall-clock time)."""
    batch = [prompts.next() for _ in range(PREFILLS)]

    def one(prompt: list[int]) -> None:
        reader.release(ctrl(e), prefill(e, prompt))

    began, cpu = time.monotonic(), cpu_seconds(e)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(one, batch))
    return PREFILLS / (time.monotonic() - began), PREFILLS / max(cpu_seconds(e) - cpu, 1e-3)


def alone_ms(e: harness.Engine, prompts: Prompts, reader: _transfer.Reader) -> float:
    times = []
    for _ in range(16):
        began = time.monotonic()
        transfer_id = prefill(e, prompts.next())
        times.append((time.monotonic() - began) * 1000)
        reader.release(ctrl(e), transfer_id)
    return statistics.median(times)


@contextlib.contextmanager
def alone(engines: dict[str, harness.Engine], measured: str):
    """Stops the other engine while one is measured: an engine whose finished
    requests keep their blocks (in place, holds alive) steps all the time, and on
    a small machine that would slow its neighbour down, not itself."""
    others = [e for m, e in engines.items() if m != measured]
    for e in others:
        e.kill(signal.SIGSTOP)
    try:
        yield
    finally:
        for e in others:
            e.kill(signal.SIGCONT)


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--holds", type=int, default=200)
    ap.add_argument(
        "--free",
        type=int,
        default=16,
        help="blocks the in-place engine has left for new prompts while HOLDS holds live",
    )
    ap.add_argument("--blocks", type=int, help="KV cache size (default: from --holds, --free)")
    args = ap.parse_args()
    if args.blocks is None:
        args.blocks = args.holds * PROMPT_BLOCKS + args.free
    held = args.holds * PROMPT_BLOCKS
    if held >= args.blocks:
        ap.error(f"{args.holds} holds in place take {held} blocks: the cache needs more")
    harness.model_dir()
    engines = {m: engine(m, args.blocks, core) for core, m in enumerate(("staged", "in_place"))}
    reader = _transfer.Reader(backend="tcp")
    print(f"load average at start: {load_average()}", file=sys.stderr)
    results: dict[str, dict[str, list[float]]] = {
        m: {k: [] for k in ("none", "alone_ms", "live", "none_cpu", "live_cpu")} for m in engines
    }
    try:
        harness.start_all(list(engines.values()))
        prompts = Prompts(0)
        for e in engines.values():  # warm-up
            throughput(e, prompts, reader)
        for _ in range(args.rounds):
            for mode, e in engines.items():
                with alone(engines, mode):
                    results[mode]["alone_ms"].append(alone_ms(e, prompts, reader))
                    rate, per_cpu = throughput(e, prompts, reader)
                    results[mode]["none"].append(rate)
                    results[mode]["none_cpu"].append(per_cpu)
        live: dict[str, list[str]] = {}
        for mode, e in engines.items():
            # Left alive: in place they take PROMPT_BLOCKS * HOLDS of the cache's blocks.
            live[mode] = [prefill(e, prompts.next()) for _ in range(args.holds)]
            alive = reader.stats(ctrl(e))["holds"]
            print(f"{mode}: {alive} holds alive", file=sys.stderr)
        for _ in range(args.rounds):
            for mode, e in engines.items():
                with alone(engines, mode):
                    rate, per_cpu = throughput(e, prompts, reader)
                    results[mode]["live"].append(rate)
                    results[mode]["live_cpu"].append(per_cpu)
    finally:
        for e in engines.values():
            e.stop()
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in results.items()}
    print(
        f"prefill engines: KV cache {args.blocks} blocks of {harness.BLOCK_SIZE} tokens "
        f"(in place, {args.holds} live holds take {held} = {100 * held / args.blocks:.0f}%, "
        f"{args.blocks - held} left), prompts {PROMPT_TOKENS} tokens, {PREFILLS} prefills "
        f"{CONCURRENCY} at a time, {args.rounds} round(s), medians; load average "
        f"{load_average()}"
    )
    print(
        "| hold | prefill alone (ms) | prefills/s, no holds | prefills/s, "
        f"{args.holds} holds alive | prefills per CPU s, no holds | prefills per CPU s, "
        f"{args.holds} holds alive |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, r in med.items():
        print(
            f"| {mode} | {r['alone_ms']:.1f} | {r['none']:.1f} | {r['live']:.1f} "
            f"| {r['none_cpu']:.1f} | {r['live_cpu']:.1f} |"
        )
    print(
        "staged_vs_in_place_prefills_per_cpu_second_ratios="
        f"{med['staged']['none_cpu'] / med['in_place']['none_cpu']:.2f} (no holds), "
        f"{med['staged']['live_cpu'] / med['in_place']['live_cpu']:.2f} ({args.holds} alive)"
    )
    print(
        "staged_vs_in_place_prefill_throughput_no_holds_ratio="
        f"{med['staged']['none'] / med['in_place']['none']:.2f}"
    )
    print(
        "staged_vs_in_place_prefill_throughput_ratio="
        f"{med['staged']['live'] / med['in_place']['live']:.2f}"
    )


if __name__ == "__main__":
    main()
