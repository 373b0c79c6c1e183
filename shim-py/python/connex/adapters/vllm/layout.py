"""Where one KV cache block's bytes are inside a layer's KV tensor.

Derived from the tensor's shape and strides alone, so that every layout vLLM's
attention backends use is addressed the same way (sizes in elements):

- FlashAttention / Triton: `[2, num_blocks, block_size, heads, head_dim]`, K and V
  apart: two pieces per block (one per K/V), whatever the physical stride order
  (NHD or HND);
- FlashInfer: `[num_blocks, 2, block_size, heads, head_dim]`: one piece;
- the CPU backend: `[num_blocks, heads, block_size, 2 * head_dim]`: one piece;
- MLA: one latent cache per layer, `[num_blocks, block_size, latent_dim]`: one piece.

A block is the set of elements whose block index is b; its innermost dimensions
that are contiguous in memory form one piece, and each combination of the
remaining (outer) dimensions is another piece. Layouts that would scatter a
block over more than `MAX_PIECES` pieces are refused rather than moved slowly,
and so is a tensor whose block dimension cannot be told apart.

Only a transfer backend that moves device memory may be given a device tensor
(UCX that reports CUDA support at run time): the tcp backend reads and writes
host addresses, so a CUDA KV cache is refused with a clear error before any of
its addresses is used, and moved through host copies instead (`staging.py`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# More pieces per block than this and a transfer is mostly per-piece overhead.
MAX_PIECES = 64
# Backends that only move host memory.
HOST_ONLY_BACKENDS = ("tcp",)


class LayoutError(ValueError):
    """A KV tensor whose blocks this connector cannot address."""


@dataclass(frozen=True)
class BlockLayout:
    """Byte addressing of the blocks of one KV tensor, relative to its first byte."""

    # Bytes from block b to block b + 1.
    block_stride: int
    # (offset, length) of each piece of block 0, in a fixed order (K before V).
    pieces: tuple[tuple[int, int], ...]
    # Bytes from the tensor's first element to one past its last.
    span: int

    @property
    def block_bytes(self) -> int:
        return sum(length for _, length in self.pieces)


def block_layout(
    shape: tuple[int, ...] | list[int],
    strides: tuple[int, ...] | list[int],
    element_size: int,
    num_blocks: int,
    block_dim: int | None = None,
) -> BlockLayout:
    """The block addressing of a tensor of `shape` and `strides` (in elements).

    `block_dim` names the dimension that indexes blocks when the sizes alone
    cannot (another dimension of size `num_blocks`)."""
    shape, strides = list(shape), list(strides)
    if len(shape) != len(strides) or not shape:
        raise LayoutError(f"a KV tensor needs a shape and strides: {shape}, {strides}")
    if element_size <= 0 or num_blocks <= 0:
        raise LayoutError("element size and block count must be positive")
    for n, s in zip(shape, strides, strict=True):
        if n <= 0 or (n > 1 and s <= 0):
            raise LayoutError(
                f"KV tensor of shape {shape} strides {strides}: an empty, broadcast or "
                "reversed dimension"
            )
    if block_dim is None:
        candidates = [d for d, n in enumerate(shape) if n == num_blocks]
        if not candidates:
            raise LayoutError(f"no dimension of {num_blocks} blocks in KV tensor shape {shape}")
        if len(candidates) > 1:
            raise LayoutError(
                f"KV tensor shape {shape}: dimensions {candidates} all have {num_blocks} "
                "entries; which one indexes blocks is ambiguous"
            )
        block_dim = candidates[0]
    elif not 0 <= block_dim < len(shape) or shape[block_dim] != num_blocks:
        raise LayoutError(f"dimension {block_dim} of shape {shape} is not {num_blocks} blocks")
    others = [d for d in range(len(shape)) if d != block_dim and shape[d] > 1]
    # The innermost dimensions that are contiguous in memory make one piece.
    inner, run = 1, set()
    for d in sorted(others, key=lambda d: strides[d]):
        if strides[d] != inner:
            break
        inner *= shape[d]
        run.add(d)
    outer = [d for d in others if d not in run]  # in logical order: K before V
    count = prod(shape[d] for d in outer)
    if count > MAX_PIECES:
        raise LayoutError(
            f"KV tensor shape {shape} strides {strides}: a block is scattered over "
            f"{count} pieces (at most {MAX_PIECES})"
        )
    pieces = tuple(
        (
            sum(i * strides[d] for i, d in zip(index, outer, strict=True)) * element_size,
            inner * element_size,
        )
        for index in itertools.product(*(range(shape[d]) for d in outer))
    )
    span = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * element_size
    return BlockLayout(strides[block_dim] * element_size, pieces, span)


def check_host_memory(
    tensor: torch.Tensor, backend: str, moves_device_memory: bool = False
) -> None:
    """Refuses to hand a backend memory it would read and write as host memory:
    a tensor off the CPU, unless the backend reported that it moves device
    memory (`moves_device_memory`, detected at run time; never for tcp)."""
    device = tensor.device
    if device.type == "cpu" or (moves_device_memory and backend not in HOST_ONLY_BACKENDS):
        return
    what = (
        f"the {backend} transfer backend moves host memory only"
        if backend in HOST_ONLY_BACKENDS
        else f"the {backend} transfer backend loaded here cannot move device memory"
    )
    raise LayoutError(
        f"{what}, and this KV cache is on {device}; use staged holds (`hold: staged`), "
        "a backend built with device memory support (ucx with CUDA), or a KV cache on the CPU"
    )


def tensor_layout(
    tensor: torch.Tensor, num_blocks: int, backend: str, moves_device_memory: bool = False
) -> BlockLayout:
    """The block addressing of a layer's KV tensor that `backend` moves in
    place, after the device check."""
    check_host_memory(tensor, backend, moves_device_memory)
    return block_layout_of(tensor, num_blocks)


def block_layout_of(tensor: torch.Tensor, num_blocks: int) -> BlockLayout:
    """The block addressing of a layer's KV tensor, wherever it lives."""
    return block_layout(
        tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(), num_blocks
    )
