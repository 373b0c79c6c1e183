"""Block addressing from a KV tensor's shape and strides, for the layouts of
vLLM's attention backends. Each case is checked against brute force: the bytes
the pieces of block b cover are exactly the bytes of the elements whose block
index is b (so a pull moves that block, all of it, and nothing else)."""

from __future__ import annotations

import itertools

import pytest
from connex.adapters.vllm.layout import MAX_PIECES, LayoutError, block_layout

NB, BS, H, D = 5, 4, 2, 8  # blocks, block size, KV heads, head dim
ES = 2  # bf16


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def physical(logical: list[int], order: list[int]) -> list[int]:
    """Strides of a tensor of `logical` shape stored in `order` (a permutation:
    physical dim i is logical dim order[i]), as vLLM's stride orders do."""
    phys = contiguous_strides([logical[d] for d in order])
    strides = [0] * len(logical)
    for i, d in enumerate(order):
        strides[d] = phys[i]
    return strides


def block_bytes_brute(shape, strides, block_dim: int, b: int) -> set[int]:
    out: set[int] = set()
    ranges = [range(n) if d != block_dim else [b] for d, n in enumerate(shape)]
    for index in itertools.product(*ranges):
        start = sum(i * s for i, s in zip(index, strides, strict=True)) * ES
        out.update(range(start, start + ES))
    return out


def block_bytes_from_layout(layout, b: int) -> set[int]:
    out: set[int] = set()
    for off, length in layout.pieces:
        start = b * layout.block_stride + off
        out.update(range(start, start + length))
    return out


LAYOUTS = {
    # name: (logical shape, strides, block dim, pieces per block)
    "flash_attn_nhd": ([2, NB, BS, H, D], contiguous_strides([2, NB, BS, H, D]), 1, 2),
    "flash_attn_hnd": ([2, NB, BS, H, D], physical([2, NB, BS, H, D], [0, 1, 3, 2, 4]), 1, 2),
    "flashinfer_nhd": ([NB, 2, BS, H, D], contiguous_strides([NB, 2, BS, H, D]), 0, 1),
    "flashinfer_hnd": ([NB, 2, BS, H, D], physical([NB, 2, BS, H, D], [0, 1, 3, 2, 4]), 0, 1),
    "cpu": ([NB, H, BS, 2 * D], contiguous_strides([NB, H, BS, 2 * D]), 0, 1),
    "mla": ([NB, BS, 72], contiguous_strides([NB, BS, 72]), 0, 1),
    # Blocks outermost in memory while the logical order puts K/V first.
    "kv_first_blocks_outer": (
        [2, NB, BS, H, D],
        physical([2, NB, BS, H, D], [1, 0, 2, 3, 4]),
        1,
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_backend_layout_addresses_exactly_each_block(name):
    shape, strides, block_dim, npieces = LAYOUTS[name]
    layout = block_layout(shape, strides, ES, NB)
    assert len(layout.pieces) == npieces
    assert layout.block_bytes == ES * (BS * H * D * 2 if name != "mla" else BS * 72)
    total = ES * (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1)
    assert layout.span == total
    for b in range(NB):
        assert block_bytes_from_layout(layout, b) == block_bytes_brute(shape, strides, block_dim, b)


def test_flash_attention_pieces_are_k_then_v():
    layout = block_layout([2, NB, BS, H, D], contiguous_strides([2, NB, BS, H, D]), ES, NB)
    block = BS * H * D * ES
    assert layout.block_stride == block
    assert layout.pieces == ((0, block), (NB * block, block))


def test_a_block_dimension_that_cannot_be_told_apart_is_refused():
    # Two blocks and a K/V dimension of 2: which is which?
    with pytest.raises(LayoutError, match="ambiguous"):
        block_layout([2, 2, BS, H, D], contiguous_strides([2, 2, BS, H, D]), ES, 2)
    # Unless the caller says.
    layout = block_layout([2, 2, BS, H, D], contiguous_strides([2, 2, BS, H, D]), ES, 2, 1)
    assert len(layout.pieces) == 2


def test_no_block_dimension_is_refused():
    with pytest.raises(LayoutError, match="no dimension of 9 blocks"):
        block_layout([NB, BS, D], contiguous_strides([NB, BS, D]), ES, 9)


def test_a_scattered_block_is_refused():
    # Every other element (a strided view): one piece per element, 128 per block.
    shape = [NB, BS, H, 2 * D]
    strides = [s * 2 for s in contiguous_strides(shape)]
    with pytest.raises(LayoutError, match=f"at most {MAX_PIECES}"):
        block_layout(shape, strides, ES, NB)


def test_broadcast_dimensions_are_refused():
    with pytest.raises(LayoutError, match="broadcast"):
        block_layout([NB, BS, D], [BS * D, 0, 1], ES, NB)
