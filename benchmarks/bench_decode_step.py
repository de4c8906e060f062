"""A CPU decode step at batch 64 (SmolLM2-135M, float32), this checkout against a baseline revision,
in alternating subprocesses, beside its GEMM bound measured in the same run.

Why: issue 14's target 1 puts the decode step at batch 64 within 1.5x of its GEMM-bound time;
bench_engine.py measures it inside a 3-minute W64 run, where one step's change of a few per cent is
lost in the VM's swings. Here only that step runs: profile_decode.py's engine (decode role, random
KV, blocks scattered, contexts uniform in [64, 640]), whole ``LLMEngine.step`` calls (scheduling,
inputs, forward, sampling, bookkeeping) timed by the wall clock, --steps steps after 3 warm-up
steps per subprocess, --rounds rounds alternating baseline / this checkout. The GEMM bound is
ceiling.py's (the step's weight FLOPs at the GEMM peak measured here, as bench_engine.py takes it).

    python -m benchmarks.bench_decode_step [--baseline REV] [--threads 2] [--rounds 4] [--steps 20] [--out FILE]

The baseline runs from a temporary git worktree. Prints a table and writes it
(results_file.write_run) to benchmarks/results/decode_step.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

# Runs in the subprocess, against whichever checkout PYTHONPATH names first.
MEASURE = r'''
import json, statistics, sys, time
import torch
threads, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
from benchmarks.profile_decode import BATCH, build_engine
engine = build_engine(64, 640, steps + 3)
for _ in range(3):
    engine.step()
times = []
for _ in range(steps):
    t = time.perf_counter()
    result = engine.step()
    times.append(time.perf_counter() - t)
    assert len(result.deltas) == BATCH
kv = sum(r.num_computed_tokens + 1 for r in engine.scheduler.running)
print(json.dumps({"median_ms": statistics.median(times) * 1e3, "kv_tokens": kv}))
'''


def measure(checkout: Path, threads: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(threads), str(steps)], cwd=checkout, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def gemm_bound_ms(threads: int) -> float:
    from benchmarks.ceiling import decode_step_bound, measure_machine
    from engine.model_loader import load_model

    config = load_model(None).model.config
    return decode_step_bound(config, 64, measure_machine(config, num_threads=threads)).gemm_s * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_step.txt"))
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    this, base = "this checkout", f"baseline {rev}"
    runs: dict[str, list[dict]] = {base: [], this: []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True, capture_output=True)
        try:
            for i in range(args.rounds):
                order = [(base, tree), (this, ROOT)] if i % 2 == 0 else [(this, ROOT), (base, tree)]
                for name, checkout in order:
                    runs[name].append(measure(checkout, args.threads, args.steps))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    bound = gemm_bound_ms(args.threads)
    base_ms = statistics.median(r["median_ms"] for r in runs[base])
    lines = [f"bench_decode_step  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"LLMEngine.step at batch 64, SmolLM2-135M float32, decode role, random KV (~{runs[this][0]['kv_tokens']:,} "
             f"tokens), {args.threads} torch threads; {args.rounds} rounds of {args.steps} steps, a subprocess each, "
             f"the two checkouts alternating; load avg at end {os.getloadavg()[0]:.2f}",
             f"GEMM bound of the step (measured peak, this run): {bound:.1f} ms", "",
             f"{'checkout':<26}{'median ms':>10}{'vs GEMM bound':>15}{'rounds (median ms)':>34}{'vs baseline':>13}"]
    for name, rs in runs.items():
        med = statistics.median(r["median_ms"] for r in rs)
        rounds = ", ".join(f"{r['median_ms']:.1f}" for r in rs)
        lines.append(f"{name:<26}{med:>10.1f}{med / bound:>14.2f}x{rounds:>34}{base_ms / med:>12.3f}x")
    text = "\n".join(lines)
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
