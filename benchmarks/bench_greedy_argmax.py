"""Greedy sampling's argmax + finiteness check on CPU: the C++ kernel (engine/csrc/greedy_argmax.cpp)
against torch's ops (``torch.argmax`` and one ``isfinite(sum)``, the path it replaced and the one
still taken off CPU), interleaved in one process, same logits, answers compared every call.

Why: a greedy decode step samples by argmax over the vocabulary for every row, and torch's CPU
argmax runs ~12x slower than a max over the same row (SmolLM2: 49,152 logits a row).

    python benchmarks/bench_greedy_argmax.py [--vocab 49152] [--calls 300] [--out FILE]

Rows of standard-normal logits, batch 1 / 8 / 32 / 64, 1 and 2 torch threads (a cluster worker
runs 1, the in-process engine 2). Prints a table and writes it (results_file.write_run) to
benchmarks/results/greedy_argmax.txt.
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

from benchmarks.results_file import write_run  # noqa: E402
from engine import cpu_kernels, greedy_argmax  # noqa: E402

BATCHES = (1, 8, 32, 64)


def timed(fn, logits: torch.Tensor) -> tuple[float, tuple[list[int], bool]]:
    start = time.perf_counter()
    answer = fn(logits)
    return time.perf_counter() - start, answer


def measure(batch: int, vocab: int, calls: int) -> tuple[float, float]:
    """Median seconds per call: (torch's ops, the kernel), alternating which goes first."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
    paths = {"torch": greedy_argmax._torch_argmax_if_finite, "kernel": greedy_argmax.argmax_if_finite}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for call in range(calls + 10):
        answers = {}
        for name in (paths if call % 2 == 0 else reversed(paths)):
            seconds, answers[name] = timed(paths[name], logits)
            if call >= 10:   # warm-up calls not counted
                times[name].append(seconds)
        assert answers["torch"] == answers["kernel"], f"batch {batch}: the two paths disagree"
    return statistics.median(times["torch"]), statistics.median(times["kernel"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152, help="logits per row (SmolLM2: 49,152)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "greedy_argmax.txt"))
    args = ap.parse_args()
    if cpu_kernels.module() is None:
        sys.exit(f"the CPU kernels are unavailable here: {cpu_kernels.unavailable_reason()}")
    lines = [f"bench_greedy_argmax  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"argmax of each row + whether every logit is finite, float32 logits [batch, {args.vocab}], "
             f"torch {torch.__version__}, SIMD width {cpu_kernels.module().simd_width}; "
             f"medians of {args.calls} calls, the two paths alternating, answers equal on every call", "",
             f"{'threads':>7}{'batch':>7}{'torch us':>11}{'kernel us':>11}{'speed-up':>10}{'saved us/step':>15}"]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for batch in BATCHES:
            ops, kernel = measure(batch, args.vocab, args.calls)
            lines.append(f"{threads:>7}{batch:>7}{ops * 1e6:>11.1f}{kernel * 1e6:>11.1f}{ops / kernel:>9.1f}x"
                         f"{(ops - kernel) * 1e6:>15.0f}")
    text = "\n".join(lines)
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
