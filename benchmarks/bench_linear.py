"""Decode-step linears: the C++ skinny and panel kernels against torch's ``F.linear`` (MKL), one run.

1. Every linear of one SmolLM2-135M forward (30 layers x q/k/v/o/gate/up/down + the tied LM
   head: 536 MB of float32 weights, far more than the caches, so each pass reads them from
   memory as a decode step does) at M input rows, M = 1..512: the skinny kernel and, past 16 rows,
   the panel kernel (each the engine's up to its ``skinny_linear.ROW_LIMITS`` for the build).
   Passes alternate kernels / torch / read roofline (``sum()`` over the same weights) so every ratio compares numbers taken in the
   same seconds of a shared machine; medians are reported. GB/s = weight bytes / time.
2. Unless --skip-model: one full decode step of the real model in a decode-role ``LLMEngine``
   (requests arrive with their KV "computed"; context ~256) at several batch sizes, alternating
   the engine's linear path step by step (``ModelRunner.skinny``).

    python -m benchmarks.bench_linear [--passes 7] [--steps 6] [--threads 1] [--skip-model]
        [--batches 1,6,12,24] [--context 256] [--cpu-clock] [--out FILE]

``--cpu-clock`` times with this process's CPU time (1 thread on a busy shared machine: leaves
out the time other processes held the core).

Threads default to 1: a colocated or decode worker's setup in the goodput runs.
Writes benchmarks/results/linear.txt (one machine's run; that file keeps one section per SIMD
path, AVX-512 and AVX2: write to --out and paste the section in).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import kernel_bench  # noqa: E402
from engine import cpu_kernels, skinny_linear  # noqa: E402

ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
PANEL_FROM = 16   # rows from which the panel kernel is timed too
BATCHES = (1, 6, 12, 24)
CONTEXT = 256
RESULTS = ROOT / "benchmarks" / "results" / "linear.txt"


def forward_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights a forward multiplies, in order (the tied LM head once, last)."""
    weights = [m.weight for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    return [*weights, model.lm_head.weight]


def bench_rows(weights: list[torch.Tensor], passes: int) -> list[str]:
    total = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * sum(w.numel() for w in weights)
    lines = [
        f"every linear of one forward ({len(weights)} weights, {total / 1e6:.0f} MB fp32), median of {passes} "
        "alternating passes; GFLOP/s of the best path",
        f"  {'rows':>5}{'torch ms':>10}{'skinny ms':>11}{'panel ms':>10}{'best speed-up':>15}{'GFLOP/s':>9}"
        f"{'max rel err':>13}",
    ]
    kernels = {"skinny": skinny_linear.skinny_linear, "panel": skinny_linear.panel_linear}
    roof = []
    for rows in ROWS:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        paths = ["skinny", "torch"] + (["panel"] if rows >= PANEL_FROM else [])
        times: dict[str, list[float]] = {p: [] for p in paths}
        for p in range(passes + 1):                 # pass 0 warms up
            for path in paths:
                fn = kernels.get(path, lambda x, w: F.linear(x, w))
                t = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                if p:
                    times[path].append(time.perf_counter() - t)
            t = time.perf_counter()
            for w in weights:
                w.sum()
            roof.append(time.perf_counter() - t)
        err = max(_rel_err(kernels[k](xs[w.shape[1]], w), xs[w.shape[1]], w)
                  for k in paths if k in kernels for w in weights[:7])
        med = {k: statistics.median(v) for k, v in times.items()}
        best = min(med[k] for k in med if k in kernels)
        panel = f"{med['panel'] * 1e3:>10.1f}" if "panel" in med else f"{'-':>10}"
        lines.append(f"  {rows:>5}{med['torch'] * 1e3:>10.1f}{med['skinny'] * 1e3:>11.1f}{panel}"
                     f"{med['torch'] / best:>14.2f}x{rows * flops / best / 1e9:>9.1f}{err:>13.1e}")
    r = statistics.median(roof)
    lines.append(f"  read roofline (sum over the same weights): {r * 1e3:.1f} ms = {total / r / 1e9:.1f} GB/s")
    return lines


def _rel_err(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.double() @ w.double().T
    return float((got.double() - want).abs().max() / want.abs().max())


def bench_model(loaded, steps: int, batches: tuple[int, ...], context: int) -> list[str]:
    from engine.config import EngineConfig, EngineRole
    from engine.engine import LLMEngine
    from engine.types import RequestSpec, SamplingParams

    lines = [
        f"full decode step, {loaded.name} fp32, context ~{context} (median of {steps} steps per path, alternating)",
        f"  {'batch':>5}{'torch ms':>10}{'kernel ms':>11}{'speed-up':>10}",
    ]
    rng = random.Random(1)
    for batch in batches:
        blocks = batch * (-(-(context + 2 * steps + 8) // 16)) + 8
        engine = LLMEngine(loaded, EngineConfig(role=EngineRole.DECODE, num_kv_blocks=blocks, max_num_seqs=batch))
        if not engine.runner.skinny:
            sys.exit("the engine did not enable the skinny kernel (PDSERVE_LINEAR=torch set?)")
        for i in range(batch):
            prompt = tuple(rng.randrange(3, 10000) for _ in range(context))
            spec = RequestSpec(f"r{i}", prompt, SamplingParams(max_tokens=4 * steps + 8, ignore_eos=True))
            engine.reserve(spec)
            engine.commit_kv(spec.req_id, 42)
        engine.cache.normal_()   # real pages, not the shared zero page
        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        for s in range(2 * steps + 2):           # two warm-up steps, then alternate
            path = ("kernel", "torch")[s % 2]
            engine.runner.skinny = path == "kernel"
            t = time.perf_counter()
            engine.step()
            if s >= 2:
                times[path].append(time.perf_counter() - t)
        for spec_id in list(engine.scheduler.requests):
            engine.abort(spec_id)
        engine.step()
        med = {k: statistics.median(v) for k, v in times.items()}
        lines.append(f"  {batch:>5}{med['torch'] * 1e3:>10.1f}{med['kernel'] * 1e3:>11.1f}"
                     f"{med['torch'] / med['kernel']:>9.2f}x")
    return lines


def _options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--batches", type=lambda s: tuple(int(b) for b in s.split(",")), default=BATCHES,
                    help="decode batch sizes of the full-step part, comma-separated")
    ap.add_argument("--context", type=int, default=CONTEXT, help="context length of each request")
    ap.add_argument("--cpu-clock", action="store_true", help="time with this process's CPU time (1 thread)")


def main() -> None:
    args = kernel_bench.parse_args(__doc__, threads=1, results=RESULTS, extra=_options)
    if args.cpu_clock:
        time.perf_counter = time.process_time   # every timer below reads it
    if not skinny_linear.enabled():
        why = cpu_kernels.unavailable_reason() or "neither AVX-512 nor AVX2+FMA, or PDSERVE_LINEAR=torch"
        sys.exit(f"skinny kernel unavailable: {why}")
    from engine.model_loader import load_model

    loaded = load_model()
    lines = [
        *kernel_bench.header("bench_linear"),
        f"kernel: engine/csrc/skinny_linear.cpp {' '.join(cpu_kernels.CFLAGS)}, "
        f"{skinny_linear.simd_width()}-float vectors; engine uses it up to {skinny_linear.row_limits().skinny} rows, "
        f"engine/csrc/panel_linear.cpp from there up to {skinny_linear.row_limits().panel} rows"
        f"; clock: {'CPU time' if args.cpu_clock else 'wall'}",
        "",
        *bench_rows(forward_weights(loaded.model), args.passes),
    ]
    print("\n".join(lines), flush=True)
    if not args.skip_model:
        model_lines = ["", *bench_model(loaded, args.steps, args.batches, args.context)]
        print("\n".join(model_lines), flush=True)
        lines += model_lines
    kernel_bench.write(args.out, lines)


if __name__ == "__main__":
    main()
