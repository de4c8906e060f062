"""Where a decode step's time goes on a GPU: CUDA kernels of graph-replayed decode steps at batch 64.

A decode-role ``LLMEngine`` on CUDA (requests arrive with their KV "computed", as in
profile_decode.py; random KV; blocks scattered), contexts uniform in [--ctx-min, --ctx-max],
decode steps replayed as CUDA graphs. After warm-up steps, --steps steps run under
``torch.profiler`` with CUDA activities (CUPTI reports the kernels inside a replayed graph); the
table lists kernels by GPU time with their count per step, then a split: attention (the paged
kernel and the KV write, fused with the rotary embedding on engine.triton_fused), GEMMs, the rest; the step's wall time against the GPU's busy
time says how much is launch and host work between kernels.

    python -m benchmarks.profile_decode_cuda --model DIR [--dtype bfloat16] [--steps 5] [--top 25]

Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.profile_decode import build_engine  # noqa: E402

GEMM_MARKS = ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet")
ATTENTION_MARKS = ("paged_decode", "index_copy", "rope_write_kv")


def kind(name: str) -> str:
    low = name.lower()
    if any(m in low for m in ATTENTION_MARKS):
        return "attention (paged kernel, KV write)"
    if any(m in low for m in GEMM_MARKS):
        return "GEMM"
    return "rest"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ctx-min", type=int, default=64)
    ap.add_argument("--ctx-max", type=int, default=640)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(4)
    engine = build_engine(args.ctx_min, args.ctx_max, args.steps + 4, model=args.model, device="cuda", dtype=args.dtype)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name].append(e.device_time)
    per_step = {k: sum(v) / args.steps / 1e3 for k, v in kernels.items()}
    counts = {k: len(v) / args.steps for k, v in kernels.items()}
    busy = sum(per_step.values())
    graphs = engine.runner.graphs
    print(f"decode step at batch 64, {args.dtype}: wall {wall_ms:.2f} ms (profiled), GPU busy {busy:.2f} ms, "
          f"{sum(counts.values()):.0f} kernels per step; graph replays {graphs.num_replays if graphs else 0}")
    print(f"{'ms/step':>8} {'count':>6}  kernel")
    for name, ms in sorted(per_step.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{ms:8.3f} {counts[name]:6.0f}  {name[:110]}")
    split: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, ms in per_step.items():
        split[kind(name)][0] += ms
        split[kind(name)][1] += counts[name]
    print("split: " + "; ".join(f"{k} {ms:.2f} ms in {n:.0f} kernels" for k, (ms, n) in split.items()))


if __name__ == "__main__":
    main()
