"""Device-aware reads: a decoder whose KV cache is on a GPU, with a backend
that cannot write GPU memory (tcp, or UCX/Mooncake without CUDA support), pulls
a hold into a pinned host buffer and then copies it into its device blocks
(host to device, on a side stream). The load is finished, and so the request
may run, only once that copy's fence has passed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .staging import (
    CopyStream,
    Fence,
    HeadShare,
    KVLayer,
    hold_bytes,
    hold_refs,
    host_buffer,
    scatter_blocks,
    scatter_heads,
    shared_hold_bytes,
    shared_hold_refs,
)

if TYPE_CHECKING:
    import torch

    from connex import _transfer


class StagedPull:
    """A pull into a host buffer followed by its copy into the blocks
    (`scatter`, given the buffer); `done()` and `result()` as `_transfer.Pull`'s."""

    def __init__(
        self,
        reader: _transfer.Reader,
        stream: CopyStream,
        scatter: Callable[[torch.Tensor], None],
        buffer: torch.Tensor,
        region_id: int,
        refs: list[tuple[int, int, int]],
        pull: _transfer.Pull,
    ) -> None:
        self._reader, self._stream, self._scatter = reader, stream, scatter
        self._buffer: torch.Tensor | None = buffer
        self._region: int | None = region_id
        self._refs = refs
        self._pull = pull
        self._fence: Fence | None = None
        self._stats: dict[str, Any] | None = None
        self._error: BaseException | None = None

    def _advance(self, wait: bool) -> None:
        """Moves on as far as it can (waiting for the pull when `wait`)."""
        if self._stats is None and self._error is None and (wait or self._pull.done()):
            try:
                self._stats = self._pull.result()
            except Exception as err:
                self._error = err
        if self._region is not None and (self._stats is not None or self._error is not None):
            # A failed Mooncake pull may return with reads still queued: the
            # buffer (and its registration) stays until they have ended, or
            # a late read would land in freed memory.
            if self._error is not None and self._reader.writing_into(self._refs):
                return
            self._reader.unregister_region(self._region)
            self._region = None
        buffer = self._buffer
        if self._fence is None and self._error is None and self._stats is not None:
            if buffer is not None:
                try:
                    self._fence = self._stream.run(lambda: self._scatter(buffer))
                except Exception as err:
                    self._error = err
        if self._region is None and (
            self._error is not None or (self._fence is not None and self._fence.done())
        ):
            self._buffer = None  # no copy reads it, no read writes it any more

    def done(self) -> bool:
        self._advance(wait=False)
        if self._error is not None:
            return self._region is None
        return self._fence is not None and self._fence.done()

    def result(self) -> dict[str, Any]:
        """Waits for the pull and the device copy; their stats, or the error."""
        self._advance(wait=True)
        if self._error is not None:
            raise self._error
        assert self._fence is not None and self._stats is not None
        self._fence.wait()
        self._buffer = None
        return self._stats


class StagedReads:
    """Starts staged pulls for one reader and its KV layers."""

    def __init__(self, reader: _transfer.Reader, layers: list[KVLayer]) -> None:
        self._stream = CopyStream.of_layers(layers, "to read into")
        self._reader = reader
        self._layers = layers

    def pull_async(
        self,
        remote_ctrl: str,
        transfer_id: str,
        epoch: int,
        block_ids: list[int],
        timeout_s: float,
        select: list[int] | None = None,
    ) -> StagedPull:
        layers = self._layers
        return self._start(
            remote_ctrl,
            transfer_id,
            epoch,
            hold_bytes(layers, len(block_ids)),
            lambda region: hold_refs(region, layers, len(block_ids)),
            lambda buffer: scatter_blocks(layers, block_ids, buffer),
            timeout_s,
            select,
        )

    def pull_share_async(
        self,
        remote_ctrl: str,
        transfer_id: str,
        epoch: int,
        block_ids: list[int],
        share: HeadShare,
        timeout_s: float,
        select: list[int] | None = None,
    ) -> StagedPull:
        """A pull of a prefill rank's hold whose TP size differs from this
        rank's: its blocks land in a host buffer, and this rank's share of
        their heads is copied into blocks `block_ids`."""
        layers, n = self._layers, len(block_ids)
        return self._start(
            remote_ctrl,
            transfer_id,
            epoch,
            shared_hold_bytes(layers, n, share),
            lambda region: shared_hold_refs(region, layers, n, share),
            lambda buffer: scatter_heads(layers, block_ids, buffer, share),
            timeout_s,
            select,
        )

    def _start(
        self,
        remote_ctrl: str,
        transfer_id: str,
        epoch: int,
        nbytes: int,
        refs_of: Callable[[int], list[tuple[int, int, int]]],
        scatter: Callable[[torch.Tensor], None],
        timeout_s: float,
        select: list[int] | None,
    ) -> StagedPull:
        buffer = host_buffer(nbytes, self._stream.device)
        region = self._reader.register_region(buffer.data_ptr(), buffer.numel())
        refs = refs_of(region)
        try:
            pull = self._reader.pull_async(
                remote_ctrl, transfer_id, epoch, refs, timeout_s=timeout_s, select=select
            )
        except Exception:
            self._reader.unregister_region(region)
            raise
        return StagedPull(self._reader, self._stream, scatter, buffer, region, refs, pull)


class PullAll:
    """Several pulls that make one load (a decoder gathering its KV heads from
    the ranks of a prefill of a larger TP size): done when all are, their
    stats summed, the first error raised once every pull has ended."""

    def __init__(self, pulls: list[StagedPull], failed: BaseException | None = None) -> None:
        self._pulls = pulls
        # A pull that could not start: the load fails once the others end.
        self._failed = failed

    def done(self) -> bool:
        return all(p.done() for p in self._pulls)

    def result(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        error: BaseException | None = self._failed
        for pull in self._pulls:
            try:
                stats = pull.result()
            except Exception as err:
                error = error or err
                continue
            for key, value in stats.items():
                if key == "elapsed_s":
                    # The pulls run side by side: the load took the longest.
                    total[key] = max(total.get(key, 0.0), value)
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
                else:
                    total.setdefault(key, value)
        if error is not None:
            raise error
        return total
