"""Two (or more) ways of doing the same work timed against each other in one process: called in
turn, the order alternating every call (so neither always runs on a warm cache), the first 3
calls left out, every call's answers compared (a faster path that answers differently is no
faster path). What bench_logit_adjust and bench_grammar measure their batched call against its peer with,
and how they end their reports (``report``: the decode step beside them, for scale)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.results_file import write_run

WARM_UP_CALLS = 3


def interleaved_medians(paths: dict[str, Callable[[], torch.Tensor]], calls: int) -> dict[str, float]:
    """Median seconds per call of each path; raises AssertionError where two paths disagree."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for call in range(calls + WARM_UP_CALLS):
        answers = {}
        for name in (order if call % 2 == 0 else reversed(order)):
            start = time.perf_counter()
            answers[name] = paths[name]()
            if call >= WARM_UP_CALLS:
                times[name].append(time.perf_counter() - start)
        first = answers[order[0]]
        assert all(torch.equal(first, answer) for answer in answers.values()), "the paths disagree"
    return {name: statistics.median(t) for name, t in times.items()}


def report(lines: list[str], who_pays: str, out) -> None:
    """Print and record (``results_file.write_run`` to ``out``) a per-step cost table, closed by
    the decode step it adds to; ``who_pays``: the requests that pay it."""
    lines = [*lines, "", "For scale: SmolLM2's decode step at batch 64 is ~140-160 ms on 2 threads and at batch 1 ~30 ms on 1",
             f"(results/engine_w64.txt, results/decode_step.txt); only {who_pays} pay it."]
    text = "\n".join(lines)
    print(text)
    write_run(out, text)
