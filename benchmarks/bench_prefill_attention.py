"""Prefill attention: the C++ paged prefill kernel against the engine's SDPA path, one run.

Shapes of SmolLM2-135M (9 query heads, 3 KV heads, head dim 64), block size 16, fp32; each
request's blocks scattered over a shuffled pool. Both paths are ``engine.attention._prefill``,
the function the engine's attention calls per prompt segment: with ``kernel=True`` the C++
kernel reads the blocks in place; with ``kernel=False`` the K/V are gathered and SDPA runs
(``is_causal`` for a whole prompt; for a later chunk, the additive mask ``ModelRunner`` builds).
Calls alternate kernel / SDPA so every ratio compares numbers taken in the same seconds of a
shared machine; medians of ``--passes`` passes, each timing 30 calls (one per layer's worth).
GFLOP/s counts the causal FLOPs (QK^T and PV over the lower triangle: 2 x heads x head_dim x
q_len x (2 x ctx_len - q_len) per segment).

Then, unless --skip-model: a lone 512-token prompt's prefill in the engine (TTFT, the real
SmolLM2), alternating the two paths run by run, against the prefill ceiling of
benchmarks/ceiling.py (issue 14's target 2: >= 80% of it).

    python -m benchmarks.bench_prefill_attention [--passes 7] [--threads 2] [--skip-model]

Writes benchmarks/results/prefill_attention.txt.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

import torch  # noqa: E402

from engine import attention, paged_kernel  # noqa: E402
from engine.attention import PrefillSegment, offset_causal_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30
# (q_len, ctx_len): whole prompts, then later chunks of a longer prompt (a 2,048-token budget's tail).
SEGMENTS = [(64, 64), (128, 128), (256, 256), (512, 512), (1024, 1024), (2048, 2048),
            (256, 768), (512, 1536), (1024, 3072)]


def _case(q_len: int, ctx_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    needed = -(-ctx_len // BLOCK)
    pool = 2 * needed
    k_cache = torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v_cache = torch.randn(pool, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    block_ids = torch.randperm(pool, generator=g)[:needed]
    q = torch.randn(q_len, HEADS, HEAD_DIM, generator=g).transpose(0, 1)   # [heads, q_len, d] as the model's
    start = ctx_len - q_len
    mask = offset_causal_mask(start, q_len, k_cache.dtype, k_cache.device) if start else None   # as the runner builds it
    seg = PrefillSegment(q_start=0, q_len=q_len, ctx_len=ctx_len, block_ids=block_ids, mask=mask)
    return q, k_cache, v_cache, seg


def _time_calls(q, k_cache, v_cache, seg, kernel: bool, out) -> float:
    start = time.perf_counter()
    for _ in range(LAYERS):
        attention._prefill(q, k_cache, v_cache, seg, 0.125, out, kernel)
    return (time.perf_counter() - start) / LAYERS


def bench_segments(passes: int) -> list[str]:
    lines = ["per call (one layer), median of passes; GFLOP/s on causal FLOPs",
             f"  {'q_len':>6} {'ctx_len':>8}   {'SDPA ms':>8} {'GF/s':>6}   {'kernel ms':>9} {'GF/s':>6}   speed-up  max|diff|/max|SDPA|"]
    for q_len, ctx_len in SEGMENTS:
        q, kc, vc, seg = _case(q_len, ctx_len)
        outs = {on: torch.empty(q_len, HEADS, HEAD_DIM) for on in (True, False)}
        for on in (True, False):   # warm-up (and the outputs compared below)
            attention._prefill(q, kc, vc, seg, 0.125, outs[on], on)
        diff = ((outs[True] - outs[False]).abs().max() / outs[False].abs().max()).item()
        times = {True: [], False: []}
        for _ in range(passes):
            for on in (True, False):
                times[on].append(_time_calls(q, kc, vc, seg, on, outs[on]))
        flops = 2.0 * HEADS * HEAD_DIM * q_len * (2 * ctx_len - q_len)
        sdpa, kern = statistics.median(times[False]), statistics.median(times[True])
        lines.append(f"  {q_len:>6} {ctx_len:>8}   {sdpa * 1e3:>8.3f} {flops / sdpa / 1e9:>6.0f}   "
                     f"{kern * 1e3:>9.3f} {flops / kern / 1e9:>6.0f}   {sdpa / kern:>7.2f}x  {diff:.1e}")
    return lines


def bench_model(passes: int, threads: int) -> list[str]:
    from benchmarks.ceiling import ModelShape, measure_machine, prefill_flops
    from benchmarks.workload import make_w64
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.model_loader import load_model
    from engine.types import RequestSpec, SamplingParams

    loaded = load_model(None)
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=512,
                                            enable_prefix_caching=False))
    prompt = tuple(make_w64(1, seed=99, prompt_range=(512, 512))[0].prompt_token_ids)
    preferred = paged_kernel.PREFILL_SIMD_WIDTHS

    def ttft(i: int, kernel: bool) -> float:
        paged_kernel.PREFILL_SIMD_WIDTHS = preferred if kernel else frozenset()
        spec = RequestSpec(f"p{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        engine.generate([spec])
        return time.perf_counter() - start

    times = {True: [], False: []}
    try:
        for i in range(passes + 1):
            for on in (True, False):
                t = ttft(2 * i + on, on)
                if i:   # the first round warms up
                    times[on].append(t)
    finally:
        paged_kernel.PREFILL_SIMD_WIDTHS = preferred
    peaks = measure_machine(loaded.model.config, threads)
    floor = prefill_flops(ModelShape.from_config(loaded.model.config), 512) / peaks.gemm_flops
    lines = [f"lone 512-token prefill, SmolLM2-135M-Instruct fp32, engine (budget 512), {passes} runs per path alternating",
             f"  prefill ceiling (benchmarks/ceiling.py, GEMM peak {peaks.gemm_flops / 1e9:.0f} GFLOP/s): {floor * 1e3:.0f} ms",
             f"  {'path':<8} {'best ms':>8} {'median ms':>10} {'best %':>7} {'median %':>9}"]
    for on, name in ((False, "SDPA"), (True, "kernel")):
        best, med = min(times[on]), statistics.median(times[on])
        lines.append(f"  {name:<8} {best * 1e3:>8.0f} {med * 1e3:>10.0f} {floor / best:>7.0%} {floor / med:>9.0%}")
    lines.append(f"  target 2 (>= 80% of the ceiling), kernel median: "
                 f"{'PASS' if floor / statistics.median(times[True]) >= 0.8 else 'MISS'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill_attention.txt"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_kernel.prefill_supports(HEAD_DIM):
        sys.exit(f"the prefill kernel is not available here: {paged_kernel.unavailable_reason() or 'no SIMD build'}")
    lines = [f"bench_prefill_attention  {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {os.cpu_count()} cores ({platform.machine()}), load avg at start "
             f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}, {args.threads} threads",
             f"kernel: engine/csrc/prefill_attention.cpp, SIMD width {paged_kernel.simd_width()} floats; "
             f"engine prefers it on widths {sorted(paged_kernel.PREFILL_SIMD_WIDTHS)}",
             f"shapes: SmolLM2-135M ({HEADS} heads, {KV_HEADS} KV heads, head dim {HEAD_DIM}), block {BLOCK}, fp32", ""]
    with torch.inference_mode():
        lines += bench_segments(args.passes)
        if not args.skip_model:
            lines += [""] + bench_model(args.passes, args.threads)
    text = "\n".join(lines) + "\n"
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
