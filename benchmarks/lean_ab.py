"""Decode step at batch 64 on SmolLM2-135M: engine.lean_forward against the model's own call, interleaved.

One decode-role engine (benchmarks/profile_decode.py's: random KV, scattered blocks, contexts
uniform in [--ctx-min, --ctx-max]); after --warmup steps, --rounds rounds of four steps A B B A
(A: the model's call, B: the lean forward; the runner's ``lean`` swapped between steps, nothing
else changes). Per step it reads wall time and process CPU time (every thread's; at 2 threads this
includes the OpenMP workers' spinning) and the main thread's CPU time (where the Python runs).
Prints medians per variant and B's gain; run niced beside other work, read the CPU figures.

    python -m benchmarks.lean_ab [--threads 1] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.profile_decode import build_engine  # noqa: E402

CLOCKS = ("wall", "cpu", "main_thread_cpu")


def timed_step(engine) -> dict[str, float]:
    t = (time.perf_counter(), time.process_time(), time.thread_time())
    engine.step()
    return dict(zip(CLOCKS, (time.perf_counter() - t[0], time.process_time() - t[1], time.thread_time() - t[2])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ctx-min", type=int, default=64)
    ap.add_argument("--ctx-max", type=int, default=640)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(args.ctx_min, args.ctx_max, args.warmup + 4 * args.rounds)
    lean = engine.runner.lean
    assert lean is not None, "lean forward refused or switched off (PDSERVE_LEAN_FORWARD)"
    variants = {"model_call": None, "lean": lean}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(args.warmup):
        engine.step()
    for _ in range(args.rounds):
        for name in ("model_call", "lean", "lean", "model_call"):
            engine.runner.lean = variants[name]
            samples[name].append(timed_step(engine))
    med = {name: {c: statistics.median(s[c] for s in rows) * 1e3 for c in CLOCKS} for name, rows in samples.items()}
    print(f"decode step, batch 64, {args.threads} thread(s), {2 * args.rounds} steps each, medians (ms):")
    for c in CLOCKS:
        a, b = med["model_call"][c], med["lean"][c]
        print(f"  {c:16s} model_call {a:7.1f}  lean {b:7.1f}  gain {a - b:6.1f} ({(a - b) / a:5.1%})")


if __name__ == "__main__":
    main()
