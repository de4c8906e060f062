"""Decode attention on a GPU: the Triton paged kernel against the torch path, one run.

SmolLM2-135M's shapes (30 layers, 9 query heads on 3 KV heads, head dim 64, block size 16),
batch 64, contexts uniform in [64, 640] (seeded), each request's blocks scattered over a shuffled
pool. One pass calls ``engine.attention.paged_attention`` (what the model calls per layer: write
the step's K/V, then attend) for each of the 30 layers, with the metadata ``ModelRunner`` builds
on CUDA (one decode group, tables padded to the longest context); ``PDSERVE_ATTENTION`` picks the
path. Each path's pass is captured as a CUDA graph (as decode steps run) and replayed; passes
alternate kernel / torch; medians of CUDA-event times. Effective GB/s counts the K/V
bytes a step must read (sum of contexts x 2 x kv_heads x head_dim x element size); the copy
roofline is a device-to-device copy of the same bytes (read + write).

    python -m benchmarks.bench_attention_cuda [--passes 20] [--out benchmarks/results/cuda/attention.txt]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

import torch  # noqa: E402

from engine import attention, triton_attention  # noqa: E402
from engine.attention import AttentionMetadata, DecodeGroup  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, BATCH = 30, 9, 3, 64, 16, 64


class Layer(torch.nn.Module):
    def __init__(self, idx: int) -> None:
        super().__init__()
        self.layer_idx = idx


def build(dtype: torch.dtype, seed: int = 0):
    rng = random.Random(seed)
    ctx = sorted(rng.randint(64, 640) for _ in range(BATCH))
    used = [-(-c // BLOCK) for c in ctx]
    num_blocks = sum(used) + 1
    cache = torch.randn(LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
    order = list(range(num_blocks - 1))
    rng.shuffle(order)
    width = max(used)
    tables = torch.full((BATCH, width), num_blocks - 1, dtype=torch.long)
    slots = []
    for i, n in enumerate(used):
        tables[i, :n] = torch.tensor(order[:n])
        order = order[n:]
        last = ctx[i] - 1
        slots.append(int(tables[i, last // BLOCK]) * BLOCK + last % BLOCK)
    tables = tables.cuda()
    context_lens = torch.tensor(ctx, device="cuda")
    key_mask = torch.arange(width * BLOCK, device="cuda")[None, :] < context_lens[:, None]
    group = DecodeGroup(torch.arange(BATCH, device="cuda"), tables, key_mask[:, None, None, :], context_lens)
    meta = AttentionMetadata(cache, torch.tensor(slots, device="cuda"), prefills=[], decode_groups=[group])
    q = torch.randn(1, HEADS, BATCH, HEAD_DIM, device="cuda").to(dtype)
    kv = torch.randn(1, KV_HEADS, BATCH, HEAD_DIM, device="cuda").to(dtype)
    return meta, q, kv, sum(ctx)


def one_pass(meta, q, kv, layers) -> torch.Tensor:
    out = None
    for layer in layers:
        out, _ = attention.paged_attention(layer, q, kv, kv, None, scaling=HEAD_DIM ** -0.5, pdserve_attn=meta)
    return out


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run(dtype: torch.dtype, passes: int) -> list[str]:
    meta, q, kv, tokens = build(dtype)
    layers = [Layer(i) for i in range(LAYERS)]
    kv_bytes = tokens * 2 * KV_HEADS * HEAD_DIM * q.element_size() * LAYERS
    src = torch.empty(kv_bytes // 2, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    outs, graphs = {}, {}
    for path in ("triton", "torch"):   # warm up (Triton compiles), then capture the pass as decode graphs do
        os.environ[triton_attention.ENV_VAR] = "" if path == "triton" else "torch"
        one_pass(meta, q, kv, layers)
        torch.cuda.synchronize()
        graphs[path] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[path]):
            outs[path] = one_pass(meta, q, kv, layers)
    os.environ.pop(triton_attention.ENV_VAR, None)
    times: dict[str, list[float]] = {"triton": [], "torch": [], "copy": []}
    for _ in range(passes + 2):
        for path in ("triton", "torch"):
            times[path].append(timed(graphs[path].replay))
        times["copy"].append(timed(lambda: dst.copy_(src)))
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    diff = (outs["triton"].float() - outs["torch"].float()).abs().max().item()
    rows = [f"{str(dtype).removeprefix('torch.')}: batch {BATCH}, KV {tokens} tokens, {kv_bytes / 1e6:.0f} MB over 30 layers"]
    for name, label in (("triton", "Triton paged kernel"), ("torch", "torch path (gather + SDPA)")):
        rows.append(f"  {label:<30} {med[name]:8.3f} ms  {kv_bytes / med[name] / 1e6:8.0f} GB/s")
    rows.append(f"  {'copy of the same bytes':<30} {med['copy']:8.3f} ms  {2 * kv_bytes / med['copy'] / 1e6:8.0f} GB/s (read + write)")
    rows.append(f"  torch / triton: {med['torch'] / med['triton']:.2f}x; max |difference| {diff:.2e}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results/cuda/attention.txt")
    args = ap.parse_args()
    lines = [f"bench_attention_cuda  {datetime.now().isoformat(timespec='seconds')}",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one pass = 30 layers' paged_attention, replayed as a CUDA graph; "
             f"medians of {args.passes} passes", ""]
    for dtype in (torch.float32, torch.bfloat16):
        lines += run(dtype, args.passes) + [""]
    text = "\n".join(lines)
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
