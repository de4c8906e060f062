"""Per-report CPU of admission's step-time model (``router.step_model.StepTimeModel.observe``):
a decode worker's reports as the router gets them (each the worker's last 64 steps, one new step
per report, one step in 20 carrying a prompt chunk, one in 50 slowed by foreign load), over a
256-step window; thread CPU time, so a busy machine slows it less than wall time would.

Run: ``python benchmarks/bench_step_model.py`` (a few seconds; prints only). For an A/B against
another version, run it in both trees (e.g. ``git stash``) alternately.
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.types import StepTiming  # noqa: E402
from router.step_model import StepTimeModel  # noqa: E402


def reports(num: int, seed: int = 0) -> list[tuple[StepTiming, ...]]:
    rng = random.Random(seed)
    recent: deque[StepTiming] = deque(maxlen=64)
    out = []
    for _ in range(num):
        seqs, prompt = rng.randrange(1, 100), 64 if rng.random() < 0.05 else 0
        duration = 0.01 + 0.0045 * seqs + prompt * 1.3e-3 + rng.random() * 1e-3 + (0.05 if rng.random() < 0.02 else 0)
        recent.append(StepTiming(seqs, seqs + prompt, prompt, seqs * 200 + rng.randrange(5000), duration))
        out.append(tuple(recent))
    return out


def main() -> None:
    stream = reports(6000)
    model = StepTimeModel()
    for r in stream[:1000]:   # the window fills
        model.observe(r)
    start = time.thread_time()
    for r in stream[1000:]:
        model.observe(r)
    per_report = (time.thread_time() - start) / (len(stream) - 1000)
    print(f"StepTimeModel.observe: {per_report * 1e6:.1f} us CPU per report (mean over {len(stream) - 1000},"
          f" a refit every 8 decode steps)")


if __name__ == "__main__":
    main()
