"""The worker half of ConnexConnector (in each vLLM worker process).

Owns this rank's KV memory as seen by the transfer crate: on a prefill, a
`Holder` (its control listener on ctrl_port + TP rank) that serves holds on
blocks of the KV cache in place; on a decoder, a `Reader` that pulls a hold's
blocks straight into the blocks the scheduler allocated. Every layer's block is
one region piece per block (two, K and V, when the layout splits them), listed
layer by layer, block by block, so both sides name the same bytes in the same
order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .config import ConnexConfig
from .scheduler import ConnexMetadata, LoadSpec

logger = logging.getLogger("connex.vllm.worker")


@dataclass
class LayerRegion:
    """One layer's KV tensor: where a block's bytes are inside it."""

    ptr: int
    span: int
    # Per block: [(offset of piece, length of piece)], relative to ptr.
    block_stride: int
    pieces: list[tuple[int, int]]

    def refs(self, region_id: int, block_ids: list[int]) -> list[tuple[int, int, int]]:
        return [
            (region_id, b * self.block_stride + off, length)
            for b in block_ids
            for off, length in self.pieces
        ]


def _allow_amx() -> None:
    """Asks Linux for the AMX tile state before the first forward pass.

    vLLM's CPU attention kernel uses AMX where the CPU has it but leaves the
    permission (arch_prctl ARCH_REQ_XCOMP_PERM) to oneDNN, which asks on its first
    bf16 GEMM. A decoder whose first forward is a decode step over pulled KV runs
    that kernel first and dies of SIGILL; asking here, once, avoids it."""
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            torch._C._cpu._init_amx()
    except (ImportError, AttributeError, RuntimeError) as err:
        logger.debug("AMX permission not requested: %s", err)


def layer_region(tensor, num_blocks: int) -> LayerRegion:
    """Finds the block dimension of a KV tensor and the bytes of one block.

    Handles vLLM's block-major layouts: (num_blocks, ...) with a block contiguous
    (CPU, e.g. (blocks, heads, block_size, 2*head_size)), and (2, num_blocks, ...)
    with K and V apart.
    """
    es = tensor.element_size()
    shape, stride = list(tensor.shape), list(tensor.stride())
    span = (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * es
    inner = 1
    if shape[0] == num_blocks:
        for n in shape[1:]:
            inner *= n
        if stride[0] != inner:
            raise ValueError(f"KV block is not contiguous: shape {shape} stride {stride}")
        return LayerRegion(tensor.data_ptr(), span, stride[0] * es, [(0, inner * es)])
    if len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
        for n in shape[2:]:
            inner *= n
        if stride[1] != inner:
            raise ValueError(f"KV block is not contiguous: shape {shape} stride {stride}")
        return LayerRegion(
            tensor.data_ptr(),
            span,
            stride[1] * es,
            [(0, inner * es), (stride[0] * es, inner * es)],
        )
    raise ValueError(f"unsupported KV cache layout: shape {shape} for {num_blocks} blocks")


class ConnexWorker:
    def __init__(
        self,
        cfg: ConnexConfig,
        tp_rank: int,
        num_blocks: int,
        layer_order: list[str],
        is_producer: bool,
        is_consumer: bool,
    ) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.layer_order = layer_order
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.layers: list[LayerRegion] = []
        self.holder = None
        self.reader = None
        self._holder_rids: list[int] = []
        self._reader_rids: list[int] = []
        # Holds: transfer id -> request id, and requests whose hold is freed.
        self._hold_req: dict[str, str] = {}
        self._freed: set[str] = set()
        self._finished: set[str] = set()
        # Loads in flight: request id -> (pending pull, spec).
        self._pulls: dict[str, tuple[object, LoadSpec]] = {}
        self._recved: set[str] = set()
        self._failed: set[str] = set()
        self._meta: ConnexMetadata | None = None

    # ---- setup -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        from connex import _transfer

        _allow_amx()
        names = [n for n in self.layer_order if n in kv_caches] or list(kv_caches)
        seen: set[int] = set()
        for name in names:
            tensor = kv_caches[name]
            if tensor.data_ptr() in seen:
                continue  # layers sharing one KV tensor
            seen.add(tensor.data_ptr())
            self.layers.append(layer_region(tensor, self.num_blocks))
        if self.is_producer:
            self.holder = _transfer.Holder(
                backend=self.cfg.backend,
                listen=self.cfg.ctrl_addr(self.tp_rank),
                retain_s=self.cfg.retain_s,
                release=self.cfg.release,
                budget_bytes=self.cfg.hold_budget_bytes,
                secret=self.cfg.transfer_secret,
            )
            self._holder_rids = [self.holder.register_region(x.ptr, x.span) for x in self.layers]
            logger.info(
                "holding KV for remote decode on %s (%s, retain %ss, %s)",
                self.holder.ctrl_addr,
                self.cfg.backend,
                self.cfg.retain_s,
                self.cfg.release,
            )
        if self.is_consumer:
            self.reader = _transfer.Reader(
                backend=self.cfg.backend, secret=self.cfg.transfer_secret
            )
            self._reader_rids = [self.reader.register_region(x.ptr, x.span) for x in self.layers]

    def _refs(self, rids: list[int], block_ids: list[int]) -> list[tuple[int, int, int]]:
        refs: list[tuple[int, int, int]] = []
        for rid, layer in zip(rids, self.layers, strict=True):
            refs += layer.refs(rid, block_ids)
        return refs

    # ---- per step ----------------------------------------------------------------

    def bind(self, meta: ConnexMetadata) -> None:
        self._meta = meta

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for transfer_id in meta.drops:
            self._drop(transfer_id)
        for load in meta.loads:
            self._start_pull(load)

    def wait_for_save(self) -> None:
        # After the forward: the prompt KV of this step is in place, hold it.
        meta = self._meta
        if meta is None or self.holder is None:
            return
        for hold in meta.holds:
            self.holder.create_hold(hold.transfer_id, self._refs(self._holder_rids, hold.block_ids))
            self._hold_req[hold.transfer_id] = hold.req_id

    def _drop(self, transfer_id: str) -> None:
        if self.holder is not None and transfer_id in self._hold_req:
            # Reported as freed (finished_sending) like any other release.
            self.holder.release(transfer_id)

    def _start_pull(self, load: LoadSpec) -> None:
        if load.error is not None or self.reader is None:
            self._recved.add(load.req_id)
            self._failed.add(load.req_id)
            return
        host, _, port = load.remote_ctrl.rpartition(":")
        ctrl = f"{host}:{int(port) + self.tp_rank}"
        dest = self._refs(self._reader_rids, load.local_block_ids)
        self._pulls[load.req_id] = (
            self.reader.pull_async(
                ctrl, load.transfer_id, load.epoch, dest, timeout_s=self.cfg.pull_timeout_s
            ),
            load,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since last call."""
        sending: set[str] = set()
        if self.holder is not None:
            held = set(self._hold_req.values()) | self._freed
            self._finished |= finished_req_ids & held
            for transfer_id in self.holder.freed():
                req_id = self._hold_req.pop(transfer_id, None)
                if req_id is not None:
                    self._freed.add(req_id)
            # vLLM accepts a finished send only for a request it said finished.
            sending = self._freed & self._finished
            self._freed -= sending
            self._finished -= sending
        for req_id, (pull, load) in list(self._pulls.items()):
            if not pull.done():
                continue
            del self._pulls[req_id]
            self._recved.add(req_id)
            try:
                pull.result()
            except Exception as err:
                logger.error(
                    "kv load failed: request %s, hold %s at %s epoch %s: %s",
                    req_id,
                    load.transfer_id,
                    load.remote_ctrl,
                    load.epoch,
                    err,
                )
                self._failed.add(req_id)
        recving, failed = self._recved, self._failed
        self._recved, self._failed = set(), set()
        return sending, recving, failed

    def shutdown(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None
