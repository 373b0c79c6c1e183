"""The worker half of ConnexConnector (in each vLLM worker process).

Owns this rank's KV memory as seen by the transfer crate: on a prefill, a
`Holder` (its control listener on ctrl_port + TP rank) that serves holds on
blocks of the KV cache in place (`hold: in_place`) or on host copies of them
(`hold: staged`, `staged_holds.py`); on a decoder, a `Reader` that pulls a
hold's blocks straight into the blocks the scheduler allocated, or, for a KV
cache on a GPU the backend cannot write, into host memory and then onto the
device (`staged_reads.py`). Every layer's block is one region piece per block
(two, K and V, when the layout splits them), listed layer by layer, block by
block, so both sides name the same bytes in the same order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .config import ConnexConfig
from .layout import BlockLayout, block_layout_of, tensor_layout
from .params import ParamsError, check_epoch, check_transfer_id, ctrl_for_rank
from .staged_holds import StagedHolds
from .staged_reads import PullAll, StagedPull, StagedReads
from .staging import KVLayer, heads_lead, hold_select, rank_shares

if TYPE_CHECKING:
    import torch

    from connex import _transfer

    # Only in annotations: the scheduler half imports vLLM, and the worker's
    # copy and transfer code runs without it (tests/gpu/run, on a GPU machine
    # whose image has torch but no vLLM).
    from .scheduler import ConnexMetadata, LoadSpec

    # A load in flight: straight into the cache, through a host buffer, or
    # through several (a prefill of another TP size).
    AnyPull = _transfer.Pull | StagedPull | PullAll

logger = logging.getLogger("connex.vllm.worker")

# Blocks as the transfer library takes them: (region, offset, length).
Refs = list[tuple[int, int, int]]

# Seconds between two reads of the holder's counters (a call into the
# transfer runtime), for the holds gauges.
HOLDER_SAMPLE_S = 0.2
# Pull latencies kept between two reports (the counts stay exact).
MAX_LATENCIES = 1024


@dataclass
class TransferCounters:
    """What this worker pulled and holds since its last report (stats.py)."""

    pulls: int = 0
    pull_failures: int = 0
    pulled_bytes: int = 0
    evictions: int = 0
    pull_seconds: list[float] = field(default_factory=list)
    # The holder's gauges, when they changed since the last report.
    holds: int | None = None
    held_bytes: int | None = None

    def pulled(self, result: dict[str, Any]) -> None:
        self.pulls += 1
        self.pulled_bytes += int(result.get("bytes", 0))
        if len(self.pull_seconds) < MAX_LATENCIES:
            self.pull_seconds.append(float(result.get("elapsed_s", 0.0)))


@dataclass
class LayerRegion:
    """One layer's KV tensor: its address and where a block's bytes are in it."""

    ptr: int
    layout: BlockLayout

    @property
    def span(self) -> int:
        return self.layout.span

    def refs(self, region_id: int, block_ids: list[int]) -> list[tuple[int, int, int]]:
        stride = self.layout.block_stride
        return [
            (region_id, b * stride + off, length)
            for b in block_ids
            for off, length in self.layout.pieces
        ]


def layer_region(
    tensor: torch.Tensor, num_blocks: int, backend: str = "tcp", moves_device_memory: bool = False
) -> LayerRegion:
    """A layer's KV tensor as a region: addressing from its shape and strides
    (layout.py), after checking that `backend` can move its memory."""
    layout = tensor_layout(tensor, num_blocks, backend, moves_device_memory)
    return LayerRegion(tensor.data_ptr(), layout)


def request_amx_permission() -> None:
    """Asks Linux for this process's x86 AMX permission now, before the transfer
    runtime starts its threads.

    vLLM's CPU attention uses AMX where the CPU has it and asks for the
    permission (arch_prctl) lazily, at its first AMX call. The kernel refuses it
    once the process has threads whose signal stacks are too small for AMX state,
    as the transfer runtime's threads are, and the first AMX instruction then
    kills the worker with SIGILL (seen on a Sapphire Rapids VM: the decoder died
    at its first step after a pull). A permission granted earlier stays granted.
    """
    try:
        import torch

        init_amx = getattr(torch._C._cpu, "_init_amx", None)
        if init_amx is not None and torch.cpu._is_amx_tile_supported():
            if not init_amx():
                logger.warning("x86 AMX is present but the kernel refused its permission")
    except Exception as err:  # no torch build with AMX support: nothing to ask for
        logger.debug("AMX permission not requested: %s", err)


class ConnexWorker:
    def __init__(
        self,
        cfg: ConnexConfig,
        tp_rank: int,
        num_blocks: int,
        layer_order: list[str],
        is_producer: bool,
        is_consumer: bool,
        hold_mode: str | None = None,
        tp_size: int = 1,
        kv_heads: int = 0,
    ) -> None:
        self.cfg = cfg
        self.hold_mode = hold_mode or cfg.hold
        self.tp_rank = tp_rank
        # This engine's TP size and KV heads per rank: a prefill of another TP
        # size is read by runs of heads (`rank_shares`).
        self.tp_size = tp_size
        self.kv_heads = kv_heads
        self.num_blocks = num_blocks
        self.layer_order = layer_order
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.layers: list[LayerRegion] = []
        self.kv_layers: list[KVLayer] = []
        self.holder: _transfer.Holder | None = None
        self.staged: StagedHolds | None = None
        self.staged_reads: StagedReads | None = None
        # Reads of a prefill of another TP size: through host buffers, whatever
        # the device (made at the first such load).
        self._share_reads: StagedReads | None = None
        self.reader: _transfer.Reader | None = None
        self._holder_rids: list[int] = []
        self._reader_rids: list[int] = []
        # Holds: transfer id -> request id, and requests whose hold is freed.
        self._hold_req: dict[str, str] = {}
        self._freed: set[str] = set()
        self._finished: set[str] = set()
        # Loads in flight: request id -> (pending pull, spec).
        self._pulls: dict[str, tuple[AnyPull, LoadSpec, Refs | None]] = {}
        # Failed loads whose reads may still write into their blocks (a
        # Mooncake read cannot be cancelled): request id -> (blocks, since).
        # Reported to vLLM only once nothing can write there any more: until
        # then the blocks stay the request's, never another's.
        self._draining: dict[str, tuple[Refs, float]] = {}
        self._recved: set[str] = set()
        self._failed: set[str] = set()
        self._meta: ConnexMetadata | None = None
        self.counters = TransferCounters()
        self._holder_sampled = 0.0
        self._holder_seen: dict[str, int] = {}

    # ---- setup -------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        request_amx_permission()

        names = [n for n in self.layer_order if n in kv_caches] or list(kv_caches)
        seen: set[int] = set()
        tensors = []
        for name in names:
            tensor = kv_caches[name]
            if tensor.data_ptr() in seen:
                continue  # layers sharing one KV tensor
            seen.add(tensor.data_ptr())
            tensors.append(tensor)
        kv_layers = [
            KVLayer(t, block_layout_of(t, self.num_blocks), self.num_blocks) for t in tensors
        ]
        self.kv_layers = kv_layers
        if self.is_producer:
            self._start_holder(tensors, kv_layers)
        if self.is_consumer:
            self._start_reader(tensors, kv_layers)

    def _start_holder(self, tensors: list[torch.Tensor], kv_layers: list[KVLayer]) -> None:
        from connex import _transfer

        staged = self.hold_mode == "staged"
        self._publish_mooncake_host()
        if not staged:
            # Refused before anything listens: in place, the holder reads the
            # KV cache's own addresses. (A backend that moves device memory
            # reports so only once started; the tcp check needs no start.)
            for tensor in tensors:
                tensor_layout(tensor, self.num_blocks, self.cfg.backend, moves_device_memory=True)
        holder = _transfer.Holder(
            backend=self.cfg.backend,
            listen=self.cfg.ctrl_addr(self.tp_rank),
            retain_s=self.cfg.retain_s,
            release=self.cfg.release,
            budget_bytes=self.cfg.hold_budget_bytes,
            secret=self.cfg.transfer_secret,
        )
        try:
            if staged:
                self.staged = StagedHolds(holder, kv_layers)
            else:
                self.layers = [
                    layer_region(t, self.num_blocks, self.cfg.backend, holder.moves_device_memory)
                    for t in tensors
                ]
                self._holder_rids = [holder.register_region(x.ptr, x.span) for x in self.layers]
        except Exception:
            holder.close()
            raise
        self.holder = holder
        logger.info(
            "holding KV for remote decode on %s (%s, %s holds, retain %ss, %s)",
            holder.ctrl_addr,
            self.cfg.backend,
            self.hold_mode,
            self.cfg.retain_s,
            self.cfg.release,
        )

    def _start_reader(self, tensors: list[torch.Tensor], kv_layers: list[KVLayer]) -> None:
        from connex import _transfer

        self._publish_mooncake_host()
        reader = _transfer.Reader(backend=self.cfg.backend, secret=self.cfg.transfer_secret)
        device = tensors[0].device if tensors else None
        if device is not None and device.type != "cpu" and not reader.moves_device_memory:
            self.staged_reads = StagedReads(reader, kv_layers)
            logger.info(
                "KV cache on %s, %s backend without device memory support: pulls land in "
                "pinned host memory and are copied to the device",
                device,
                self.cfg.backend,
            )
        else:
            if device is not None and device.type != "cpu":
                logger.info(
                    "KV cache on %s: the %s backend writes device memory directly",
                    device,
                    self.cfg.backend,
                )
            if not self.layers:
                self.layers = [
                    layer_region(t, self.num_blocks, self.cfg.backend, reader.moves_device_memory)
                    for t in tensors
                ]
            self._reader_rids = [reader.register_region(x.ptr, x.span) for x in self.layers]
        self.reader = reader

    def _publish_mooncake_host(self) -> None:
        host = self.cfg.publish_mooncake_host()
        if host is not None:
            logger.info("mooncake: this engine publishes %s (the connector's host)", host)

    def _refs(self, rids: list[int], block_ids: list[int]) -> Refs:
        refs: Refs = []
        for rid, layer in zip(rids, self.layers, strict=True):
            refs += layer.refs(rid, block_ids)
        return refs

    # ---- per step ----------------------------------------------------------------

    def bind(self, meta: ConnexMetadata | None) -> None:
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
            if self.staged is not None:
                self._stage(hold.req_id, hold.transfer_id, hold.block_ids)
                continue
            try:
                self.holder.create_hold(
                    hold.transfer_id, self._refs(self._holder_rids, hold.block_ids)
                )
            except Exception as err:
                # No hold: a decoder's pull of it fails cleanly (not found), and
                # the request's blocks go back to vLLM now rather than never.
                logger.error(
                    "could not hold KV of request %s (%s): %s", hold.req_id, hold.transfer_id, err
                )
                self._freed.add(hold.req_id)
                continue
            self._hold_req[hold.transfer_id] = hold.req_id

    def _stage(self, req_id: str, transfer_id: str, block_ids: list[int]) -> None:
        """A staged hold: copied now, so vLLM may reuse the blocks as soon as
        this step ends (the scheduler does not keep them)."""
        assert self.staged is not None
        self._collect_freed()  # buffers of holds that ended go first
        try:
            self.staged.create(transfer_id, block_ids)
        except Exception as err:
            # No hold: a decoder's pull of it fails cleanly (not found).
            logger.error("could not stage KV of request %s (%s): %s", req_id, transfer_id, err)

    def _drop(self, transfer_id: str) -> None:
        staged = self.staged is not None and self.staged.owns(transfer_id)
        if self.holder is not None and (staged or transfer_id in self._hold_req):
            # Reported as freed (finished_sending) like any other release.
            try:
                self.holder.release(transfer_id)
            except Exception as err:  # the lease frees it at the latest
                logger.error("could not drop hold %s: %s", transfer_id, err)

    def _collect_freed(self) -> None:
        """Takes the holds the holder freed (their last read has stopped): a
        staged hold's buffer is freed now; a hold in place gives its request's
        blocks back to vLLM (finished_sending, once vLLM said it finished)."""
        if self.holder is None:
            return
        for transfer_id in self.holder.freed():
            if self.staged is not None and self.staged.free(transfer_id):
                continue
            req_id = self._hold_req.pop(transfer_id, None)
            if req_id is not None:
                self._freed.add(req_id)

    def _start_pull(self, load: LoadSpec) -> None:
        """Starts the pull of `load`, or fails it at once: whatever the spec holds,
        the outcome is a finished (maybe failed) load, never an exception in the
        worker's step."""
        if load.error is None and self.reader is None:
            load.error = "this engine is not a KV consumer (kv_role)"
        if load.error is None and self.reader is not None:
            try:
                pull, dest = self._pull(load)
            except Exception as err:
                load.error = str(err) or type(err).__name__
            else:
                self._pulls[load.req_id] = (pull, load, dest)
                return
        logger.error("kv load failed: request %s: %s", load.req_id, load.error)
        self.counters.pull_failures += 1
        self._recved.add(load.req_id)
        self._failed.add(load.req_id)

    def _pull(self, load: LoadSpec) -> tuple[AnyPull, Refs | None]:
        """Starts the pull of `load` into its local blocks, directly (with the
        blocks it writes) or through host memory (the staged pull watches its
        own buffer), after checking its arguments (the scheduler checked them
        too; this side must not trust a pickle)."""
        assert self.reader is not None
        check_transfer_id(load.transfer_id)
        check_epoch(load.epoch)
        ids = load.local_block_ids
        if not isinstance(ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < self.num_blocks for b in ids
        ):
            raise ParamsError(f"local block ids outside this engine's {self.num_blocks} blocks")
        select = self._select(load)
        timeout_s = self.cfg.pull_timeout_s
        remote_tp = load.remote_tp or self.tp_size
        if remote_tp != self.tp_size:
            return self._pull_shares(load, remote_tp, select), None
        ctrl = ctrl_for_rank(load.remote_ctrl, self.tp_rank)
        if self.staged_reads is not None:
            staged = self.staged_reads.pull_async(
                ctrl, load.transfer_id, load.epoch, ids, timeout_s=timeout_s, select=select
            )
            return staged, None
        dest = self._refs(self._reader_rids, ids)
        pull = self.reader.pull_async(
            ctrl, load.transfer_id, load.epoch, dest, timeout_s=timeout_s, select=select
        )
        return pull, dest

    def _pull_shares(self, load: LoadSpec, remote_tp: int, select: list[int] | None) -> PullAll:
        """Pulls from a prefill of another TP size: from each prefill rank that
        holds some of this rank's KV heads, its blocks into a host buffer, of
        which this rank's heads are copied into its blocks (TP 1 -> 2: half of
        rank 0's blocks' bytes are this rank's; TP 2 -> 1: both ranks' blocks,
        side by side)."""
        assert self.reader is not None
        if not isinstance(remote_tp, int) or isinstance(remote_tp, bool) or remote_tp < 1:
            raise ParamsError("the prefill's TP size is not a positive integer")
        try:
            shares = rank_shares(self.tp_rank, self.tp_size, remote_tp)
        except ValueError as err:
            raise ParamsError(str(err)) from err
        if not all(heads_lead(layer, self.kv_heads) for layer in self.kv_layers):
            raise ParamsError(
                f"TP {remote_tp} -> {self.tp_size} needs KV pages whose heads lead each "
                "piece (vLLM's CPU cache, HND pages); this engine's pages keep the heads "
                "inside each token (NHD)"
            )
        if self._share_reads is None:
            self._share_reads = StagedReads(self.reader, self.kv_layers)
        pulls = []
        for rank, share in shares:
            try:
                pulls.append(
                    self._share_reads.pull_share_async(
                        ctrl_for_rank(load.remote_ctrl, rank),
                        load.transfer_id,
                        load.epoch,
                        load.local_block_ids,
                        share,
                        timeout_s=self.cfg.pull_timeout_s,
                        select=select,
                    )
                )
            except Exception as err:
                # The pulls started run to their end (their buffers with
                # them); the load then fails with this error.
                return PullAll(pulls, failed=err)
        return PullAll(pulls)

    def _select(self, load: LoadSpec) -> list[int] | None:
        """The hold's block refs to pull when `load` needs only some of its
        blocks (the prompt's first blocks are cached here, or a sliding-window
        group's blocks before its window are never read): None for all."""
        indices, total = load.hold_indices, load.hold_blocks
        if (
            not isinstance(indices, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices)
            or not isinstance(total, int)
            or isinstance(total, bool)
        ):
            raise ParamsError("hold block positions are not integers")
        if len(indices) != len(load.local_block_ids):
            raise ParamsError(
                f"{len(indices)} hold blocks for {len(load.local_block_ids)} local blocks"
            )
        if indices == list(range(total)):
            return None
        try:
            return hold_select(self.kv_layers, total, indices)
        except ValueError as err:
            raise ParamsError(f"blocks to load: {err}") from err

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since last call."""
        sending: set[str] = set()
        if self.holder is not None:
            held = set(self._hold_req.values()) | self._freed
            self._finished |= finished_req_ids & held
            self._collect_freed()
            # vLLM accepts a finished send only for a request it said finished.
            sending = self._freed & self._finished
            self._freed -= sending
            self._finished -= sending
        for req_id, (pull, load, dest) in list(self._pulls.items()):
            if not pull.done():
                continue
            del self._pulls[req_id]
            try:
                self.counters.pulled(pull.result())
            except Exception as err:
                self.counters.pull_failures += 1
                logger.error(
                    "kv load failed: request %s, hold %s at %s epoch %s: %s",
                    req_id,
                    load.transfer_id,
                    load.remote_ctrl,
                    load.epoch,
                    err,
                )
                if dest is not None and self._writing_into(dest):
                    logger.warning(
                        "kv load of request %s failed with reads still queued: its blocks "
                        "stay with it until those reads end",
                        req_id,
                    )
                    self._draining[req_id] = (dest, time.monotonic())
                    continue
                self._failed.add(req_id)
            self._recved.add(req_id)
        for req_id, (dest, since) in list(self._draining.items()):
            if self._writing_into(dest):
                continue
            del self._draining[req_id]
            logger.info(
                "queued reads of request %s ended after %.1f s: its failed load is reported",
                req_id,
                time.monotonic() - since,
            )
            self._recved.add(req_id)
            self._failed.add(req_id)
        recving, failed = self._recved, self._failed
        self._recved, self._failed = set(), set()
        return sending, recving, failed

    def _writing_into(self, dest: Refs) -> bool:
        """Whether a pull may still write into `dest` (see `_draining`)."""
        return self.reader is not None and self.reader.writing_into(dest)

    def take_stats(self) -> dict[str, Any] | None:
        """What changed since the last call, as ConnexKVStats data; None when
        nothing did."""
        self._sample_holder()
        c, self.counters = self.counters, TransferCounters()
        data: dict[str, Any] = {
            "pulls": c.pulls,
            "pull_failures": c.pull_failures,
            "pulled_bytes": c.pulled_bytes,
            "evictions": c.evictions,
            "pull_seconds": c.pull_seconds,
            "holds": {} if c.holds is None else {str(self.tp_rank): c.holds},
            "held_bytes": {} if c.held_bytes is None else {str(self.tp_rank): c.held_bytes},
        }
        changed = c.pulls or c.pull_failures or c.evictions or data["holds"] or data["held_bytes"]
        return data if changed else None

    def _sample_holder(self) -> None:
        """Reads the holder's counters, at most every HOLDER_SAMPLE_S."""
        now = time.monotonic()
        if self.holder is None or now - self._holder_sampled < HOLDER_SAMPLE_S:
            return
        self._holder_sampled = now
        try:
            stats = self.holder.stats()
        except Exception as err:  # metrics are best effort
            logger.debug("holder stats unavailable: %s", err)
            return
        seen = self._holder_seen
        self.counters.evictions += max(0, int(stats["evictions"]) - seen.get("evictions", 0))
        if int(stats["holds"]) != seen.get("holds"):
            self.counters.holds = int(stats["holds"])
        if int(stats["held_bytes"]) != seen.get("held_bytes"):
            self.counters.held_bytes = int(stats["held_bytes"])
        self._holder_seen = {k: int(stats[k]) for k in ("evictions", "holds", "held_bytes")}

    def shutdown(self) -> None:
        if self.holder is not None:
            self.holder.close()
            self.holder = None
