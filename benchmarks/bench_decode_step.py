"""A CPU decode step (SmolLM2-135M, float32; batch 64 and 1) as this checkout runs it, against the
same step with earlier code paths swapped back in, in one process, beside its GEMM bound.

Why: issue 14's target 1 puts the decode step at batch 64 within 1.5x of its GEMM-bound time, and
the changes left are a few per cent each: separate processes (or bench_engine.py's 3-minute W64
run) drift by more than that on this VM (two subprocess runs of the same pair of revisions read
1.033x and 0.998x). So the variants alternate step by step on one engine and each step's time is
paired with its neighbour's; the median paired difference is the figure.

Engine: profile_decode.py's (decode role, random KV, blocks scattered, contexts uniform in
[64, 640]); whole ``LLMEngine.step`` calls (scheduling, inputs, forward, sampling, bookkeeping),
wall clock; batch 64 at --threads torch threads (the in-process engine's setting), batch 1 at one
(a cluster decode worker's). Variants:
  this checkout;
  the straight-line layers in Python (``engine.lean_cpu``'s C++ layer stack off);
  the lean forward's general layer loop (``engine.lean_cpu``'s straight-line layers off);
  argmax on torch's ops (``PDSERVE_ARGMAX_KERNEL=off``: greedy sampling before 8de8028);
  decode groups as at --groups-rev (``ModelRunner._decode_groups`` / ``_decode_group`` of that
  revision, loaded from git: decodes sorted by context, the key mask built, q gathered and the
  output scattered per layer).
The GEMM bound is ceiling.py's (the step's weight FLOPs at the GEMM peak measured in this run).

    python -m benchmarks.bench_decode_step [--threads 2] [--steps 40] [--groups-rev 8de8028] [--batches 64,1] [--out FILE]

Prints a table and writes it (results_file.write_run) to benchmarks/results/decode_step.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.ceiling import decode_step_bound, measure_machine  # noqa: E402
from benchmarks.profile_decode import build_engine  # noqa: E402
from benchmarks.results_file import write_run  # noqa: E402
from engine import greedy_argmax  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402

THIS = "this checkout"


def runner_of(rev: str) -> type:
    """``engine/model_runner.py`` as of ``rev``, executed as a module of its own: its ModelRunner."""
    source = subprocess.run(["git", "show", f"{rev}:engine/model_runner.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = sys.modules["model_runner_then"] = types.ModuleType("model_runner_then")   # dataclasses look it up
    exec(compile(source, f"{rev}:engine/model_runner.py", "exec"), module.__dict__)
    return module.ModelRunner


@contextlib.contextmanager
def argmax_on_torch():
    os.environ[greedy_argmax.ENV_VAR] = "off"
    try:
        yield
    finally:
        del os.environ[greedy_argmax.ENV_VAR]


@contextlib.contextmanager
def python_layers(engine):
    layers = engine.runner.lean.cpu_layers
    native, layers.native = layers.native, None
    try:
        yield
    finally:
        layers.native = native


@contextlib.contextmanager
def general_loop(engine):
    layers, engine.runner.lean.cpu_layers = engine.runner.lean.cpu_layers, None
    try:
        yield
    finally:
        engine.runner.lean.cpu_layers = layers


@contextlib.contextmanager
def groups_of(then: type):
    now = ModelRunner._decode_groups, ModelRunner._decode_group
    ModelRunner._decode_groups, ModelRunner._decode_group = then._decode_groups, then._decode_group
    try:
        yield
    finally:
        ModelRunner._decode_groups, ModelRunner._decode_group = now


def measure(batch: int, threads: int, steps: int, then: type, groups_rev: str) -> list[str]:
    """The table's lines for one batch size: each variant's median step, paired with this checkout's."""
    torch.set_num_threads(threads)
    engine = build_engine(64, 640, steps * 6 + 8, batch=batch)   # every variant's steps, and spare
    variants = {THIS: contextlib.nullcontext, "straight-line layers in Python": lambda: python_layers(engine),
                "general layer loop (lean_cpu off)": lambda: general_loop(engine),
                "argmax on torch's ops": argmax_on_torch, f"decode groups as at {groups_rev}": lambda: groups_of(then)}
    for _ in range(3):
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(steps * len(names)):
        name = names[i % len(names)] if (i // len(names)) % 2 == 0 else names[-1 - i % len(names)]
        with variants[name]():
            start = time.perf_counter()
            result = engine.step()
            times[name].append(time.perf_counter() - start)
        assert len(result.deltas) == batch
    kv = sum(r.num_computed_tokens + 1 for r in engine.scheduler.running)
    config = engine.runner.model.config
    bound_ms = decode_step_bound(config, batch, measure_machine(config, num_threads=threads)).gemm_s * 1e3
    lines = [f"batch {batch}, {threads} torch thread(s), KV ~{kv:,} tokens at the end; GEMM bound of the step "
             f"(peak measured here): {bound_ms:.1f} ms",
             f"  {'variant':<38}{'median ms':>10}{'vs GEMM bound':>15}{'paired: ms more than this checkout':>37}"]
    for name, ts in times.items():
        med = statistics.median(ts) * 1e3
        paired = statistics.median(t - o for t, o in zip(ts, times[THIS])) * 1e3
        extra = "" if name == THIS else f"{paired:>+36.2f}"
        lines.append(f"  {name:<38}{med:>10.1f}{med / bound_ms:>14.2f}x{extra}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads at batch 64 (batch 1 runs at 1)")
    ap.add_argument("--steps", type=int, default=40, help="steps per variant")
    ap.add_argument("--groups-rev", default="8de8028", help="revision whose decode grouping is the peer")
    ap.add_argument("--batches", default="64,1")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_step.txt"))
    args = ap.parse_args()
    os.environ.pop(greedy_argmax.ENV_VAR, None)
    then = runner_of(args.groups_rev)
    lines = [f"bench_decode_step  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"LLMEngine.step, SmolLM2-135M float32, decode role, random KV (contexts 64-640 at the start); {args.steps} "
             "steps per variant, the variants taking turns step by step (order reversed every other turn)"]
    for batch in (int(b) for b in args.batches.split(",")):
        lines += [""] + measure(batch, args.threads if batch > 1 else 1, args.steps, then, args.groups_rev)
    lines.append(f"load avg at end {os.getloadavg()[0]:.2f}; target 1 of issue 14: the batch-64 step <= 1.5x its GEMM bound")
    text = "\n".join(lines)
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
