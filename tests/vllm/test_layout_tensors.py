"""The connector's block addressing on real torch tensors shaped (and strided) as
vLLM's attention backends allocate them, and the device check of the tcp path.

Marking block b through torch's own indexing must change exactly the bytes the
connector would move for block b."""

from __future__ import annotations

import ctypes
import os

import harness
import pytest
import torch
from connex.adapters.vllm.config import ConnexConfig
from connex.adapters.vllm.layout import LayoutError
from connex.adapters.vllm.worker import ConnexWorker, layer_region

NB, BS, H, D = 6, 4, 2, 32
# Memory that is not the host's: a GPU where tests/gpu/run runs this file
# (CONNEX_TEST_KV_DEVICE=cuda), else torch's "meta" device, which has no
# memory at all and so is refused the same way.
OFF_HOST = "cuda" if os.environ.get("CONNEX_TEST_KV_DEVICE") == "cuda" else "meta"


def fa(hnd: bool) -> tuple[torch.Tensor, int]:
    """FlashAttention/Triton: [2, blocks, block_size, heads, head_dim]."""
    if hnd:  # stored as [2, blocks, heads, block_size, head_dim]
        return torch.zeros(2, NB, H, BS, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4), 1
    return torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16), 1


def flashinfer(hnd: bool) -> tuple[torch.Tensor, int]:
    """FlashInfer: [blocks, 2, block_size, heads, head_dim]."""
    if hnd:
        return torch.zeros(NB, 2, H, BS, D, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4), 0
    return torch.zeros(NB, 2, BS, H, D, dtype=torch.bfloat16), 0


CASES = {
    "flash_attn_nhd": lambda: fa(False),
    "flash_attn_hnd": lambda: fa(True),
    "flashinfer_nhd": lambda: flashinfer(False),
    "flashinfer_hnd": lambda: flashinfer(True),
    "cpu": lambda: (torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16), 0),
    "mla": lambda: (torch.zeros(NB, BS, 576, dtype=torch.bfloat16), 0),
}


def marked_bytes(tensor: torch.Tensor, region) -> set[int]:
    raw = ctypes.string_at(region.ptr, region.span)
    return {i for i, byte in enumerate(raw) if byte}


@pytest.mark.parametrize("name", sorted(CASES))
def test_marking_a_block_changes_exactly_the_bytes_addressed_for_it(name):
    tensor, block_dim = CASES[name]()
    region = layer_region(tensor, NB, "tcp")
    for b in range(NB):
        tensor.zero_()
        tensor.select(block_dim, b).fill_(1.0)  # bf16 1.0: both bytes nonzero
        want = set()
        for _, start, length in region.refs(0, [b]):
            want.update(range(start, start + length))
        assert marked_bytes(tensor, region) == want


def test_the_tcp_backend_refuses_a_kv_cache_that_is_not_in_host_memory():
    device_cache = torch.empty(NB, H, BS, 2 * D, dtype=torch.bfloat16, device=OFF_HOST)
    with pytest.raises(LayoutError, match="tcp transfer backend moves host memory only"):
        layer_region(device_cache, NB, "tcp")
    worker = ConnexWorker(
        ConnexConfig(), 0, NB, ["l0"], is_producer=True, is_consumer=False, hold_mode="in_place"
    )
    with pytest.raises(LayoutError, match=f"on {OFF_HOST}"):
        worker.register_kv_caches({"l0": device_cache})
    assert worker.holder is None  # refused before anything listens or is registered


def test_a_device_kv_cache_is_staged_through_host_memory_with_the_tcp_backend():
    """By default a device cache is held staged (host copies) and pulled into
    host memory first: no device address ever reaches the tcp backend."""
    device_cache = torch.empty(NB, H, BS, 2 * D, dtype=torch.bfloat16, device=OFF_HOST)
    cfg = ConnexConfig(ctrl_port=harness.free_port())
    worker = ConnexWorker(cfg, 0, NB, ["l0"], is_producer=True, is_consumer=True)
    try:
        worker.register_kv_caches({"l0": device_cache})
        assert worker.hold_mode == "staged"
        assert worker.staged is not None and worker.staged_reads is not None
        assert worker._holder_rids == [] and worker._reader_rids == []
        assert worker.reader is not None and not worker.reader.moves_device_memory
        assert worker.holder is not None and not worker.holder.moves_device_memory
    finally:
        worker.shutdown()


def test_a_host_kv_cache_held_in_place_is_registered_as_it_is():
    cfg = ConnexConfig(ctrl_port=harness.free_port(), hold="in_place")
    worker = ConnexWorker(cfg, 0, NB, ["l0"], is_producer=True, is_consumer=True)
    try:
        worker.register_kv_caches({"l0": torch.zeros(NB, H, BS, 2 * D, dtype=torch.bfloat16)})
        assert worker.hold_mode == "in_place"
        assert worker.staged is None and worker.staged_reads is None
        assert len(worker._holder_rids) == 1 and len(worker._reader_rids) == 1
    finally:
        worker.shutdown()
