"""Where a decode step's time goes: torch.profiler over decode-only steps of SmolLM2-135M at batch 64.

A decode-role ``LLMEngine`` (requests arrive with their KV "computed", as in bench_attention's
model row; random KV; blocks scattered), contexts uniform in [--ctx-min, --ctx-max], --threads
threads. After two warm-up steps, --steps steps run under ``torch.profiler`` (CPU activities);
the table lists operators by self CPU time, then a split into GEMMs (the linear kernels and
aten::mm/addmm), paged attention, and the rest by operator, and step time outside the model
forward (scheduling, input preparation, sampling, Python); then the rest of the forward split by
the ops the forward calls and its own Python (PDSERVE_LEAN_FORWARD=off: through Hugging Face's call).

    python -m benchmarks.profile_decode [--steps 5] [--threads 1] [--top 30]

Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from engine import attention, lean_cpu, skinny_linear  # noqa: E402

BATCH, BLOCK = 64, 16


def build_engine(ctx_min: int, ctx_max: int, steps: int, model: str | None = None, device: str = "cpu",
                 dtype: str = "float32", batch: int = BATCH):
    from engine.config import EngineConfig, EngineRole
    from engine.engine import LLMEngine
    from engine.model_loader import load_model
    from engine.types import RequestSpec, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 10000) for _ in range(rng.randint(ctx_min, ctx_max) - 1)] for _ in range(batch)]
    blocks = sum(-(-(len(p) + steps + 8) // BLOCK) for p in prompts) + 8
    config = EngineConfig(role=EngineRole.DECODE, num_kv_blocks=blocks, max_num_seqs=batch, device=device, dtype=dtype)
    engine = LLMEngine(load_model(model, dtype=dtype, device=device), config)
    free = list(engine.kv.pool._free)   # a long-running server's pool: blocks scattered
    rng.shuffle(free)
    engine.kv.pool._free = OrderedDict.fromkeys(free)
    for i, p in enumerate(prompts):
        spec = RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=steps + 16, ignore_eos=True))
        engine.reserve(spec)
        engine.commit_kv(spec.req_id, 42)
    engine.cache.normal_()
    return engine


def _labelled(label: str, fn):
    def call(*a, **kw):
        with record_function(label):
            return fn(*a, **kw)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx-min", type=int, default=64)
    ap.add_argument("--ctx-max", type=int, default=640)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # The attention call shows as one range (kernel + KV write); registered at engine build.
    attention.paged_attention = _labelled("pdserve::paged_attention", attention.paged_attention)
    engine = build_engine(args.ctx_min, args.ctx_max, args.steps + 2)
    engine.runner._forward = _labelled("pdserve::forward", engine.runner._forward)
    for name in ("skinny_linear", "panel_linear"):   # pybind calls: invisible to the profiler unless labelled
        labelled = _labelled(f"pdserve::{name}", getattr(skinny_linear, name))
        # The C++ layer stack (lean_cpu.NativeLayers) is told the kernel by a code looked up by function,
        # and labels its own calls (decode_layers.cpp's RECORD_FUNCTION ranges, the same names).
        lean_cpu._KERNEL_CODES[labelled] = lean_cpu._KERNEL_CODES[getattr(skinny_linear, name)]
        setattr(skinny_linear, name, labelled)
    for _ in range(2):
        engine.step()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            with record_function("pdserve::step"):
                engine.step()
    wall = (time.perf_counter() - t) / args.steps
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    total: dict[str, float] = {}
    self_ms: dict[str, float] = {}
    for e in events:   # a name can head two rows (a Python range and decode_layers.cpp's): summed
        total[e.key] = total.get(e.key, 0.0) + e.cpu_time_total / args.steps / 1e3
        self_ms[e.key] = self_ms.get(e.key, 0.0) + e.self_cpu_time_total / args.steps / 1e3
    step, fwd, attn = total["pdserve::step"], total["pdserve::forward"], total["pdserve::paged_attention"]
    gemm = sum(total.get(k, 0.0) for k in ("pdserve::skinny_linear", "pdserve::panel_linear")) + \
        sum(self_ms.get(k, 0.0) for k in ("aten::mm", "aten::addmm"))
    print(f"per step (ms, profiled; wall {wall * 1e3:.1f}): step {step:.1f}, forward {fwd:.1f}, "
          f"paged attention (incl. KV write) {attn:.1f}, GEMMs {gemm:.1f}, rest of the forward {fwd - attn - gemm:.1f}, "
          f"outside the forward {step - fwd:.1f}")
    rest = _rest_of_forward(prof.events(), args.steps)
    print("rest of the forward (ms per step): " + ", ".join(f"{name} {ms:.1f}" for name, ms in rest))
    print(_bounds_line(engine, args.threads, step, attn))


def _bounds_line(engine, threads: int, step_ms: float, attention_ms: float) -> str:
    """The step and its attention against this run's machine peaks: the GEMM bound (what issue 14's
    target 1 compares with) and the time to read the step's KV once at streaming bandwidth."""
    from benchmarks.ceiling import ModelShape, decode_step_bound, measure_machine

    config = engine.runner.model.config
    kv_tokens = sum(r.num_computed_tokens + 1 for r in engine.scheduler.running)
    peaks = measure_machine(config, num_threads=threads)
    gemm_ms = decode_step_bound(config, len(engine.scheduler.running), peaks).gemm_s * 1e3
    kv_read_ms = kv_tokens * ModelShape.from_config(config).kv_bytes_per_token() / peaks.read_bytes_s * 1e3
    return (f"bounds (peaks measured now: {peaks.gemm_flops / 1e9:.0f} GFLOP/s, read {peaks.read_bytes_s / 1e9:.0f} GB/s; "
            f"KV {kv_tokens:,} tokens): GEMM bound {gemm_ms:.1f} ms (step {step_ms / gemm_ms:.2f}x), KV read once "
            f"{kv_read_ms:.1f} ms (attention {attention_ms / kv_read_ms:.2f}x), GEMM bound + KV read "
            f"{gemm_ms + kv_read_ms:.1f} ms (step {step_ms / (gemm_ms + kv_read_ms):.2f}x)")


def _rest_of_forward(events, steps: int) -> list[tuple[str, float]]:
    """The forward's own ops (those called from its Python directly, with what they call) by
    total CPU time, and its self time (the Python and op dispatch between them), largest first;
    the attention and linear-kernel ranges are left out (reported above)."""
    totals: dict[str, float] = {}
    for e in events:
        if e.name == "pdserve::forward":
            totals["Python and dispatch (forward self)"] = totals.get("Python and dispatch (forward self)", 0.0) + \
                e.self_cpu_time_total
        elif e.cpu_parent is not None and e.cpu_parent.name == "pdserve::forward" and e.name not in _REPORTED:
            totals[e.name] = totals.get(e.name, 0.0) + e.cpu_time_total
    return sorted(((k, v / steps / 1e3) for k, v in totals.items()), key=lambda kv: -kv[1])


_REPORTED = ("pdserve::paged_attention", "pdserve::skinny_linear", "pdserve::panel_linear", "aten::mm", "aten::addmm",
             "aten::linear", "aten::matmul")


if __name__ == "__main__":
    main()
