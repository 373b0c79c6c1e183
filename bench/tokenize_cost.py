"""`bench/run tokenize`: a prompt's token ids in the router vs an engine's /tokenize.

`cache_aware` needs a text prompt's token ids before it chooses a prefill.
Connex either asks one of the model's engines (`POST /tokenize`, the default)
or, given the model's tokenizer.json (`--tokenizer MODEL=PATH`), tokenizes in
process. This measures both on the same prompts, with a real tokenizer: the
tiny test model's byte-level BPE (tests/vllm/tiny_model.py).

- engine: a real vLLM engine on CPU (the tiny model); each prompt's
  `/tokenize` round trip timed by the client, sequentially, as the router
  makes it (one per request).
- router: connex-router with `--tokenizer tiny=<its tokenizer.json>` and
  `--prefill-policy cache_aware`, in front of mock engines serving "tiny"
  (what they answer does not matter here); each prompt sent once through it,
  sequentially, and the router's own `connex_tokenize_duration_seconds{by="router"}`
  read.

The prompts are PROMPTS distinct texts of about TOKENS tokens (each starts
with its number, so no cache spares any). Last line:
`router_vs_engine_tokenize_ratio=<router mean / engine mean>`.

Usage: python3 bench/tokenize_cost.py BIN_DIR [PROMPTS] [TOKENS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from prefix import OUT, Procs, metrics, sample

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
import harness  # noqa: E402


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as reply:
        return json.loads(reply.read())


def prompts(count: int, engine: str, tokens: int) -> list[str]:
    """`count` distinct texts of about `tokens` tokens (measured on `engine`)."""
    words = " ".join(f"clause {i} of the shared policy text" for i in range(2000))
    sample_text = words[:2000]
    answer = post(engine, "/tokenize", {"model": "tiny", "prompt": sample_text})
    chars = int(tokens * len(sample_text) / len(answer["tokens"]))
    return [f"Prompt {n}. {words}"[:chars] for n in range(count)]


def engine_ms(engine: str, texts: list[str]) -> list[float]:
    took = []
    for text in texts:
        started = time.perf_counter()
        post(engine, "/tokenize", {"model": "tiny", "prompt": text})
        took.append(1000 * (time.perf_counter() - started))
    return took


def router_ms(bin_dir: Path, tokenizer: Path, texts: list[str]) -> float:
    procs = Procs(bin_dir)
    try:
        url, internal = procs.start(
            "tokenize-router",
            str(bin_dir / "connex-router"),
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--internal-listen",
            "127.0.0.1:0",
            "--admin-token",
            "bench",
            "--prefill-policy",
            "cache_aware",
            "--tokenizer",
            f"tiny={tokenizer}",
        )
        for role in ("prefill", "decode"):
            procs.start(
                f"tokenize-{role}",
                str(bin_dir / "connex-mock-engine"),
                "--role",
                role,
                "--model",
                "tiny",
                "--router",
                internal,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                post(url, "/v1/completions", {"model": "tiny", "prompt": "warm", "max_tokens": 1})
                break
            except OSError:
                time.sleep(0.2)
        before = sample(metrics(internal), "connex_tokenize_duration_seconds_sum")
        for text in texts:
            post(url, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1})
        after = sample(metrics(internal), "connex_tokenize_duration_seconds_sum")
        return 1000 * (after - before) / len(texts)
    finally:
        procs.stop()


def main() -> None:
    bin_dir = Path(sys.argv[1])
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 1900
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer = harness.model_dir() / "tokenizer.json"
    engine = harness.Engine("bench-tokenize", log_dir=OUT)
    engine.start()
    try:
        engine.wait_ready()
        texts = prompts(count, engine.url, tokens)
        lengths = [
            len(post(engine.url, "/tokenize", {"model": "tiny", "prompt": t})["tokens"])
            for t in texts[:3]
        ]
        engine_times = engine_ms(engine.url, texts)
    finally:
        engine.stop()
    router_mean = router_ms(bin_dir, tokenizer, texts)
    engine_mean = statistics.mean(engine_times)
    print(
        f"{count} prompts of ~{statistics.mean(lengths):.0f} tokens (tiny model's byte-level BPE)"
    )
    print(
        f"engine /tokenize round trip (vLLM on CPU): mean {engine_mean:.2f} ms,"
        f" p50 {statistics.median(engine_times):.2f} ms"
    )
    print(f"router's own tokenizer (--tokenizer):       mean {router_mean:.2f} ms")
    print(f"router_vs_engine_tokenize_ratio={router_mean / engine_mean:.3f}")


if __name__ == "__main__":
    main()
