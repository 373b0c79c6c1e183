"""Staged holds (`hold: staged`): a prefill holds host copies of its prompt
blocks instead of the blocks themselves.

In the step that computes a prompt, the request's blocks of every layer are
copied into a host buffer of their own (pinned on a GPU, on a side stream,
fenced before the hold exists), the buffer is registered with the holder as a
region and held under the request's transfer id. vLLM gets the device blocks
back when the request finishes, right after that step, so holds no longer eat
the prefill's KV cache; they live under the holder's byte budget instead, and
its eviction, lease and release rules are the same as for holds in place.

A buffer is freed only when the holder reports its hold freed (`freed()`),
which happens once the hold is released, expired or evicted *and* the last read
of it has stopped (the holder fences reads in flight and waits for them): a
read never streams from freed memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .staging import CopyStream, KVLayer, gather_blocks, hold_bytes, hold_refs, host_buffer

if TYPE_CHECKING:
    import torch

    from connex import _transfer

logger = logging.getLogger("connex.vllm.staged")


@dataclass
class _Staged:
    region_id: int
    buffer: torch.Tensor


class StagedHolds:
    """The host buffers of one holder's staged holds."""

    def __init__(self, holder: _transfer.Holder, layers: list[KVLayer]) -> None:
        self._stream = CopyStream.of_layers(layers, "to stage")
        self._holder = holder
        self._layers = layers
        self._staged: dict[str, _Staged] = {}

    def create(self, transfer_id: str, block_ids: list[int]) -> None:
        """Copies `block_ids` of every layer to a new host buffer and holds it
        under `transfer_id` (only once the copy has completed). Raises, holding
        nothing, when the copy or the hold fails."""
        buffer = host_buffer(hold_bytes(self._layers, len(block_ids)), self._stream.device)
        fence = self._stream.run(lambda: gather_blocks(self._layers, block_ids, buffer))
        fence.wait()
        region = self._holder.register_region(buffer.data_ptr(), buffer.numel())
        try:
            self._holder.create_hold(transfer_id, hold_refs(region, self._layers, len(block_ids)))
        except Exception:
            self._holder.unregister_region(region)
            raise
        self._staged[transfer_id] = _Staged(region, buffer)

    def owns(self, transfer_id: str) -> bool:
        return transfer_id in self._staged

    def free(self, transfer_id: str) -> bool:
        """Frees the buffer of a hold the holder reported freed (its reads have
        stopped); false when it is not a staged hold."""
        staged = self._staged.pop(transfer_id, None)
        if staged is None:
            return False
        self._holder.unregister_region(staged.region_id)
        return True

    @property
    def held_bytes(self) -> int:
        """Host bytes of the buffers not freed yet."""
        return sum(s.buffer.numel() for s in self._staged.values())

    def __len__(self) -> int:
        return len(self._staged)
