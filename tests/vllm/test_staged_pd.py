"""P/D with staged holds (`hold: staged`) on real vLLM engines: the prefill
copies each prompt's blocks to host memory in the step that computes it and
gives the blocks straight back to vLLM; the hold serves decoders and resumes
from the copy.

Engines: the plain reference engine, a staged prefill whose KV cache is made
small on purpose (`--num-gpu-blocks-override`), and a decoder.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Iterator

import harness
import pytest
from conftest import connex_kv, plain_engine
from connex import _transfer
from test_pd import prefill

# The staged prefill's whole KV cache, in blocks (of harness.BLOCK_SIZE tokens):
# enough for one request of the longest prompt vLLM accepts here, not for the
# holds the capacity test keeps alive.
PREFILL_BLOCKS = 80
# Prompt length (tokens) of the capacity test: 12 blocks each.
CAPACITY_PROMPT = 12 * harness.BLOCK_SIZE - 4


@pytest.fixture(scope="module")
def engines(fleet) -> Iterator[dict[str, harness.Engine]]:
    prefill = harness.Engine(
        "staged_prefill",
        core=0,
        extra_args=["--num-gpu-blocks-override", str(PREFILL_BLOCKS)],
    )
    prefill.kv_config = connex_kv("kv_producer", prefill, hold="staged", retain_s=120)
    decoder = harness.Engine("staged_decoder", core=1)
    decoder.kv_config = connex_kv("kv_consumer", decoder)
    # The fleet names engines by Engine.name.
    engines = fleet.ensure({"plain": plain_engine(), prefill.name: prefill, decoder.name: decoder})
    try:
        yield {"plain": engines["plain"], "prefill": prefill, "decoder": decoder}
    finally:
        # These engines serve this module only: free their memory for the rest
        # of the session (the plain engine stays, it is shared).
        for name in (prefill.name, decoder.name):
            engine = fleet.engines.pop(name, None)
            if engine is not None:
                engine.stop()


def kv_usage(engine: harness.Engine) -> float:
    return engine.metric("vllm:kv_cache_usage_perc")


def token_prompt(seed: int, length: int) -> list[int]:
    """A prompt of token ids no engine has seen (no prefix cache can hit it)."""
    rng = random.Random(seed)
    return [rng.randrange(16, 2000) for _ in range(length)]


def pull_bytes(remote_ctrl: str, params: dict) -> bytes:
    """The whole hold, as a decoder of the same layout pulls it."""
    reader = _transfer.Reader(backend="tcp")
    count = len(params["remote_block_ids"]) * params["num_layers"]
    piece = params["page_bytes"]
    buf = ctypes.create_string_buffer(piece * count)
    rid = reader.register_region(ctypes.addressof(buf), piece * count)
    reader.pull(
        remote_ctrl, params["transfer_id"], 0, [(rid, i * piece, piece) for i in range(count)]
    )
    return buf.raw


def test_a_staged_prefill_frees_its_blocks_at_once_and_its_hold_serves_pulls_and_a_resume(
    engines,
):
    p, d = engines["prefill"], engines["decoder"]
    assert "staged holds" in p.log_text()
    prompt = token_prompt(1, 300)
    want = harness.complete(engines["plain"].url, prompt, 24)["choices"][0]["token_ids"]
    baseline = kv_usage(p)
    before = _transfer.Reader(backend="tcp").stats(p.ctrl)
    params = prefill(p, prompt)
    # The blocks went back to vLLM with the request; the hold lives on in host memory.
    harness.wait_for(lambda: kv_usage(p) == baseline, 5, "the prefill's blocks freed")
    held = _transfer.Reader(backend="tcp").stats(p.ctrl)
    assert held["holds"] - before["holds"] == 1
    assert held["held_bytes"] - before["held_bytes"] == (
        len(params["remote_block_ids"]) * params["num_layers"] * params["page_bytes"]
    )
    first = pull_bytes(p.ctrl, params)
    assert any(first), "pulled KV is all zeros"
    # vLLM reuses the freed blocks for other prompts (the cache holds 80 blocks,
    # these take 3 x 40); the held bytes do not change.
    for seed in (2, 3, 4):
        harness.complete(p.url, token_prompt(seed, 40 * harness.BLOCK_SIZE - 8), 1)
    assert pull_bytes(p.ctrl, params) == first
    # A resume (epoch 1) from the hold, 8 tokens in, continues exactly.
    got = harness.complete(
        d.url, prompt + want[:8], 16, kv_transfer_params=params | {"resume_epoch": 1}
    )
    assert got["choices"][0]["token_ids"] == want[8:]
    # That decode finished normally: it released the hold, and the holder
    # freed the host copy.
    harness.wait_for(
        lambda: _transfer.Reader(backend="tcp").stat(p.ctrl, params["transfer_id"]) is None,
        10,
        "the hold released",
    )
    assert _transfer.Reader(backend="tcp").stats(p.ctrl)["held_bytes"] == before["held_bytes"]


def test_a_prefill_keeps_more_holds_alive_than_its_kv_cache_has_blocks(engines):
    """12 holds of 12 blocks (144 blocks) on a prefill with 80: held in place
    they could not all exist; staged, every decoder still gets exact tokens."""
    p, d = engines["prefill"], engines["decoder"]
    prompts = [token_prompt(100 + i, CAPACITY_PROMPT) for i in range(12)]
    wants = [
        harness.complete(engines["plain"].url, x, 12)["choices"][0]["token_ids"] for x in prompts
    ]
    all_params = [prefill(p, x) for x in prompts]
    held_blocks = sum(len(x["remote_block_ids"]) for x in all_params)
    assert held_blocks > PREFILL_BLOCKS
    live = [
        _transfer.Reader(backend="tcp").stat(p.ctrl, x["transfer_id"]) is not None
        for x in all_params
    ]
    assert all(live), "a hold was lost"
    harness.wait_for(lambda: kv_usage(p) == 0, 5, "the prefill's blocks freed")
    for x, params, want in zip(prompts, all_params, wants, strict=True):
        got = harness.complete(d.url, x, 12, kv_transfer_params=params)
        assert got["choices"][0]["token_ids"] == want
    assert "kv load failed" not in d.log_text()


def test_a_decoder_with_the_prompts_start_cached_pulls_only_the_blocks_it_lacks(engines):
    """A partial local prefix hit: the decoder has the prompt's first 5 blocks
    in its prefix cache, so it pulls only the hold's later blocks (every layer
    of them), not the whole hold, and its answer is still exact."""
    p, d = engines["prefill"], engines["decoder"]
    bs = harness.BLOCK_SIZE
    prompt = token_prompt(7, 300)
    want = harness.complete(engines["plain"].url, prompt, 16)["choices"][0]["token_ids"]
    # The decoder computes (and caches) the prompt's first 5 full blocks once.
    cached = 5
    harness.complete(d.url, prompt[: cached * bs + 3], 1)
    params = prefill(p, prompt)
    hold_blocks = len(params["remote_block_ids"])
    assert hold_blocks == -(-len(prompt) // bs) > cached
    hits = d.metric("vllm:prefix_cache_hits_total")
    pulls = d.metric("connex_kv_pulls_total", absent=0.0)
    pulled = d.metric("connex_kv_pulled_bytes_total", absent=0.0)
    failures = d.metric("connex_kv_pull_failures_total", absent=0.0)
    served = _transfer.Reader(backend="tcp").stats(p.ctrl)["bytes_served"]
    seen = len(d.log_text())
    got = harness.complete(d.url, prompt, 16, kv_transfer_params=params)
    assert got["choices"][0]["token_ids"] == want
    # The decoder did use its cache for the first blocks ...
    assert d.metric("vllm:prefix_cache_hits_total") - hits == cached * bs
    # ... and pulled exactly the rest: one pull, of the missing blocks of every layer.
    harness.wait_for(
        lambda: d.metric("connex_kv_pulls_total", absent=0.0) == pulls + 1, 10, "the pull counted"
    )
    missing = (hold_blocks - cached) * params["num_layers"] * params["page_bytes"]
    assert d.metric("connex_kv_pulled_bytes_total") - pulled == missing
    assert _transfer.Reader(backend="tcp").stats(p.ctrl)["bytes_served"] - served == missing
    assert d.metric("connex_kv_pull_failures_total", absent=0.0) == failures
    assert "kv load failed" not in d.log_text()[seen:]
