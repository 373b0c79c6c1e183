"""Staged holds and staged reads on torch CPU tensors: the copy math of every KV
layout vLLM uses, byte-exact round trips through real holds (`connex._transfer`
over loopback), and the life of a staged hold's host buffer.

The staging code runs the same torch calls on a GPU (on a side stream, into
pinned memory, fenced by an event); by default the KV tensors here are on the
CPU and the fence is passed at once. tests/gpu/run runs this file with
CONNEX_TEST_KV_DEVICE=cuda: the same tests, the KV tensors on the GPU."""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch
from connex import _transfer
from connex.adapters.vllm.layout import BlockLayout, block_layout_of
from connex.adapters.vllm.staged_holds import StagedHolds
from connex.adapters.vllm.staged_reads import PullAll, StagedReads
from connex.adapters.vllm.staging import (
    HeadShare,
    KVLayer,
    gather_blocks,
    heads_lead,
    hold_bytes,
    hold_refs,
    hold_select,
    host_buffer,
    rank_shares,
    scatter_blocks,
)
from connex.adapters.vllm.worker import layer_region
from test_layout_tensors import BS, CASES, NB, D, H

SECRET = "staging-test-secret"
DEVICE = torch.device(os.environ.get("CONNEX_TEST_KV_DEVICE", "cpu"))


def make(name: str) -> tuple[torch.Tensor, int]:
    """A KV tensor of layout `name` (zeros) on DEVICE, strides kept."""
    tensor, block_dim = CASES[name]()
    return tensor.to(DEVICE), block_dim


def kv_layer(tensor: torch.Tensor) -> KVLayer:
    return KVLayer(tensor, block_layout_of(tensor, NB), NB)


def random_like(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """`tensor` (same shape and strides) filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (tensor.untyped_storage().nbytes(),), generator=gen)
    tensor.untyped_storage().copy_(raw.to(torch.uint8).untyped_storage())
    return tensor


def block(tensor: torch.Tensor, block_dim: int, b: int) -> bytes:
    """Block b's bytes in logical order (through torch's own indexing)."""
    return tensor.select(block_dim, b).contiguous().view(torch.uint8).cpu().numpy().tobytes()


@pytest.mark.parametrize("name", sorted(CASES))
def test_gathered_blocks_scatter_back_into_exactly_the_target_blocks(name):
    src, block_dim = make(name)
    dst, _ = make(name)
    assert dst.stride() == CASES[name]()[0].stride()
    random_like(src, 1)
    layers_src = [kv_layer(src)]
    # Every layout here has one or two pieces a block: one indexed copy each.
    assert layers_src[0].blocks_view() is not None
    from_ids, to_ids = [4, 1, 3], [0, 5, 2]
    buf = host_buffer(hold_bytes(layers_src, 3), src.device)
    gather_blocks(layers_src, from_ids, buf)
    scatter_blocks([kv_layer(dst)], to_ids, buf)
    for f, t in zip(from_ids, to_ids, strict=True):
        assert block(dst, block_dim, t) == block(src, block_dim, f)
    zero = bytes(len(block(dst, block_dim, 0)))
    for b in set(range(NB)) - set(to_ids):
        assert block(dst, block_dim, b) == zero, f"block {b} was written"


def test_unevenly_spaced_pieces_are_copied_piece_by_piece_and_stay_exact():
    """Every layout of the tests above has one or two pieces per block, copied
    with one indexed copy of all pieces; three pieces at uneven offsets take
    the per-piece path, with the same result."""
    pieces = ((0, 8), (8, 8), (40, 8))  # bytes 16..39 and 48..63 of a block are not KV
    layout = BlockLayout(block_stride=64, pieces=pieces, span=NB * 64)
    src = random_like(torch.zeros(NB * 64, dtype=torch.uint8, device=DEVICE), 70)
    dst = torch.zeros_like(src)
    layer = KVLayer(src, layout, NB)
    assert layer.blocks_view() is None
    buf = host_buffer(hold_bytes([layer], 2), src.device)
    gather_blocks([layer], [4, 1], buf)
    scatter_blocks([KVLayer(dst, layout, NB)], [0, 5], buf)
    got, want = dst.cpu().numpy().tobytes(), src.cpu().numpy().tobytes()
    moved = {(0, 4), (5, 1)}
    for block_at in range(NB):
        source = next((f for t, f in moved if t == block_at), None)
        for off, length in [(0, 16), (16, 24), (40, 8), (48, 16)]:
            chunk = got[block_at * 64 + off : block_at * 64 + off + length]
            is_kv = off in (0, 40)
            if source is not None and is_kv:
                assert chunk == want[source * 64 + off : source * 64 + off + length]
            else:
                assert chunk == bytes(length), f"block {block_at} bytes {off}.. were written"


def test_the_host_buffer_is_laid_out_layer_block_piece_like_the_blocks_in_place():
    """A staged hold and a hold in place send the same bytes in the same order:
    the buffer equals the blocks' bytes read through the in-place refs."""
    import ctypes

    layers = [random_like(CASES["flash_attn_hnd"]()[0], s) for s in (2, 3)]
    ids = [5, 0, 2]
    buf = host_buffer(hold_bytes([kv_layer(t) for t in layers], len(ids)), layers[0].device)
    gather_blocks([kv_layer(t) for t in layers], ids, buf)
    in_place = b"".join(
        ctypes.string_at(region.ptr + off, length)
        for region in (layer_region(t, NB, "tcp") for t in layers)
        for _, off, length in region.refs(0, ids)
    )
    assert buf.numpy().tobytes() == in_place
    refs = hold_refs(7, [kv_layer(t) for t in layers], len(ids))
    assert [length for _, _, length in refs] == [
        length for t in layers for _, _, length in layer_region(t, NB, "tcp").refs(0, ids)
    ]


@pytest.fixture
def holder():
    h = _transfer.Holder(backend="tcp", listen="127.0.0.1:0", retain_s=30, secret=SECRET)
    yield h
    h.close()


@pytest.fixture
def reader():
    return _transfer.Reader(backend="tcp", secret=SECRET)


def tid(name: str) -> str:
    return f"{name}-{_transfer.new_transfer_id()}"


@pytest.mark.parametrize("name", ["flash_attn_hnd", "flashinfer_nhd", "cpu", "mla"])
def test_a_staged_hold_pulled_through_a_staged_read_is_byte_exact(name, holder, reader):
    srcs = [random_like(make(name)[0], s) for s in (10, 11)]
    block_dim = CASES[name]()[1]
    dsts = [make(name)[0] for _ in srcs]
    staged = StagedHolds(holder, [kv_layer(t) for t in srcs])
    transfer_id = tid("staged")
    staged.create(transfer_id, [3, 1])
    # The prefill's blocks are vLLM's again: overwriting them changes nothing held.
    for t in srcs:
        saved = [block(t, block_dim, b) for b in (3, 1)]
        t.zero_()
    pull = StagedReads(reader, [kv_layer(t) for t in dsts]).pull_async(
        holder.ctrl_addr, transfer_id, 0, [4, 0], timeout_s=10
    )
    stats = pull.result()
    assert pull.done()
    assert stats["bytes"] == hold_bytes([kv_layer(t) for t in srcs], 2)
    for t, src_seed in zip(dsts, (10, 11), strict=True):
        original = random_like(make(name)[0], src_seed)
        assert block(t, block_dim, 4) == block(original, block_dim, 3)
        assert block(t, block_dim, 0) == block(original, block_dim, 1)
    del saved


@pytest.mark.parametrize("name", ["flash_attn_hnd", "cpu"])
@pytest.mark.parametrize("direct", [False, True])
def test_a_decoder_with_the_first_blocks_cached_pulls_only_the_rest(name, direct, holder, reader):
    """A partial local prefix hit: of a 4-block hold (two layers), the decoder
    has blocks 0 and 1 and pulls only 2 and 3, through a staged read or
    straight into its cache; the bytes moved are those two blocks' only."""
    srcs = [random_like(make(name)[0], s) for s in (40, 41)]
    block_dim = CASES[name]()[1]
    # Straight into the cache only where tcp may write it: host memory.
    dsts = [CASES[name]()[0] if direct else make(name)[0] for _ in srcs]
    layers = [kv_layer(t) for t in srcs]
    staged = StagedHolds(holder, layers)  # owns the buffer: kept while held
    staged.create(transfer_id := tid("partial"), [5, 0, 3, 1])
    select = hold_select(layers, 4, [2, 3])
    if direct:
        regions = [layer_region(t, NB, "tcp") for t in dsts]
        refs = [
            ref
            for region in regions
            for ref in region.refs(reader.register_region(region.ptr, region.span), [4, 2])
        ]
        stats = reader.pull(holder.ctrl_addr, transfer_id, 0, refs, select=select)
    else:
        pull = StagedReads(reader, [kv_layer(t) for t in dsts]).pull_async(
            holder.ctrl_addr, transfer_id, 0, [4, 2], timeout_s=10, select=select
        )
        stats = pull.result()
    assert stats["bytes"] == hold_bytes(layers, 2)
    zero = bytes(len(block(dsts[0], block_dim, 0)))
    for dst, src in zip(dsts, srcs, strict=True):
        assert block(dst, block_dim, 4) == block(src, block_dim, 3)
        assert block(dst, block_dim, 2) == block(src, block_dim, 1)
        for b in set(range(NB)) - {4, 2}:
            assert block(dst, block_dim, b) == zero, f"block {b} was written"


def test_a_block_range_outside_the_hold_is_refused():
    layers = [kv_layer(make("cpu")[0])]
    for indices in ([3, 4], [-1], []):
        with pytest.raises(ValueError):
            hold_select(layers, 4, indices)


def test_blocks_are_selected_in_the_order_the_decoder_takes_them():
    """A sliding-window group's blocks skip the positions before its window:
    the selection follows the given positions, layer by layer."""
    layers = [kv_layer(make("cpu")[0]), kv_layer(make("cpu")[0])]
    pieces = len(layers[0].layout.pieces)
    select = hold_select(layers, 6, [1, 4, 5])
    per_layer = [i * pieces + k for i in (1, 4, 5) for k in range(pieces)]
    assert select == per_layer + [6 * pieces + i for i in per_layer]


def test_a_staged_hold_reads_like_one_in_place_for_a_direct_reader(holder, reader):
    """A decoder pulling straight into its (host) KV cache cannot tell a staged
    hold from one in place: same block count, lengths and bytes."""
    src = random_like(make("flash_attn_nhd")[0], 20)
    dst = CASES["flash_attn_nhd"]()[0]
    staged = StagedHolds(holder, [kv_layer(src)])  # owns the buffer: kept while held
    staged.create(transfer_id := tid("direct"), [2, 5])
    region = layer_region(dst, NB, "tcp")
    rid = reader.register_region(region.ptr, region.span)
    reader.pull(holder.ctrl_addr, transfer_id, 0, region.refs(rid, [1, 3]))
    assert block(dst, 1, 1) == block(src, 1, 2)
    assert block(dst, 1, 3) == block(src, 1, 5)


def test_a_staged_read_of_a_missing_hold_fails_and_writes_nothing(holder, reader):
    dst = make("cpu")[0]
    pull = StagedReads(reader, [kv_layer(dst)]).pull_async(
        holder.ctrl_addr, tid("missing"), 0, [1], timeout_s=5
    )
    with pytest.raises(_transfer.HoldNotFound):
        pull.result()
    assert pull.done()
    assert not dst.any()


class QueuedReadsReader:
    """The real reader, except that a failed pull's reads stay queued (as a
    Mooncake pull's may) until `ended` is set."""

    def __init__(self, real) -> None:
        self.real, self.ended = real, False
        self.unregistered: list[int] = []

    def register_region(self, ptr: int, length: int) -> int:
        return self.real.register_region(ptr, length)

    def unregister_region(self, region: int) -> bool:
        self.unregistered.append(region)
        return self.real.unregister_region(region)

    def pull_async(self, *args, **kwargs):
        return self.real.pull_async(*args, **kwargs)

    def writing_into(self, blocks) -> bool:
        return not self.ended


def test_a_staged_read_keeps_its_buffer_while_a_failed_pulls_reads_may_land(holder, reader):
    # The host buffer is where queued reads would land: freed (and reused)
    # before they end, a late read would write into someone else's memory.
    queued = QueuedReadsReader(reader)
    dst = make("cpu")[0]
    pull = StagedReads(queued, [kv_layer(dst)]).pull_async(
        holder.ctrl_addr, tid("missing"), 0, [1], timeout_s=5
    )
    deadline = time.monotonic() + 10
    while not pull._pull.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for _ in range(3):
        assert not pull.done(), "a failed pull reported done while its reads may land"
    assert pull._buffer is not None and not queued.unregistered
    queued.ended = True
    assert pull.done()
    assert pull._buffer is None and len(queued.unregistered) == 1
    with pytest.raises(_transfer.HoldNotFound):
        pull.result()
    assert not dst.any()


def freed_until(holder, staged: StagedHolds, transfer_id: str, timeout_s: float = 10) -> None:
    """Frees buffers as the worker does (only what `freed()` reports) until
    `transfer_id` is freed; meanwhile its buffer must stay."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for gone in holder.freed():
            staged.free(gone)
        if not staged.owns(transfer_id):
            return
        time.sleep(0.01)
    raise AssertionError(f"hold {transfer_id} never reported freed")


def test_a_staged_buffer_lives_until_its_last_read_has_stopped(reader):
    # The holder stops serving after its first I/O piece (4 MiB) of this 12 MiB
    # hold: the read stays in flight.
    holder = _transfer.Holder(
        backend="tcp", listen="127.0.0.1:0", retain_s=30, secret=SECRET, stall_after_bytes=1
    )
    try:
        big = torch.zeros(NB, 16, 256, 256, dtype=torch.bfloat16, device=DEVICE)
        src = random_like(big, 30)
        staged = StagedHolds(holder, [kv_layer(src)])
        transfer_id = tid("inflight")
        staged.create(transfer_id, list(range(NB)))
        buffer = weakref.ref(staged._staged[transfer_id].buffer)
        dst = torch.zeros_like(big)
        pull = StagedReads(reader, [kv_layer(dst)]).pull_async(
            holder.ctrl_addr, transfer_id, 0, list(range(NB)), timeout_s=20
        )
        time.sleep(0.5)  # the read is streaming (stalled after its first piece)
        assert not pull.done()  # (within the reader's 10 s I/O timeout)
        assert holder.freed() == [] and staged.owns(transfer_id)
        # Released with the read in flight: the holder fences it, and reports
        # the hold freed only once the read has stopped; only then does the
        # buffer go.
        assert holder.release(transfer_id)
        freed_until(holder, staged, transfer_id)
        assert holder.draining() == 0
        gc.collect()
        assert buffer() is None, "the buffer outlived its hold"
        with pytest.raises(_transfer.TransferError):
            pull.result()
        assert len(staged) == 0 and staged.held_bytes == 0
    finally:
        holder.close()


def test_staged_holds_live_under_the_byte_budget_and_eviction_frees_their_buffers():
    src = random_like(make("cpu")[0], 40)
    per_hold = hold_bytes([kv_layer(src)], 2)
    holder = _transfer.Holder(
        backend="tcp", listen="127.0.0.1:0", retain_s=30, secret=SECRET, budget_bytes=2 * per_hold
    )
    try:
        staged = StagedHolds(holder, [kv_layer(src)])
        ids = [tid(f"budget{i}") for i in range(3)]
        for transfer_id in ids:
            staged.create(transfer_id, [0, 1])
        assert holder.stats()["evictions"] == 1
        freed_until(holder, staged, ids[0])
        assert staged.owns(ids[1]) and staged.owns(ids[2])
        assert staged.held_bytes == 2 * per_hold
        with pytest.raises(_transfer.TransferError):  # over the whole budget: nothing held
            staged.create(tid("huge"), list(range(NB)) * 2)
        assert len(staged) == 2
    finally:
        holder.close()


def test_the_worker_stages_a_hold_in_its_step_and_never_reports_it_as_a_send():
    """Through the connector's worker half: a staged hold is taken in the step
    that computed the prompt, its blocks are free for vLLM at once (never
    reported as finished sending), and dropping it frees its buffer."""
    from connex.adapters.vllm.config import ConnexConfig
    from connex.adapters.vllm.scheduler import ConnexMetadata, HoldSpec
    from connex.adapters.vllm.worker import ConnexWorker
    from harness import free_port

    cache = random_like(make("cpu")[0], 50)
    cfg = ConnexConfig(ctrl_port=free_port(), transfer_secret=SECRET)
    worker = ConnexWorker(cfg, 0, NB, ["l0"], True, False, hold_mode="staged")
    try:
        worker.register_kv_caches({"l0": cache})
        assert worker.staged is not None and worker.holder is not None
        transfer_id = tid("worker")
        worker.bind(ConnexMetadata(holds=[HoldSpec("req-1", transfer_id, [2, 4])]))
        worker.start_load_kv()
        worker.wait_for_save()
        worker.bind(None)
        assert worker.staged.owns(transfer_id)
        expected = block(cache, 0, 2) + block(cache, 0, 4)
        cache.zero_()  # vLLM reuses the blocks
        assert worker.get_finished({"req-1"}) == (set(), set(), set())
        pulled = torch.zeros(len(expected), dtype=torch.uint8)
        reader = _transfer.Reader(backend="tcp", secret=SECRET)
        rid = reader.register_region(pulled.data_ptr(), pulled.numel())
        refs = hold_refs(rid, [kv_layer(cache)], 2)
        reader.pull(worker.holder.ctrl_addr, transfer_id, 0, refs)
        assert pulled.numpy().tobytes() == expected
        # The scheduler drops it (an aborted request): released, then freed.
        worker.bind(ConnexMetadata(drops=[transfer_id]))
        worker.start_load_kv()
        worker.bind(None)
        deadline = time.monotonic() + 10
        while worker.staged.owns(transfer_id) and time.monotonic() < deadline:
            assert worker.get_finished(set()) == (set(), set(), set())
            time.sleep(0.01)
        assert not worker.staged.owns(transfer_id)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("shape", "dtype", "word"),
    [
        ((NB, 4, 64), torch.bfloat16, 8),
        ((NB, 3, 10), torch.bfloat16, 4),
        ((NB, 3, 5), torch.bfloat16, 2),
        ((NB, 3, 5), torch.uint8, 1),
    ],
)
def test_copies_move_the_widest_words_the_layout_allows_and_stay_exact(shape, dtype, word):
    src = random_like(torch.zeros(shape, dtype=dtype, device=DEVICE), 60)
    dst = torch.zeros_like(src)
    assert kv_layer(src).word == word
    buf = host_buffer(hold_bytes([kv_layer(src)], 2), src.device)
    gather_blocks([kv_layer(src)], [5, 2], buf)
    scatter_blocks([kv_layer(dst)], [0, 1], buf)
    assert block(dst, 0, 0) == block(src, 0, 5) and block(dst, 0, 1) == block(src, 0, 2)


def test_each_decoder_rank_reads_the_prefill_ranks_that_hold_its_heads():
    assert rank_shares(1, 2, 2) == [(1, HeadShare())]
    # TP 1 -> 2: both decoder ranks read rank 0, each its half of the heads.
    assert rank_shares(0, 2, 1) == [(0, HeadShare(source_parts=2, source_index=0))]
    assert rank_shares(1, 2, 1) == [(0, HeadShare(source_parts=2, source_index=1))]
    # TP 2 -> 1: the one decoder rank reads both, rank 0's heads first.
    assert rank_shares(0, 1, 2) == [
        (0, HeadShare(local_parts=2, local_index=0)),
        (1, HeadShare(local_parts=2, local_index=1)),
    ]
    # TP 2 -> 4: decoder rank 3 takes the second half of rank 1's heads.
    assert rank_shares(3, 4, 2) == [(1, HeadShare(source_parts=2, source_index=1))]
    with pytest.raises(ValueError, match="divide"):
        rank_shares(0, 2, 3)


def test_heads_lead_the_pieces_of_the_cpu_cache_and_hnd_pages_only():
    assert heads_lead(kv_layer(make("cpu")[0]), H)
    assert heads_lead(kv_layer(make("flash_attn_hnd")[0]), H)
    assert not heads_lead(kv_layer(make("flash_attn_nhd")[0]), H)


def cpu_cache(heads: int) -> torch.Tensor:
    """vLLM's CPU KV cache of one layer: [blocks, heads, block_size, 2 * head_dim]."""
    return torch.zeros(NB, heads, BS, 2 * D, dtype=torch.bfloat16, device=DEVICE)


@pytest.mark.parametrize(("remote_tp", "tp"), [(1, 2), (2, 1)])
def test_a_decoder_of_another_tp_size_gets_exactly_its_heads(remote_tp, tp, reader):
    """Four KV heads split over the prefill's ranks (each holding its blocks
    5, 0 and 3 staged), read into blocks 1, 4 and 2 of each decoder rank:
    every rank ends with exactly its run of the heads of those blocks, and
    nothing else is written."""
    heads = 4
    holders = [
        _transfer.Holder(backend="tcp", listen="127.0.0.1:0", retain_s=30, secret=SECRET)
        for _ in range(remote_tp)
    ]
    try:
        srcs = [random_like(cpu_cache(heads // remote_tp), 50 + r) for r in range(remote_tp)]
        transfer_id = tid("hetero")
        kept = [StagedHolds(h, [kv_layer(t)]) for h, t in zip(holders, srcs, strict=True)]
        for staged in kept:
            staged.create(transfer_id, [5, 0, 3])
        whole = torch.cat(srcs, dim=1)  # every head, in rank order
        for rank in range(tp):
            dst = cpu_cache(heads // tp)
            reads = StagedReads(reader, [kv_layer(dst)])
            pulls = [
                reads.pull_share_async(
                    holders[source].ctrl_addr, transfer_id, 0, [1, 4, 2], share, timeout_s=10
                )
                for source, share in rank_shares(rank, tp, remote_tp)
            ]
            stats = PullAll(pulls).result()
            assert stats["bytes"] == 3 * whole[0].numel() * 2 // min(tp, remote_tp)
            mine = whole[:, rank * heads // tp : (rank + 1) * heads // tp]
            for f, t in zip([5, 0, 3], [1, 4, 2], strict=True):
                # As bits: random bytes make NaNs, which equal nothing.
                got, want = (x.contiguous().view(torch.int16) for x in (dst[t], mine[f]))
                assert torch.equal(got, want), f"rank {rank} block {t}"
            for b in set(range(NB)) - {1, 4, 2}:
                assert not dst[b].any(), f"rank {rank} block {b} was written"
    finally:
        for h in holders:
            h.close()
