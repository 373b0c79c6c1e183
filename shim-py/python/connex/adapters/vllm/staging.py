"""Copies between a KV cache's blocks and host buffers laid out as a hold sends
them, for KV caches the transfer backend cannot move itself (a GPU cache with
the tcp backend) or should not pin (staged holds).

A hold's bytes are, in order: for each layer, for each of the request's blocks,
for each piece of the block (`layout.py`: K then V where they are apart), the
piece's bytes. A host buffer in that order is the hold itself (one region,
consecutive block refs), and both sides of a transfer name the same bytes
whether the prefill holds in place or staged.

The copies are written once for every device: torch indexing over a byte view
of each layer's storage. On a CUDA cache they run on a side stream that first
waits for the compute stream (the forward that wrote the blocks), into or out
of pinned host memory, and are fenced with an event; on the CPU the same calls
run synchronously and the fence is already passed. So CPU tests run this code.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .layout import BlockLayout, LayoutError

if TYPE_CHECKING:
    import torch


def _word_dtypes() -> dict[int, Any]:
    import torch

    return {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class KVLayer:
    """One layer's KV tensor and where its blocks' bytes are in it."""

    tensor: torch.Tensor
    layout: BlockLayout
    num_blocks: int

    @property
    def piece_len(self) -> int:
        lengths = {length for _, length in self.layout.pieces}
        if len(lengths) != 1:
            raise LayoutError(f"pieces of unequal lengths {sorted(lengths)} cannot be staged")
        return lengths.pop()

    @property
    def word(self) -> int:
        """The widest element size (8, 4, 2 or 1 bytes) that every offset and
        length of this layer's pieces is a multiple of: copies move words, not
        bytes (torch's indexed copies go element by element)."""
        start = self.tensor.storage_offset() * self.tensor.element_size()
        sizes = [start, self.layout.block_stride]
        sizes += [n for piece in self.layout.pieces for n in piece]
        for word in (8, 4, 2):
            if all(n % word == 0 for n in sizes):
                return word
        return 1

    def piece_views(self) -> list[torch.Tensor]:
        """Per piece, a view `[num_blocks, piece_len / word]` of the tensor's
        storage, in words of `word` bytes, whose row b is that piece of block b
        (writes go through)."""
        import torch

        word = self.word
        storage = self.tensor.untyped_storage()
        raw = torch.empty(0, dtype=_word_dtypes()[word], device=self.tensor.device)
        raw.set_(storage, 0, (storage.nbytes() // word,), (1,))
        start = self.tensor.storage_offset() * self.tensor.element_size()
        return [
            raw.as_strided(
                (self.num_blocks, length // word),
                (self.layout.block_stride // word, 1),
                (start + off) // word,
            )
            for off, length in self.layout.pieces
        ]

    def blocks_view(self) -> torch.Tensor | None:
        """A view `[num_blocks, pieces, piece_len / word]` of the storage whose
        element [b, p] is piece p of block b, when the pieces of a block are
        evenly spaced (always so for one or two pieces): then one indexed copy
        moves every piece of the blocks at once. None otherwise."""
        offsets = [off for off, _ in self.layout.pieces]
        steps = {b - a for a, b in itertools.pairwise(offsets)}
        if len(steps) > 1 or any(step <= 0 for step in steps):
            return None
        step = steps.pop() if steps else self.piece_len
        word = self.word
        view = self.piece_views()[0]  # piece 0 of every block
        return view.as_strided(
            (self.num_blocks, len(offsets), self.piece_len // word),
            (self.layout.block_stride // word, step // word, 1),
        )


def hold_bytes(layers: list[KVLayer], num_blocks: int) -> int:
    """Bytes of a hold of `num_blocks` blocks of every layer."""
    return sum(layer.layout.block_bytes for layer in layers) * num_blocks


def hold_refs(region_id: int, layers: list[KVLayer], num_blocks: int) -> list[tuple[int, int, int]]:
    """The block refs of a host buffer laid out as a hold (see the module doc):
    the same count and lengths as the refs of the blocks in place."""
    refs: list[tuple[int, int, int]] = []
    at = 0
    for layer in layers:
        for _ in range(num_blocks):
            for _, length in layer.layout.pieces:
                refs.append((region_id, at, length))
                at += length
    return refs


def hold_select(layers: list[KVLayer], hold_blocks: int, indices: list[int]) -> list[int]:
    """Indices, among a hold's block refs (the order of `hold_refs`), of its
    blocks at `indices` (positions in the hold, in the order the decoder's
    blocks take them) of every layer: what a decoder pulls when it needs only
    some of the hold's blocks (the prompt's first blocks cached here, or a
    sliding-window group's blocks before its window)."""
    if not indices or not all(0 <= i < hold_blocks for i in indices):
        shown = indices if len(indices) <= 8 else [*indices[:8], "..."]
        raise ValueError(f"blocks {shown} of a hold of {hold_blocks} blocks")
    select: list[int] = []
    base = 0
    for layer in layers:
        pieces = len(layer.layout.pieces)
        for index in indices:
            select += range(base + index * pieces, base + (index + 1) * pieces)
        base += hold_blocks * pieces
    return select


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A host byte buffer, pinned when it is copied to or from a GPU (so the
    copies are asynchronous DMA and the transfer backends may register it)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class Fence:
    """The end of copies issued on a side stream: a CUDA event, or nothing for
    copies that ran synchronously (CPU)."""

    def __init__(self, event: Any = None) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class CopyStream:
    """Where the staging copies of one device run."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self._stream: Any = (
            torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            if device.type == "cuda"
            else None
        )

    @classmethod
    def of_layers(cls, layers: list[KVLayer], purpose: str) -> CopyStream:
        """The copy stream of the KV layers' device (the first one's: they are
        on one); ValueError for no layers (`purpose`: what they were for)."""
        if not layers:
            raise ValueError(f"no KV layers {purpose}")
        return cls(layers[0].tensor.device)

    def run(self, copy: Any) -> Fence:
        """Runs `copy()` after everything the compute stream has queued so far
        (on a GPU: on the side stream, asynchronously); returns its fence."""
        if self._stream is None:
            copy()
            return Fence()
        import torch

        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            copy()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return Fence(event)


class _BlockIds:
    """`block_ids` as an index tensor on each device the layers are on, made
    once per copy rather than once per layer (each is a small copy from
    pageable host memory, issued between the layers' copies)."""

    def __init__(self, block_ids: list[int]) -> None:
        self._ids = block_ids
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        ids = self._on.get(device)
        if ids is None:
            import torch

            ids = torch.tensor(self._ids, dtype=torch.long).to(device, non_blocking=True)
            self._on[device] = ids
        return ids


def _hold_parts(
    layers: list[KVLayer], block_ids: list[int], buffer: torch.Tensor
) -> Iterator[tuple[KVLayer, torch.Tensor, torch.Tensor]]:
    """Each layer, with `block_ids` on its device and its part of the host
    `buffer` laid out as a hold, viewed as (block, piece, word). A buffer of
    another size is refused before the first layer."""
    n = len(block_ids)
    if buffer.numel() != hold_bytes(layers, n):
        raise ValueError(f"buffer of {buffer.numel()} bytes for a hold of {hold_bytes(layers, n)}")
    at = 0
    index = _BlockIds(block_ids)
    for layer in layers:
        pieces, length, word = len(layer.layout.pieces), layer.piece_len, layer.word
        size = n * pieces * length
        part = buffer[at : at + size].view(_word_dtypes()[word]).view(n, pieces, length // word)
        yield layer, index.on(layer.tensor.device), part
        at += size


def gather_blocks(layers: list[KVLayer], block_ids: list[int], out: torch.Tensor) -> None:
    """Copies blocks `block_ids` of every layer into the host buffer `out`, laid
    out as a hold. Issue it through `CopyStream.run` on a GPU."""
    import torch

    for layer, ids, dst in _hold_parts(layers, block_ids, out):
        blocks = layer.blocks_view()
        if blocks is not None and layer.tensor.device == out.device:
            torch.index_select(blocks, 0, ids, out=dst)
        elif blocks is not None:
            # Gathered on the cache's device, then one contiguous copy to host.
            dst.copy_(blocks.index_select(0, ids), non_blocking=True)
        else:
            staged = torch.empty(dst.shape, dtype=dst.dtype, device=ids.device)
            for p, view in enumerate(layer.piece_views()):
                staged[:, p, :] = view.index_select(0, ids)
            dst.copy_(staged, non_blocking=True)


def scatter_blocks(layers: list[KVLayer], block_ids: list[int], src: torch.Tensor) -> None:
    """Copies a host buffer laid out as a hold into blocks `block_ids` of every
    layer (the inverse of `gather_blocks`). Issue it through `CopyStream.run`
    on a GPU; the blocks are written once its fence has passed."""
    for layer, ids, host in _hold_parts(layers, block_ids, src):
        # One contiguous copy to the device (a no-op on the CPU), then an
        # indexed write into the blocks (per piece where they are not evenly
        # spaced).
        staged = host.to(layer.tensor.device, non_blocking=True)
        blocks = layer.blocks_view()
        if blocks is not None:
            blocks.index_copy_(0, ids, staged)
        else:
            for p, view in enumerate(layer.piece_views()):
                view.index_copy_(0, ids, staged[:, p, :])


@dataclass(frozen=True)
class HeadShare:
    """What a decoder rank takes from one prefill rank when their TP sizes
    differ: the prefill's pieces cut into `source_parts` equal runs of KV
    heads, of which run `source_index` fills run `local_index` of this rank's
    pieces cut into `local_parts` (equal TP: one run each side)."""

    source_parts: int = 1
    source_index: int = 0
    local_parts: int = 1
    local_index: int = 0


def rank_shares(tp_rank: int, tp_size: int, remote_tp: int) -> list[tuple[int, HeadShare]]:
    """The prefill ranks decoder rank `tp_rank` (of `tp_size`) reads from a
    prefill of `remote_tp` ranks, each with its share. Rank r of a TP group
    holds the r-th run of the KV heads: a decoder of more ranks takes its
    run of one prefill rank's heads (TP 1 -> 2: rank 1 takes the second half
    of rank 0's); one of fewer ranks gathers the runs of several (TP 2 -> 1:
    rank 0's heads then rank 1's)."""
    if remote_tp == tp_size:
        return [(tp_rank, HeadShare())]
    if tp_size % remote_tp == 0:
        k = tp_size // remote_tp
        return [(tp_rank // k, HeadShare(source_parts=k, source_index=tp_rank % k))]
    if remote_tp % tp_size == 0:
        k = remote_tp // tp_size
        return [(tp_rank * k + i, HeadShare(local_parts=k, local_index=i)) for i in range(k)]
    raise ValueError(f"TP {remote_tp} -> {tp_size}: one size must divide the other")


def heads_lead(layer: KVLayer, num_kv_heads: int) -> bool:
    """Whether each piece of this layer's blocks is its KV heads one after
    another (the heads the outermost dimension inside a piece: vLLM's CPU
    cache, HND pages), so that a run of heads is a run of bytes. NHD pages
    (heads inside each token) are not."""
    tensor = layer.tensor
    size = tensor.element_size()
    lengths = {length for _, length in layer.layout.pieces}
    if len(lengths) != 1 or num_kv_heads < 1:
        return False
    if num_kv_heads == 1:
        return True  # the one head is the whole piece
    piece = lengths.pop()
    inside = [
        (stride * size, dim)
        for dim, stride in zip(tensor.shape, tensor.stride(), strict=True)
        if dim > 1 and stride * size * dim <= piece
    ]
    if not inside:
        return False
    stride, dim = max(inside)
    return dim == num_kv_heads and stride * dim == piece


def scatter_heads(
    layers: list[KVLayer], block_ids: list[int], src: torch.Tensor, share: HeadShare
) -> None:
    """Copies a host buffer laid out as the prefill rank's hold (its pieces
    `share.source_parts / share.local_parts` times this rank's) into blocks
    `block_ids` of every layer: the share's run of heads of each piece into
    its run of this rank's pieces."""
    n = len(block_ids)
    if src.numel() != shared_hold_bytes(layers, n, share):
        raise ValueError(
            f"buffer of {src.numel()} bytes for a hold of {shared_hold_bytes(layers, n, share)}"
        )
    at = 0
    index = _BlockIds(block_ids)
    for layer in layers:
        pieces, word = len(layer.layout.pieces), layer.word
        run = layer.piece_len // share.local_parts
        if run * share.local_parts != layer.piece_len or run % word:
            raise ValueError(f"a piece of {layer.piece_len} bytes does not split into the share")
        source_len = run * share.source_parts
        size = n * pieces * source_len
        host = src[at : at + size].view(_word_dtypes()[word]).view(n, pieces, source_len // word)
        take = host[:, :, share.source_index * run // word : (share.source_index + 1) * run // word]
        device = layer.tensor.device
        staged = take.to(device, non_blocking=True)
        ids = index.on(device)
        put = slice(share.local_index * run // word, (share.local_index + 1) * run // word)
        for p, view in enumerate(layer.piece_views()):
            # A column run of the pieces' view: the indexed write goes through.
            view[:, put][ids] = staged[:, p, :]
        at += size


def shared_hold_bytes(layers: list[KVLayer], num_blocks: int, share: HeadShare) -> int:
    """Bytes of the prefill rank's hold of `num_blocks` blocks, for `share`."""
    return (
        sum(
            len(layer.layout.pieces) * layer.piece_len // share.local_parts * share.source_parts
            for layer in layers
        )
        * num_blocks
    )


def shared_hold_refs(
    region_id: int, layers: list[KVLayer], num_blocks: int, share: HeadShare
) -> list[tuple[int, int, int]]:
    """The block refs of a host buffer laid out as the prefill rank's hold
    (`hold_refs` with its piece lengths)."""
    refs: list[tuple[int, int, int]] = []
    at = 0
    for layer in layers:
        length = layer.piece_len // share.local_parts * share.source_parts
        for _ in range(num_blocks * len(layer.layout.pieces)):
            refs.append((region_id, at, length))
            at += length
    return refs
