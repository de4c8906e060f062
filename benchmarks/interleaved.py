"""Two (or more) ways of doing the same work timed against each other in one process: called in
turn, the order alternating every call (so neither always runs on a warm cache), the first 3
calls left out, every call's answers compared (a faster path that answers differently is no
faster path). What bench_logit_adjust and bench_grammar measure their batched call against its peer with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

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
