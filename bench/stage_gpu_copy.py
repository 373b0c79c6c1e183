"""The staging copies on a CUDA GPU against a plain pinned memcpy of the same
bytes (issue 14's "D2H/H2D GB/s against a pinned memcpy"), run by tests/gpu/run.

A KV cache of LAYERS layers shaped like vLLM's on a GPU (FlashAttention NHD,
`[2, blocks, block_size, heads, head_dim]` bf16: a block is two pieces, K and
V; FlashInfer `[blocks, 2, ...]`: one piece), HOLD_BLOCKS blocks at scattered
block ids (as vLLM's allocator hands them out). Per layout, each target takes
turns for ROUNDS rounds and the median is reported:

- stage_d2h: `gather_blocks` on the side stream into a pinned host buffer, to
  its fence (what a staged hold costs the prefill's step);
- memcpy_d2h: one contiguous device tensor of the same bytes into a pinned host
  buffer (the copy engine's ceiling);
- stage_h2d / memcpy_h2d: the reverse (`scatter_blocks`, what a staged read
  costs the decoder before its request may run);
- hold_create: `StagedHolds.create` whole (pinned buffer, copy, fence, region
  registration, hold), the first (a new pinned buffer) apart from the rest
  (each after the previous hold was freed: torch's pinned-memory cache hands
  its buffer back, as in a prefill's steady state);
- pull_staged: a staged read of that hold through the tcp backend on loopback
  into the decoder's device blocks, byte-exact.

Last lines: stage_d2h_vs_pinned_memcpy_ratio=<x> and
stage_h2d_vs_pinned_memcpy_ratio=<y> (FlashAttention layout)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from connex import _transfer
from connex.adapters.vllm.layout import block_layout_of
from connex.adapters.vllm.staged_holds import StagedHolds
from connex.adapters.vllm.staged_reads import StagedReads
from connex.adapters.vllm.staging import (
    CopyStream,
    KVLayer,
    gather_blocks,
    hold_bytes,
    host_buffer,
    scatter_blocks,
)

SECRET = "stage-gpu-bench"
BLOCK_SIZE, HEADS, HEAD_DIM = 16, 8, 128


def kv_cache(layout: str, layers: int, blocks: int, device: torch.device) -> list[KVLayer]:
    shape = {
        "flash_attn": (2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM),
        "flashinfer": (blocks, 2, BLOCK_SIZE, HEADS, HEAD_DIM),
    }[layout]
    out = []
    for seed in range(layers):
        gen = torch.Generator(device=device).manual_seed(seed)
        tensor = torch.empty(shape, dtype=torch.bfloat16, device=device)
        tensor.view(torch.int16).random_(generator=gen)
        out.append(KVLayer(tensor, block_layout_of(tensor, blocks), blocks))
    return out


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    began = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - began


def run_layout(layout: str, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    layers = kv_cache(layout, args.layers, args.blocks, device)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randperm(args.blocks, generator=gen)[: args.hold_blocks].tolist()
    nbytes = hold_bytes(layers, len(ids))
    stream = CopyStream(device)
    pinned = host_buffer(nbytes, device)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    holder = _transfer.Holder(backend="tcp", listen="127.0.0.1:0", retain_s=60, secret=SECRET)
    reader = _transfer.Reader(backend="tcp", secret=SECRET)
    dst_layers = kv_cache(layout, args.layers, args.blocks, device)
    for layer in dst_layers:
        layer.tensor.zero_()
    targets = {
        "stage_d2h": lambda: stream.run(lambda: gather_blocks(layers, ids, pinned)).wait(),
        "memcpy_d2h": lambda: pinned.copy_(flat, non_blocking=True),
        "stage_h2d": lambda: stream.run(lambda: scatter_blocks(dst_layers, ids, pinned)).wait(),
        "memcpy_h2d": lambda: flat.copy_(pinned, non_blocking=True),
    }
    names = [*targets, "hold_create_first", "hold_create", "pull_staged"]
    samples: dict[str, list[float]] = {name: [] for name in names}
    staged = StagedHolds(holder, layers)
    reads = StagedReads(reader, dst_layers)
    try:
        for fn in targets.values():  # warm-up: kernels, the pinned allocator
            fn()
        for r in range(args.rounds):
            for name, fn in targets.items():
                samples[name].append(timed(fn))
            transfer_id = f"bench-{r}-{_transfer.new_transfer_id()}"
            create = timed(lambda tid=transfer_id: staged.create(tid, ids))
            # The first hold's pinned buffer is new; later ones reuse the freed
            # one through torch's pinned-memory cache, as a prefill's steady
            # state does.
            samples["hold_create" if r else "hold_create_first"].append(create)
            pull = reads.pull_async(holder.ctrl_addr, transfer_id, 0, ids, timeout_s=120)
            samples["pull_staged"].append(timed(pull.result))
            holder.release(transfer_id)
            freed_before = time.monotonic() + 10
            while staged.owns(transfer_id) and time.monotonic() < freed_before:
                for gone in holder.freed():
                    staged.free(gone)
                time.sleep(0.001)
            assert not staged.owns(transfer_id), "a released hold was never freed"
        picked = torch.tensor(ids, device=device)
        block_dim = 1 if layout == "flash_attn" else 0
        for src, dst in zip(layers, dst_layers, strict=True):
            # Compared as integers: random bits make NaNs, which equal nothing.
            held = src.tensor.view(torch.int16).index_select(block_dim, picked)
            pulled = dst.tensor.view(torch.int16).index_select(block_dim, picked)
            assert torch.equal(held, pulled), f"{layout}: a staged pull did not land byte-exact"
    finally:
        holder.close()
    gbps = {name: nbytes / statistics.median(s) / 1e9 for name, s in samples.items()}
    print(
        f"{layout}: {args.layers} layers, {len(ids)} blocks of {nbytes // len(ids) // 1024} KiB "
        f"(all layers; {nbytes / 2**20:.0f} MiB per hold); GB/s, medians: "
        + ", ".join(f"{name} {v:.1f}" for name, v in gbps.items())
    )
    return gbps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2048, help="blocks in each layer's KV cache")
    parser.add_argument("--hold-blocks", type=int, default=512, help="blocks of the staged prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu only to try the script (no pinned memory)"
    )
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first hold is reported apart)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("stage_gpu_copy.py needs a CUDA GPU (or --device cpu to try it)")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    results = {layout: run_layout(layout, args, device) for layout in ("flash_attn", "flashinfer")}
    fa = results["flash_attn"]
    print(f"stage_d2h_vs_pinned_memcpy_ratio={fa['stage_d2h'] / fa['memcpy_d2h']:.3f}")
    print(f"stage_h2d_vs_pinned_memcpy_ratio={fa['stage_h2d'] / fa['memcpy_h2d']:.3f}")


if __name__ == "__main__":
    main()
