"""kv_transfer_params of the Connex connector (DESIGN.md), built and checked.

A prefill emits them for every hold; a decoder reads them back, verbatim except
`resume_epoch`, which the router bumps on every resume. The layout keys
(`tp_size`, `block_size`, `num_layers`, `page_bytes`) let a decoder refuse, with a
clear message, a hold it cannot read block for block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ParamsError(ValueError):
    """kv_transfer_params that a decoder cannot act on."""


@dataclass(frozen=True)
class Layout:
    """What must be equal on both sides for blocks to be copied one to one."""

    tp_size: int
    block_size: int
    num_layers: int
    page_bytes: int

    def mismatch(self, remote: Layout) -> str | None:
        """A clear error when `remote` (the prefill's) differs from this (local) one."""
        diffs = [
            f"{name} prefill={getattr(remote, name)} decode={getattr(self, name)}"
            for name in ("tp_size", "block_size", "num_layers", "page_bytes")
            if getattr(remote, name) != getattr(self, name)
        ]
        if not diffs:
            return None
        return (
            "prefill and decode KV layouts differ ("
            + ", ".join(diffs)
            + "); both sides need the same model, TP size and --block-size"
        )


@dataclass(frozen=True)
class RemoteHold:
    """A hold on a prefill instance, as a decoder sees it."""

    transfer_id: str
    remote_ctrl: str
    engine_id: str
    block_ids: list[int]
    num_tokens: int
    backend: str
    lease_s: float
    epoch: int
    layout: Layout

    def ctrl_for_rank(self, tp_rank: int) -> str:
        """Each TP rank of the prefill serves its own shard at port + rank."""
        host, _, port = self.remote_ctrl.rpartition(":")
        return f"{host}:{int(port) + tp_rank}"

    def all_ctrls(self) -> list[str]:
        return [self.ctrl_for_rank(r) for r in range(self.layout.tp_size)]


def hold_params(
    *,
    transfer_id: str,
    remote_ctrl: str,
    engine_id: str,
    block_ids: list[int],
    num_tokens: int,
    backend: str,
    lease_s: float,
    layout: Layout,
) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_ctrl": remote_ctrl,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(block_ids),
        "remote_num_tokens": num_tokens,
        "backend": backend,
        "lease_s": lease_s,
        "resume_epoch": 0,
        "tp_size": layout.tp_size,
        "block_size": layout.block_size,
        "num_layers": layout.num_layers,
        "page_bytes": layout.page_bytes,
    }


def wants_hold(params: dict[str, Any] | None) -> bool:
    """Whether a request asks this engine (a prefill) to hold its prompt KV."""
    return bool(params) and bool(params.get("do_remote_decode"))


def remote_hold(params: dict[str, Any] | None) -> RemoteHold | None:
    """The hold a decode request points at, or None when it is not a P/D request."""
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        block_ids = [int(b) for b in params["remote_block_ids"]]
        hold = RemoteHold(
            transfer_id=str(params["transfer_id"]),
            remote_ctrl=str(params["remote_ctrl"]),
            engine_id=str(params.get("remote_engine_id", "")),
            block_ids=block_ids,
            num_tokens=int(params["remote_num_tokens"]),
            backend=str(params.get("backend", "tcp")),
            lease_s=float(params.get("lease_s", 60)),
            epoch=int(params.get("resume_epoch", 0)),
            layout=Layout(
                tp_size=int(params["tp_size"]),
                block_size=int(params["block_size"]),
                num_layers=int(params["num_layers"]),
                page_bytes=int(params["page_bytes"]),
            ),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ParamsError(f"kv_transfer_params are not a Connex hold: {err!r}") from err
    if hold.epoch < 0 or hold.num_tokens < 0 or ":" not in hold.remote_ctrl:
        raise ParamsError("kv_transfer_params carry a negative count or a bad remote_ctrl")
    return hold
