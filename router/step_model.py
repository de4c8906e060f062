"""Online models of a worker's speed, fitted to the step timings it reports.

``StepTimeModel`` fits ``duration = a + b * num_seqs + c * num_kv_tokens + d * num_tokens`` by
least squares over the worker's recent steps; it predicts the TPOT a decode worker would have
with one more request, and the time a prefill worker needs for its queued prompt tokens.
Until enough distinct steps have been seen it answers None (admission is then optimistic).
Torch-free (numpy only).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.types import StepTiming

MIN_STEPS = 4


class StepTimeModel:
    def __init__(self, max_steps: int = 256) -> None:
        self._steps: deque[StepTiming] = deque(maxlen=max_steps)
        self._seen: set[tuple] = set()
        self._coef: np.ndarray | None = None
        self._dirty = False

    def observe(self, steps: tuple[StepTiming, ...]) -> None:
        """Add steps not seen before (a worker's recent steps arrive many times)."""
        for s in steps:
            key = (s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s)
            if key not in self._seen:
                self._seen.add(key)
                self._steps.append(s)
                self._dirty = True
        if len(self._seen) > 4 * self._steps.maxlen:
            self._seen = {(s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s) for s in self._steps}

    @property
    def ready(self) -> bool:
        return len(self._steps) >= MIN_STEPS

    def predict(self, num_seqs: int, num_kv_tokens: int, num_tokens: int) -> float | None:
        coef = self._fit()
        if coef is None:
            return None
        x = np.array([1.0, num_seqs, num_kv_tokens, num_tokens])
        return float(max(x @ coef, self._min_duration()))

    def seconds_per_token(self) -> float | None:
        """Throughput view for prefill: total step time over total tokens of recent steps."""
        if not self.ready:
            return None
        tokens = sum(s.num_tokens for s in self._steps)
        return sum(s.duration_s for s in self._steps) / tokens if tokens else None

    def _fit(self) -> np.ndarray | None:
        if not self.ready:
            return None
        if self._dirty or self._coef is None:
            rows = np.array([[1.0, s.num_seqs, s.num_kv_tokens, s.num_tokens] for s in self._steps])
            y = np.array([s.duration_s for s in self._steps])
            # Non-negative slopes: more work never makes a step faster (keeps sparse data sane).
            coef, *_ = np.linalg.lstsq(rows, y, rcond=None)
            self._coef = np.maximum(coef, 0.0)
            self._dirty = False
        return self._coef

    def _min_duration(self) -> float:
        return min(s.duration_s for s in self._steps)
