"""Online models of a worker's speed, fitted to the step timings it reports.

``StepTimeModel`` fits ``duration = a + b * num_seqs + c * num_kv_tokens + d * num_tokens`` with
non-negative coefficients (more work never makes a step faster) over the worker's recent steps,
then refits without outliers (a cold first step, a burst of foreign load). It predicts the TPOT
a decode worker would have with one more request. ``seconds_per_prefill_token`` is the
throughput view of prefill-dominated steps: what a prefill worker needs per queued prompt token.
Until enough distinct steps have been seen the answers are None (admission is then optimistic).
Torch-free (numpy only).
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from engine.types import StepTiming

MIN_STEPS = 4
OUTLIER_FACTOR = 3.0     # residual beyond 3x the median absolute residual (and 1 ms) is dropped


class StepTimeModel:
    def __init__(self, max_steps: int = 256) -> None:
        self._steps: deque[StepTiming] = deque(maxlen=max_steps)
        self._seen: set[tuple] = set()
        self._coef: np.ndarray | None = None
        self._dirty = False
        self._spt: float | None = None
        self._spt_dirty = False

    def observe(self, steps: tuple[StepTiming, ...]) -> None:
        """Add steps not seen before (a worker's recent steps arrive many times)."""
        for s in steps:
            key = (s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s)
            if key not in self._seen:
                self._seen.add(key)
                self._steps.append(s)
                self._dirty = self._spt_dirty = True
        if len(self._seen) > 4 * self._steps.maxlen:
            self._seen = {(s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s) for s in self._steps}

    @property
    def ready(self) -> bool:
        return len(self._steps) >= MIN_STEPS

    def predict(self, num_seqs: int, num_kv_tokens: int, num_tokens: int) -> float | None:
        coef = self._fit()
        if coef is None:
            return None
        return float(np.array([1.0, num_seqs, num_kv_tokens, num_tokens]) @ coef)

    def seconds_per_prefill_token(self) -> float | None:
        """Step time per token over steps that are mostly prefill (decode-only steps excluded).
        Cached until new steps arrive: admission asks for it per candidate pair, again for
        every queued request each time a worker reports."""
        if self._spt_dirty:
            steps = [s for s in self._steps if 2 * s.num_prefill_tokens >= s.num_tokens > 0]
            total = sum(s.num_tokens for s in steps)
            self._spt = sum(s.duration_s for s in steps) / total if total else None
            self._spt_dirty = False
        return self._spt

    def _fit(self) -> np.ndarray | None:
        if not self.ready:
            return None
        if self._dirty or self._coef is None:
            x = np.array([[1.0, s.num_seqs, s.num_kv_tokens, s.num_tokens] for s in self._steps])
            y = np.array([s.duration_s for s in self._steps])
            coef = _nnls(x, y)
            residual = np.abs(x @ coef - y)
            keep = residual <= max(OUTLIER_FACTOR * float(np.median(residual)), 1e-3)
            if keep.sum() >= MIN_STEPS and not keep.all():
                coef = _nnls(x[keep], y[keep])
            self._coef, self._dirty = coef, False
        return self._coef


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: with 4 features, trying every subset is exact and cheap."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y * y))
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sub, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.all(sub >= 0):
                coef = np.zeros(x.shape[1])
                coef[list(cols)] = sub
                err = float(np.sum((x @ coef - y) ** 2))
                if err < best_err:
                    best, best_err = coef, err
    return best
