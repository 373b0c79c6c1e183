"""kv_transfer_params of the Connex connector (docs/architecture.md), built and checked.

A prefill emits them for every hold; a decoder reads them back, verbatim except
`resume_epoch`, which the router bumps on every resume. The layout keys
(`tp_size`, `block_size`, `num_layers`, `page_bytes`, `kv_groups`) let a decoder refuse, with a
clear message, a hold it cannot read block for block.

They arrive in a client's request body, so every field is checked here, once,
before anything uses it: a value of the wrong type, out of range, NaN or
Infinity, or too large is a `ParamsError` (the scheduler turns it into a failed
load under `kv_load_failure_policy`), never an exception inside vLLM's scheduler
or worker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The bounds of the hold control protocol (transfer/src/proto.rs).
MAX_TRANSFER_ID_LEN = 256
MAX_BLOCKS = 65_536
MAX_EPOCH = 2**32 - 1
# Generous caps that no real model reaches; they keep arithmetic on the values
# small and their error messages short.
MAX_TEXT_LEN = 1024
MAX_TP_SIZE = 1024
MAX_BLOCK_SIZE = 1 << 20
MAX_LAYERS = 1 << 16
MAX_PAGE_BYTES = 1 << 40
# KV cache groups of one model (vLLM's hybrid KV cache manager: one per kind
# of attention, e.g. full and sliding-window layers).
MAX_KV_GROUPS = 64
MAX_LEASE_S = 7 * 24 * 3600.0
MAX_TOKENS = MAX_BLOCKS * MAX_BLOCK_SIZE
BACKENDS = ("tcp", "ucx", "mooncake")
# The names of a layout's compatibility fingerprint (`Layout.compat`), each a
# short string; a prefill's params may carry these and no others.
COMPAT_KEYS = (
    "vllm",
    "model",
    "attn_backend",
    "kv_cache_layout",
    "kv_cache_dtype",
    "kv_heads",
    "head_size",
    "kv_groups",
)
MAX_COMPAT_VALUE_LEN = 256


class ParamsError(ValueError):
    """kv_transfer_params that a decoder cannot act on."""


@dataclass(frozen=True)
class Layout:
    """What must be equal on both sides for blocks to be copied one to one."""

    tp_size: int
    block_size: int
    num_layers: int
    page_bytes: int
    # The KV cache's element type ("bfloat16"): float16 and bfloat16 caches have
    # the same page bytes and would be copied one to one into garbage. Empty when
    # unknown (a prefill of an older Connex): not compared then.
    dtype: str = ""
    # What else decides what a block's bytes mean, by name (`COMPAT_KEYS`):
    # two engines whose pages have the same size but another vLLM, model,
    # attention backend, KV cache layout (NHD/HND) or cache dtype would copy
    # bytes that mean something else. A name one side lacks (a prefill of an
    # older Connex) is not compared.
    compat: tuple[tuple[str, str], ...] = ()
    # KV cache groups (vLLM's hybrid KV cache manager): a hold's blocks are
    # each group's, one group after another, every group as long.
    kv_groups: int = 1

    def mismatch(self, remote: Layout) -> str | None:
        """A clear error when `remote` (the prefill's) differs from this (local)
        one. Another TP size is read by runs of KV heads (one size dividing the
        other, the same heads split over each side's ranks: page bytes times
        TP size, and KV heads times TP size, equal)."""
        diffs = [
            f"{name} prefill={getattr(remote, name)} decode={getattr(self, name)}"
            for name in ("block_size", "num_layers", "kv_groups")
            if getattr(remote, name) != getattr(self, name)
        ]
        mine = dict(self.compat)
        theirs = dict(remote.compat)
        same_tp = remote.tp_size == self.tp_size
        if same_tp and remote.page_bytes != self.page_bytes:
            diffs.append(f"page_bytes prefill={remote.page_bytes} decode={self.page_bytes}")
        if not same_tp:
            divides = max(remote.tp_size, self.tp_size) % min(remote.tp_size, self.tp_size) == 0
            pages = remote.page_bytes * remote.tp_size == self.page_bytes * self.tp_size
            local, prefill = mine.get("kv_heads"), theirs.get("kv_heads")
            heads_split = (
                local is None
                or prefill is None
                or (
                    local.isdigit()
                    and prefill.isdigit()
                    and int(prefill[:9]) * remote.tp_size == int(local[:9]) * self.tp_size
                )
            )
            if not (divides and pages and heads_split):
                diffs.append(
                    f"tp_size prefill={remote.tp_size} decode={self.tp_size} with page_bytes "
                    f"prefill={remote.page_bytes} decode={self.page_bytes} (another TP size "
                    "is read when one divides the other and both split the same KV heads)"
                )
        if remote.dtype and self.dtype and remote.dtype != self.dtype:
            diffs.append(f"dtype prefill={remote.dtype} decode={self.dtype}")
        diffs += [
            f"{name} prefill={value} decode={mine[name]}"
            for name, value in remote.compat
            if name in mine and mine[name] != value and (same_tp or name != "kv_heads")
        ]
        if not diffs:
            return None
        return (
            "prefill and decode KV layouts differ ("
            + ", ".join(diffs)
            + "); both sides need the same vLLM, model, --block-size, "
            "--kv-cache-dtype and attention backend, and TP sizes that divide each other"
        )


@dataclass(frozen=True)
class RemoteHold:
    """A hold on a prefill instance, as a decoder sees it (every field checked)."""

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
        return ctrl_for_rank(self.remote_ctrl, tp_rank)

    def all_ctrls(self) -> list[str]:
        return [self.ctrl_for_rank(r) for r in range(self.layout.tp_size)]


def split_ctrl(ctrl: object, tp_size: int = 1) -> tuple[str, int]:
    """`host:port` of a hold control listener, checked: (host, port of rank 0).

    Every rank's port (port + rank for rank < tp_size) must be a TCP port too.
    """
    if not isinstance(ctrl, str) or not 0 < len(ctrl) <= MAX_TEXT_LEN:
        raise ParamsError(f"remote_ctrl must be a host:port string, not {_show(ctrl)}")
    host, sep, port_text = ctrl.rpartition(":")
    if not sep or not host or not port_text.isascii() or not port_text.isdigit():
        raise ParamsError(f"remote_ctrl must be host:port, not {_show(ctrl)}")
    if host.startswith("[") != host.endswith("]") or any(c.isspace() for c in host):
        raise ParamsError(f"remote_ctrl has a malformed host: {_show(ctrl)}")
    port = int(port_text[:6])  # a longer digit string is out of range anyway
    if len(port_text) > 5 or not 0 < port or port + tp_size - 1 > 65535:
        raise ParamsError(f"remote_ctrl port out of range (1..65535 for every TP rank): {ctrl}")
    return host, port


def ctrl_for_rank(ctrl: str, tp_rank: int) -> str:
    host, port = split_ctrl(ctrl, tp_rank + 1)
    return f"{host}:{port + tp_rank}"


def check_transfer_id(value: object) -> str:
    """A transfer id as the hold control protocol accepts it."""
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_TRANSFER_ID_LEN
        or not all("!" <= c <= "~" for c in value)
    ):
        raise ParamsError(
            f"transfer_id must be 1..{MAX_TRANSFER_ID_LEN} printable ASCII characters "
            f"without spaces, not {_show(value)}"
        )
    return value


def check_epoch(value: object) -> int:
    return _int(value, "resume_epoch", 0, MAX_EPOCH)


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
        "kv_dtype": layout.dtype,
        "compat": dict(layout.compat),
        "kv_groups": layout.kv_groups,
    }


def wants_hold(params: object) -> bool:
    """Whether a request asks this engine (a prefill) to hold its prompt KV."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def points_at_hold(params: object) -> bool:
    """Whether a request says it continues from a remote hold (checked or not)."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))


def remote_hold(params: object) -> RemoteHold | None:
    """The hold a decode request points at, or None when it is not a P/D request.

    Raises `ParamsError` for params that claim a hold (`do_remote_prefill`) but
    do not describe one this connector can read.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params must be an object, not {type(params).__name__}")
    flag = params.get("do_remote_prefill")
    if flag is None or flag is False:
        return None
    if flag is not True:
        raise ParamsError(f"do_remote_prefill must be true or false, not {_show(flag)}")
    for key in ("transfer_id", "remote_ctrl", "remote_block_ids", "remote_num_tokens"):
        if key not in params:
            raise ParamsError(f"kv_transfer_params lack {key!r}: not a Connex hold")
    layout = Layout(
        tp_size=_int(params.get("tp_size"), "tp_size", 1, MAX_TP_SIZE),
        block_size=_int(params.get("block_size"), "block_size", 1, MAX_BLOCK_SIZE),
        num_layers=_int(params.get("num_layers"), "num_layers", 1, MAX_LAYERS),
        page_bytes=_int(params.get("page_bytes"), "page_bytes", 1, MAX_PAGE_BYTES),
        dtype=_dtype(params.get("kv_dtype", "")),
        compat=_compat(params.get("compat", {})),
        # A prefill of an older Connex had one group.
        kv_groups=_int(params.get("kv_groups", 1), "kv_groups", 1, MAX_KV_GROUPS),
    )
    remote_ctrl = params["remote_ctrl"]
    split_ctrl(remote_ctrl, layout.tp_size)
    block_ids = params["remote_block_ids"]
    if not isinstance(block_ids, list) or len(block_ids) > MAX_BLOCKS:
        raise ParamsError(
            f"remote_block_ids must be a list of at most {MAX_BLOCKS} block ids, "
            f"not {_show(block_ids)}"
        )
    checked_ids = [_int(b, "remote_block_ids[]", 0, MAX_EPOCH) for b in block_ids]
    if len(checked_ids) % layout.kv_groups:
        raise ParamsError(
            f"remote_block_ids has {len(checked_ids)} block ids for {layout.kv_groups} "
            "KV cache groups of equal length"
        )
    # Whether the blocks cover the tokens is checked against the local layout
    # later, so that a layout mismatch is reported as such.
    num_tokens = _int(params["remote_num_tokens"], "remote_num_tokens", 0, MAX_TOKENS)
    backend = params.get("backend", "tcp")
    if backend not in BACKENDS:
        raise ParamsError(f"backend must be one of {BACKENDS}, not {_show(backend)}")
    engine_id = params.get("remote_engine_id", "")
    if engine_id is None:
        engine_id = ""
    if not isinstance(engine_id, str) or len(engine_id) > MAX_TEXT_LEN:
        raise ParamsError(f"remote_engine_id must be a string, not {_show(engine_id)}")
    return RemoteHold(
        transfer_id=check_transfer_id(params["transfer_id"]),
        remote_ctrl=str(remote_ctrl),
        engine_id=engine_id,
        block_ids=checked_ids,
        num_tokens=num_tokens,
        backend=str(backend),
        lease_s=_seconds(params.get("lease_s", 60.0), "lease_s"),
        epoch=check_epoch(params.get("resume_epoch", 0)),
        layout=layout,
    )


def _int(value: object, name: str, low: int, high: int) -> int:
    # bool is an int in Python, but `true` is no block id or port.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ParamsError(f"{name} must be an integer, not {_show(value)}")
    if not low <= value <= high:
        raise ParamsError(f"{name} must be in {low}..{high}, not {_show(value)}")
    return value


def _dtype(value: object) -> str:
    if not isinstance(value, str) or len(value) > 32 or not value.isascii():
        raise ParamsError(f"kv_dtype must be a dtype name, not {_show(value)}")
    return value


def _compat(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise ParamsError(f"compat must be an object, not {_show(value)}")
    out = []
    for name, item in value.items():
        if name not in COMPAT_KEYS:
            raise ParamsError(f"compat has an unknown entry {_show(name)}")
        if not isinstance(item, str) or len(item) > MAX_COMPAT_VALUE_LEN:
            raise ParamsError(f"compat[{name!r}] must be a short string, not {_show(item)}")
        out.append((name, item))
    return tuple(sorted(out))


def _seconds(value: object, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ParamsError(f"{name} must be a number of seconds, not {_show(value)}")
    # A huge int would overflow float(); compare it as an int first.
    if isinstance(value, int) and not 0 < value <= MAX_LEASE_S:
        raise ParamsError(f"{name} must be in (0, {MAX_LEASE_S:.0f}] seconds, not {_show(value)}")
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_LEASE_S:
        raise ParamsError(f"{name} must be in (0, {MAX_LEASE_S:.0f}] seconds, not {_show(value)}")
    return seconds


def _show(value: object) -> str:
    """A value for an error message, cut short (it comes from a client)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past str()'s digit limit, a deep list
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= 80 else text[:77] + "..."
