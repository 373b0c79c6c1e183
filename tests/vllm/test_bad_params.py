"""Arbitrary kv_transfer_params never crash an engine (issue 13).

A client writes kv_transfer_params; the router passes a prefill's answer on. Fed
anything, vLLM's real Scheduler with the ConnexConnector (both roles at once,
kv_both) must finish every request, as a failed load under
`kv_load_failure_policy` when the params claim a hold they do not describe, and
leak no block; the worker half must turn any load it is handed into a finished
(failed) load, never an exception in its step.
"""

from __future__ import annotations

import math
import socket
import time

import pytest
import torch
from connex.adapters.vllm.config import ConnexConfig
from connex.adapters.vllm.params import Layout, hold_params
from connex.adapters.vllm.scheduler import ConnexMetadata, LoadSpec
from connex.adapters.vllm.worker import ConnexWorker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_utils import (
    BLOCK,
    assert_empty,
    make_request,
    make_scheduler,
    prompt_of,
    runner_output,
)
from vllm.v1.request import RequestStatus

LAYOUT = Layout(tp_size=1, block_size=BLOCK, num_layers=2, page_bytes=2 * BLOCK * 2 * 32 * 2)
PROMPT = 70


def valid(**changes) -> dict:
    params = hold_params(
        transfer_id="t-1",
        remote_ctrl="127.0.0.1:17000",
        engine_id="prefill-0",
        block_ids=[500, 501, 502],
        num_tokens=PROMPT,
        backend="tcp",
        lease_s=30.0,
        layout=LAYOUT,
    )
    params.update(changes)
    return params


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**32 - 1, 2**32, -1, 0, 65535, 65536])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
keys = st.sampled_from(sorted(valid()) + ["extra"])
# The OpenAI layer admits an object or null (vLLM's own scheduler relies on it);
# inside, anything.
arbitrary_params = (
    st.builds(lambda changes: valid(**changes), st.dictionaries(keys, json_values, max_size=3))
    | st.dictionaries(keys, json_values)
    | st.dictionaries(st.text(max_size=8), json_values)
    | st.none()
)


class FakeWorker:
    """Answers each step as the worker would, without moving bytes: a load with an
    error fails, any other load arrives; holds are freed once their request ends."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.failed: set[str] = set()

    def answer(self, out, finished: set[str]) -> dict:
        meta = out.kv_connector_metadata
        self.held |= {h.req_id for h in meta.holds}
        loads = {load.req_id for load in meta.loads}
        failed = {load.req_id for load in meta.loads if load.error is not None}
        self.failed |= failed
        sending = self.held & finished
        self.held -= sending
        return {
            "finished_recving": loads or None,
            "failed_recving": failed or None,
            "finished_sending": sending or None,
        }


def drive(sched, request, policy: str) -> None:
    """Steps until `request` is gone and every block is back."""
    worker = FakeWorker()
    finished: set[str] = set()
    sched.add_request(request)
    for _ in range(40):
        out = sched.schedule()
        results = sched.update_from_output(out, runner_output(out, **worker.answer(out, finished)))
        for eco in results.values():
            finished |= {o.request_id for o in eco.outputs if o.finish_reason is not None}
        if not sched.requests:
            break
    assert not sched.requests, f"request stuck: {request.status}"
    if request.request_id in worker.failed:
        want = (
            RequestStatus.FINISHED_ERROR
            if policy == "fail"
            else RequestStatus.FINISHED_LENGTH_CAPPED
        )
        assert request.status == want
    else:
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_empty(sched)


@pytest.fixture(scope="module", params=["recompute", "fail"])
def both(request):
    return make_scheduler("kv_both", policy=request.param), request.param


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(params=arbitrary_params)
def test_any_params_finish_the_request_and_free_every_block(both, params):
    sched, policy = both
    request = make_request(prompt_of(PROMPT), max_tokens=2, kv_transfer_params=params)
    drive(sched, request, policy)


@pytest.mark.parametrize(
    "changes",
    [
        {"remote_ctrl": "127.0.0.1:70000"},
        {"remote_ctrl": "127.0.0.1:port"},
        {"resume_epoch": 2**32},
        {"lease_s": math.inf},
        {"lease_s": math.nan},
        {"remote_block_ids": ["500", 501, 502]},
        {"remote_num_tokens": -70},
        {"backend": "ucx"},  # served by another backend than this decoder's
    ],
)
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_bad_params_are_a_failed_load_under_the_policy(policy, changes):
    sched = make_scheduler("kv_consumer", policy=policy)
    request = make_request(prompt_of(PROMPT), max_tokens=2, kv_transfer_params=valid(**changes))
    sched.add_request(request)
    out = sched.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert load.error is not None
    assert "kv_transfer_params" in load.error or "ucx backend" in load.error
    assert load.remote_ctrl == ""  # nothing to pull from
    drive_rest = FakeWorker().answer(out, set())
    sched.update_from_output(out, runner_output(out, **drive_rest))
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
    else:
        out = sched.schedule()
        assert out.num_scheduled_tokens == {request.request_id: PROMPT}  # recomputed
    assert sched.fake_ctrl.renewed == []  # nothing kept alive on its word


# ---- the worker half ----------------------------------------------------------------


def closed_port() -> int:
    """A loopback port nobody listens on (so a pull fails at connect, on loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NUM_BLOCKS = 8


@pytest.fixture(scope="module")
def worker():
    cfg = ConnexConfig(pull_timeout_s=2.0, transfer_secret="s")
    worker = ConnexWorker(cfg, 0, NUM_BLOCKS, ["l0", "l1"], is_producer=False, is_consumer=True)
    caches = {f"l{i}": torch.zeros(NUM_BLOCKS, 2, BLOCK, 64, dtype=torch.bfloat16) for i in (0, 1)}
    worker.register_kv_caches(caches)
    worker.caches = caches  # type: ignore[attr-defined]  # kept alive while registered
    yield worker
    worker.shutdown()


anything = json_values | st.text(max_size=300)
ctrls = (
    st.builds(
        lambda port: f"127.0.0.1:{port}",
        st.just(closed_port()) | st.integers(-5, 10**20).filter(lambda p: not 0 < p < 65536),
    )
    | st.builds(
        lambda host, tail: f"{host}:{tail}",
        st.sampled_from(["127.0.0.1", "", "[::1"]),
        st.text(max_size=8).filter(lambda t: not t.isdigit()),
    )
    | json_values.filter(lambda v: not isinstance(v, str))
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    transfer_id=st.text(min_size=1, max_size=40) | anything,
    ctrl=ctrls,
    epoch=st.integers(min_value=-(2**70), max_value=2**70) | anything,
    local=st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=6) | anything,
    error=st.none() | st.text(max_size=20),
)
def test_the_worker_turns_any_load_into_a_finished_load(
    worker, transfer_id, ctrl, epoch, local, error
):
    load = LoadSpec("req-x", transfer_id, ctrl, epoch, [], local, error=error)
    worker.bind(ConnexMetadata(loads=[load]))
    worker.start_load_kv()
    deadline = time.monotonic() + 10
    while True:
        sending, recving, failed = worker.get_finished(set())
        if recving or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    # Nothing listens where any of these points: every one is a failed load.
    assert recving == {"req-x"} and failed == {"req-x"}
    assert not sending
    assert not worker._pulls


class _FailedPull:
    def done(self) -> bool:
        return True

    def result(self) -> dict:
        raise RuntimeError("pulling a hold timed out")


class _QueuedReads:
    """A reader whose failed pull left reads queued (Mooncake's case) until
    `ended` is set; the rest of the reader is the worker's real one."""

    def __init__(self, real) -> None:
        self.real, self.ended, self.asked = real, False, []

    def pull_async(self, *args, **kwargs) -> _FailedPull:
        return _FailedPull()

    def writing_into(self, blocks) -> bool:
        self.asked.append(list(blocks))
        return not self.ended


def test_a_failed_load_is_reported_only_once_nothing_writes_into_its_blocks(worker):
    # vLLM gives a failed load's blocks to other requests (or recomputes into
    # them): a Mooncake read queued past the failure would write one request's
    # KV into another's. The worker holds the report back until the reads end.
    real = worker.reader
    queued = _QueuedReads(real)
    worker.reader = queued
    try:
        load = LoadSpec("req-q", "t-5f3c9a1e7b2d4086a9c1e3f5b7d90246", "127.0.0.1:9", 0, [], [1, 2])
        load.hold_indices, load.hold_blocks = [0, 1], 2
        worker.bind(ConnexMetadata(loads=[load]))
        worker.start_load_kv()
        for _ in range(3):
            assert worker.get_finished(set()) == (set(), set(), set())
        # It asked about exactly the blocks the pull was given (blocks 1 and 2).
        assert queued.asked[0] == worker._refs(worker._reader_rids, [1, 2])
        queued.ended = True
        assert worker.get_finished(set()) == (set(), {"req-q"}, {"req-q"})
        assert not worker._draining and not worker._pulls
    finally:
        worker.reader = real


def failed_share_load(worker: ConnexWorker, remote_tp: int) -> str:
    """The error of a load from a prefill of `remote_tp` ranks, which fails
    before any pull."""
    load = LoadSpec("req-tp", "t-5f3c9a1e7b2d4086a9c1e3f5b7d90246", "127.0.0.1:9", 0, [], [1])
    load.hold_indices, load.hold_blocks, load.remote_tp = [0], 1, remote_tp
    worker.bind(ConnexMetadata(loads=[load]))
    worker.start_load_kv()
    assert worker.get_finished(set()) == (set(), {"req-tp"}, {"req-tp"})
    assert not worker._pulls
    assert load.error is not None
    return load.error


def test_a_prefill_of_another_tp_size_is_refused_where_heads_cannot_be_cut_out():
    """Another TP size is read by runs of heads: a decoder whose pages keep the
    heads inside each token (NHD: [2, blocks, block size, heads, head dim]),
    or whose TP size the prefill's does not divide, fails the load by name."""
    cfg = ConnexConfig(pull_timeout_s=2.0, transfer_secret="s")
    nhd = ConnexWorker(
        cfg, 0, NUM_BLOCKS, ["l0"], is_producer=False, is_consumer=True, tp_size=2, kv_heads=2
    )
    caches = {"l0": torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 32, dtype=torch.bfloat16)}
    nhd.register_kv_caches(caches)
    try:
        assert "NHD" in failed_share_load(nhd, remote_tp=1)
        assert "divide" in failed_share_load(nhd, remote_tp=3)
    finally:
        nhd.shutdown()
