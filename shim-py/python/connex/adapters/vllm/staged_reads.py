"""Device-aware reads: a decoder whose KV cache is on a GPU, with a backend
that cannot write GPU memory (tcp, or UCX/Mooncake without CUDA support), pulls
a hold into a pinned host buffer and then copies it into its device blocks
(host to device, on a side stream). The load is finished, and so the request
may run, only once that copy's fence has passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .staging import CopyStream, Fence, KVLayer, hold_bytes, hold_refs, host_buffer, scatter_blocks

if TYPE_CHECKING:
    import torch

    from connex import _transfer


class StagedPull:
    """A pull into a host buffer followed by its copy into the device blocks;
    `done()` and `result()` as `_transfer.Pull`'s."""

    def __init__(
        self,
        reader: _transfer.Reader,
        stream: CopyStream,
        layers: list[KVLayer],
        block_ids: list[int],
        buffer: torch.Tensor,
        region_id: int,
        refs: list[tuple[int, int, int]],
        pull: _transfer.Pull,
    ) -> None:
        self._reader, self._stream, self._layers = reader, stream, layers
        self._block_ids = block_ids
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
                    self._fence = self._stream.run(
                        lambda: scatter_blocks(self._layers, self._block_ids, buffer)
                    )
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
        if not layers:
            raise ValueError("no KV layers to read into")
        self._reader = reader
        self._layers = layers
        self._stream = CopyStream(layers[0].tensor.device)

    def pull_async(
        self,
        remote_ctrl: str,
        transfer_id: str,
        epoch: int,
        block_ids: list[int],
        timeout_s: float,
        select: list[int] | None = None,
    ) -> StagedPull:
        buffer = host_buffer(hold_bytes(self._layers, len(block_ids)), self._stream.device)
        region = self._reader.register_region(buffer.data_ptr(), buffer.numel())
        refs = hold_refs(region, self._layers, len(block_ids))
        try:
            pull = self._reader.pull_async(
                remote_ctrl, transfer_id, epoch, refs, timeout_s=timeout_s, select=select
            )
        except Exception:
            self._reader.unregister_region(region)
            raise
        return StagedPull(
            self._reader, self._stream, self._layers, block_ids, buffer, region, refs, pull
        )
