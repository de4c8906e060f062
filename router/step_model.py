"""Online models of a worker's speed, fitted to the step timings it reports.

``StepTimeModel`` fits ``duration = a + b * num_seqs + c * num_kv_tokens`` with non-negative
coefficients (more work never makes a step faster) over the worker's recent decode-only steps,
then refits without outliers (a cold first step, a burst of foreign load). It predicts the step
time a worker's decodes would see with one more request; steps carrying prefill are left out of
it (a colocated worker's mixed steps would inflate it, and admission counts prefill separately,
as a share of the worker's time). ``seconds_per_prefill_token`` is the throughput view of
prefill-dominated steps: what a worker needs per queued prompt token (TTFT);
``prefill_stall_per_token`` what each prompt token adds to the steps decodes wait on (TPOT).
Until enough distinct steps have been seen the answers are None (admission is then optimistic).
Every answer is computed when the steps arrive (``observe``, on a worker's report), never when it
is asked for: admission asks per candidate worker in every decision, and a refit there made the
decisions' tail (a decision after many reports refitted many workers). Per report the work is
bounded: only the steps new in the report are read, the decode fit is redone every
``REFIT_AFTER`` new decode steps (a worker reports every step), the prefill figures when
prefill steps came or went or the fit changed.
Torch-free (numpy only).
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from engine.types import StepTiming

MIN_STEPS = 4
OUTLIER_FACTOR = 3.0     # residual beyond 3x the median absolute residual (and 1 ms) is dropped
REFIT_AFTER = 8          # new decode steps before the fit is redone (7 least-squares solves; workers report every step)


class StepTimeModel:
    def __init__(self, max_steps: int = 256) -> None:
        self._steps: deque[StepTiming] = deque(maxlen=max_steps)
        self._seen: set[tuple] = set()
        self._unfitted = 0   # decode steps observed since the last fit
        # The answers, as of the last ``observe``: admission reads them per candidate worker.
        self._coef: tuple[float, float, float] | None = None
        self._spt: float | None = None
        self._stall: float | None = None

    def observe(self, steps: tuple[StepTiming, ...]) -> None:
        """Add steps not seen before. A worker's recent steps arrive many times, as a window
        that slides: the new ones are at its end, so the scan stops at the first step seen."""
        new = []
        for s in reversed(steps):
            key = (s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s)
            if key in self._seen:
                break
            self._seen.add(key)
            new.append(s)
        if not new:
            return
        evicted = itertools.islice(self._steps, max(0, len(self._steps) + len(new) - self._steps.maxlen))
        prefill_changed = any(s.num_prefill_tokens for s in itertools.chain(new, evicted))
        self._steps.extend(reversed(new))
        self._unfitted += sum(1 for s in new if s.num_prefill_tokens == 0)
        refit = self._unfitted and (self._coef is None or self._unfitted >= REFIT_AFTER)
        if refit:
            self._coef = self._fit_decode_steps()
        if prefill_changed:
            self._spt = self._seconds_per_prefill_token()
        if prefill_changed or refit:
            self._stall = self._prefill_stall_per_token()
        if len(self._seen) > 4 * self._steps.maxlen:
            self._seen = {(s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s) for s in self._steps}

    def predict(self, num_seqs: int, num_kv_tokens: int) -> float | None:
        """Duration of a decode step over ``num_seqs`` sequences holding ``num_kv_tokens``."""
        coef = self._coef
        if coef is None:
            return None
        a, b, c = coef   # plain floats: admission asks per candidate worker, per decision
        return a + b * num_seqs + c * num_kv_tokens

    def coefficients(self) -> tuple[float, float, float] | None:
        """The fitted (a, b, c) of ``a + b * num_seqs + c * num_kv_tokens``; None until fitted."""
        return self._coef

    def seconds_per_prefill_token(self) -> float | None:
        """Step time per token over steps that are mostly prefill (decode-only steps excluded)."""
        return self._spt

    def prefill_stall_per_token(self) -> float | None:
        """What a prefill token adds to the step it rides in, beyond the decode step it shares
        (the step minus the fitted decode step of its decode sequences): the stall decodes on
        this worker see per prompt token. None until both kinds of step have been seen."""
        return self._stall

    def _seconds_per_prefill_token(self) -> float | None:
        steps = [s for s in self._steps if 2 * s.num_prefill_tokens >= s.num_tokens > 0]
        total = sum(s.num_tokens for s in steps)
        return sum(s.duration_s for s in steps) / total if total else None

    def _prefill_stall_per_token(self) -> float | None:
        steps = [s for s in self._steps if s.num_prefill_tokens > 0]
        decode = [self.predict(s.num_tokens - s.num_prefill_tokens, s.num_kv_tokens)
                  if s.num_tokens > s.num_prefill_tokens else 0.0 for s in steps]
        total = sum(s.num_prefill_tokens for s in steps)
        if not total or None in decode:
            return None
        return sum(max(0.0, s.duration_s - d) for s, d in zip(steps, decode)) / total

    def _fit_decode_steps(self) -> tuple[float, float, float] | None:
        self._unfitted = 0
        steps = [s for s in self._steps if s.num_prefill_tokens == 0]
        return tuple(float(c) for c in self._fit_steps(steps)) if len(steps) >= MIN_STEPS else None

    @staticmethod
    def _fit_steps(steps: list[StepTiming]) -> np.ndarray:
        x = np.array([[1.0, s.num_seqs, s.num_kv_tokens] for s in steps])
        y = np.array([s.duration_s for s in steps])
        coef = _nnls(x, y)
        residual = np.abs(x @ coef - y)
        keep = residual <= max(OUTLIER_FACTOR * float(np.median(residual)), 1e-3)
        if keep.sum() >= MIN_STEPS and not keep.all():
            coef = _nnls(x[keep], y[keep])
        return coef


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: with 3 features, trying every subset of them is
    exact and cheap. All seven come from one Gram matrix of the columns scaled to [0, 1]: each
    is a 1-3 unknown solve of its normal equations and its squared error a quadratic form, in
    plain floats (microseconds; a least-squares solve over every row for each was most of a
    refit, and admission refits each worker every few of its steps)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    gram, moment, total = (xs.T @ xs).tolist(), (xs.T @ y).tolist(), float(y @ y)
    n = x.shape[1]
    best, best_err = [0.0] * n, total
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = _solve([[gram[i][j] for j in cols] for i in cols], [moment[i] for i in cols])
            if sub is None or min(sub) < 0:
                continue   # collinear columns (a smaller subset reaches the same fits), or infeasible
            coef = [0.0] * n
            for i, c in zip(cols, sub):
                coef[i] = c
            err = total - 2 * sum(c * m for c, m in zip(coef, moment)) \
                + sum(coef[i] * gram[i][j] * coef[j] for i in cols for j in cols)
            if err < best_err:
                best, best_err = coef, err
    return np.array(best) / scale


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a`` x = ``b`` for a small symmetric positive semi-definite ``a`` (Gaussian elimination
    with partial pivoting); None when ``a`` is singular."""
    n = len(b)
    tiny = 1e-10 * max(abs(a[i][i]) for i in range(n))
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= tiny:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
