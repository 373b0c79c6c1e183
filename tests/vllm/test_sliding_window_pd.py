"""P/D of a model with sliding-window layers, vLLM's hybrid KV cache manager on.

The model (`tiny_model.ensure_sliding`) has a full-attention layer and a
sliding-window layer (the last 64 tokens): with the hybrid manager, two KV
cache groups over the same tensors. ConnexConnector declares `SupportsHMA`, so
vLLM keeps the manager on (it turns it off for connectors that do not): a hold
carries both groups' blocks, and the decoder pulls every prompt block of the
full-attention group but only the sliding group's blocks inside its window
(vLLM frees the others as the prefill's request finishes).

Engines: a prefill (holds in place) and a decoder. The reference answer is the
prefill engine's own, computed without P/D.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import harness
import pytest
import tiny_model
from conftest import connex_kv
from test_pd import prefill, stats

PROMPT_TOKENS = 400
BLOCKS = -(-PROMPT_TOKENS // harness.BLOCK_SIZE)
# The sliding group's blocks vLLM frees when the prompt's request finishes: its
# attention skips the tokens before the window (vLLM's
# `SlidingWindowManager.get_num_skipped_tokens`).
FREED = (PROMPT_TOKENS - tiny_model.SLIDING_WINDOW + 1) // harness.BLOCK_SIZE
GROUPS = "FullAttentionSpec,SlidingWindowSpec(64)"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, harness.Engine]]:
    model = tiny_model.ensure_sliding()
    p = harness.Engine("sliding_prefill", model=model, core=0)
    p.kv_config = connex_kv("kv_producer", p, retain_s=120)
    d = harness.Engine("sliding_decoder", model=model, core=1)
    d.kv_config = connex_kv("kv_consumer", d)
    with harness.running([p, d]):
        yield {"prefill": p, "decoder": d}


def test_both_engines_keep_the_hybrid_kv_cache_manager(engines):
    """vLLM turns the hybrid manager off for a connector without SupportsHMA
    (and says so in its log); with ours, both engines run two KV cache groups
    and the connector says which."""
    for engine in engines.values():
        log = engine.log_text()
        assert "Turning off hybrid kv cache manager" not in log
        assert f"2 KV cache groups ({GROUPS})" in log, engine.log_tail()


def test_a_sliding_window_prompt_is_pulled_per_group_and_answers_exactly(engines):
    p, d = engines["prefill"], engines["decoder"]
    rng = random.Random(5)
    prompt = [rng.randrange(16, 2000) for _ in range(PROMPT_TOKENS)]
    want = harness.complete(p.url, prompt, 16)["choices"][0]["token_ids"]
    ctrl = p.ctrl
    before = stats(ctrl)
    params = prefill(p, prompt)
    assert params["kv_groups"] == 2
    assert params["compat"]["kv_groups"] == GROUPS
    ids = params["remote_block_ids"]
    assert len(ids) == 2 * BLOCKS
    full, sliding = ids[:BLOCKS], ids[BLOCKS:]
    # Every full-attention block is held; of the sliding group, only the
    # blocks of its window (the ones before it are vLLM's again: the hold has
    # the null block, id 0, in their place).
    assert all(full)
    assert sliding[:FREED] == [0] * FREED and all(sliding[FREED:])
    seen = len(d.log_text())
    got = harness.complete(d.url, prompt, 16, kv_transfer_params=params)
    failed = [line for line in d.log_text()[seen:].splitlines() if "kv load failed" in line]
    assert not failed, failed
    assert got["choices"][0]["token_ids"] == want
    # The decoder pulled the full group's blocks and the window's, no more.
    block = params["num_layers"] * params["page_bytes"]
    after = stats(ctrl)
    assert after["pulls"] - before["pulls"] == 1
    assert after["bytes_served"] - before["bytes_served"] == (2 * BLOCKS - FREED) * block


def test_a_decoder_that_groups_otherwise_refuses_the_hold_by_name(engines):
    """A hold of two groups read as one would pair the sliding group's blocks
    with the wrong layers: the load fails, named, and (policy `recompute`)
    the decoder computes the prompt itself, to the same answer."""
    p, d = engines["prefill"], engines["decoder"]
    rng = random.Random(6)
    prompt = [rng.randrange(16, 2000) for _ in range(PROMPT_TOKENS)]
    want = harness.complete(p.url, prompt, 8)["choices"][0]["token_ids"]
    params = prefill(p, prompt)
    params["kv_groups"] = 1
    seen = len(d.log_text())
    got = harness.complete(d.url, prompt, 8, kv_transfer_params=params)
    failed = [line for line in d.log_text()[seen:].splitlines() if "kv load failed" in line]
    assert any("kv_groups prefill=1 decode=2" in line for line in failed), failed
    assert got["choices"][0]["token_ids"] == want
