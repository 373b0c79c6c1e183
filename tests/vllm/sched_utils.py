"""vLLM's real Scheduler with the ConnexConnector, driven step by step without a
model (as vLLM's own connector unit tests do): a test plays the worker by
answering each step with a ModelRunnerOutput of its choosing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import harness
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from vllm.sampling_params import StructuredOutputsParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

BLOCK = harness.BLOCK_SIZE
EOS = 2
_ids = count(1)
init_none_hash(sha256)


@dataclass
class FakeCtrl:
    """Stands in for the transfer crate's control client: records calls."""

    renewed: list[tuple[str, str, int]] = field(default_factory=list)
    released: list[tuple[str, str]] = field(default_factory=list)

    def renew(self, ctrl: str, transfer_id: str, epoch: int) -> dict:
        self.renewed.append((ctrl, transfer_id, epoch))
        return {}

    def release(self, ctrl: str, transfer_id: str) -> bool:
        self.released.append((ctrl, transfer_id))
        return True


def make_scheduler(
    kv_role: str,
    policy: str = "fail",
    extra: dict | None = None,
    num_blocks: int = 1000,
    ctrl: FakeCtrl | None = None,
    parallel: ParallelConfig | None = None,
    model_dir: Path | None = None,
    reasoning_parser: str = "",
) -> Scheduler:
    """`model_dir`: another model than the tiny one (its tokenizer is what the
    structured output grammars are compiled for); `reasoning_parser`: vLLM's
    parser that decides where a grammar starts (`--reasoning-parser`)."""
    from connex.adapters.vllm import pd_connector
    from connex.adapters.vllm.keeper import HoldKeeper

    model = ModelConfig(model=str(model_dir or harness.model_dir()), dtype="bfloat16", seed=0)
    vllm_config = VllmConfig(
        model_config=model,
        structured_outputs_config=StructuredOutputsConfig(reasoning_parser=reasoning_parser),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ConnexConnector",
            kv_connector_module_path="connex.adapters.vllm.pd_connector",
            kv_role=kv_role,
            engine_id=f"engine-{kv_role}",
            # Holds in place unless a test asks for staged ones.
            kv_connector_extra_config={
                "ctrl_port": 17000,
                "retain_s": 30,
                "hold": "in_place",
                **(extra or {}),
            },
            kv_load_failure_policy=policy,
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=parallel or ParallelConfig(),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        # As the engine core resolves it for this model on CPU (NHD pages).
        kv_cache_layout="LBNHC",
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
                ),
            )
        ],
    )
    fake = ctrl or FakeCtrl()
    original = pd_connector.ConnexConnector._make_keeper
    pd_connector.ConnexConnector._make_keeper = lambda self: HoldKeeper(fake, tick_s=0.01)
    try:
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=_structured(vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
    finally:
        pd_connector.ConnexConnector._make_keeper = original
    scheduler.fake_ctrl = fake  # type: ignore[attr-defined]
    return scheduler


def _structured(vllm_config):
    from vllm.v1.structured_output import StructuredOutputManager

    return StructuredOutputManager(vllm_config)


def make_request(
    prompt: list[int],
    max_tokens: int = 8,
    kv_transfer_params: dict | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> Request:
    """A greedy request; with `structured_outputs`, compiled by the xgrammar
    backend (what the engine's input processor picks for it)."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=structured_outputs
    )
    if structured_outputs is not None:
        structured_outputs._backend = "xgrammar"
    params.update_from_generation_config({}, EOS)
    request = Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    request.kv_transfer_params = kv_transfer_params
    return request


def prompt_of(n: int, seed: int = 7) -> list[int]:
    return [(seed * 131 + i * 17) % 2000 + 10 for i in range(n)]


def runner_output(
    scheduler_output,
    token: int = 42,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
) -> ModelRunnerOutput:
    """What a worker would answer to a step: one token per scheduled request."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    kv = None
    if finished_sending or finished_recving or failed_recving:
        kv = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving or set(),
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
        kv_connector_output=kv,
    )


def step(scheduler: Scheduler, **kv) -> tuple[object, list]:
    """One schedule + update; returns (scheduler output, engine core outputs)."""
    out = scheduler.schedule()
    results = scheduler.update_from_output(out, runner_output(out, **kv))
    outputs = [o for eco in results.values() for o in eco.outputs]
    return out, outputs


def assert_empty(scheduler: Scheduler) -> None:
    """No request, no block leaked."""
    assert not scheduler.requests
    assert not scheduler.running and not len(scheduler.waiting)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def keeper_passes(scheduler: Scheduler, count: int = 3, timeout_s: float = 5.0) -> None:
    """Waits until the decoder's hold keeper has made `count` more passes and
    its holders' lanes have no call left: any renewal or release due before this
    call has been sent by then."""
    keeper = scheduler.connector.scheduler.keeper
    start = keeper.stats.passes
    deadline = time.monotonic() + timeout_s
    while keeper.stats.passes < start + count or keeper.in_flight():
        assert time.monotonic() < deadline, "the hold keeper stopped"
        time.sleep(0.005)
