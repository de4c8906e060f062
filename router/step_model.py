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

Life cycle: one model per worker (admission's); every report's steps go to ``observe``, which
keeps the new ones in a ring of rows (numpy, one row per step, the oldest overwritten) and
computes every answer there: admission reads them per candidate worker in every decision, and a
refit inside a decision made the decisions' tail. Per report the work is bounded: only the steps
new in the report are read, the decode fit is redone every ``REFIT_AFTER`` new decode steps (a
worker reports every step), the prefill figures when prefill steps came or went or the fit
changed. A refit reads the ring with numpy (the Gram matrix of the window, the residuals, the
trim) and solves seven 1-3 unknown systems in plain floats: tens of microseconds, where building
the rows from ``StepTiming`` objects and a generic elimination per subset took several hundred.
(Gram sums kept up to date as steps enter and leave would cost as much per step as numpy's pass
over the window costs per refit, and drift; the trim needs every residual anyway.)
Torch-free (numpy only).
"""

from __future__ import annotations

import itertools

import numpy as np

from engine.types import StepTiming

MIN_STEPS = 4
OUTLIER_FACTOR = 3.0     # residual beyond 3x the median absolute residual (and 1 ms) is dropped
REFIT_AFTER = 8          # new decode steps before the fit is redone (workers report every step)
SINGULAR = 1e-10         # a pivot this small, relative to the matrix's diagonal: collinear columns

# The ring's columns: the fit's features first (a constant 1 for the intercept), so the decode
# rows' first three columns are its design matrix and the fourth its target.
_ONE, _SEQS, _KV, _DUR, _TOKENS, _PREFILL = range(6)
_NUM_FEATURES = 3


def _row(s: StepTiming) -> tuple:
    return 1.0, s.num_seqs, s.num_kv_tokens, s.duration_s, s.num_tokens, s.num_prefill_tokens


def _key(s: StepTiming) -> tuple:
    return s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s


class StepTimeModel:
    def __init__(self, max_steps: int = 256) -> None:
        self._rows = np.zeros((max_steps, 6))   # the ring (owner: this model); slots [0, _size) hold steps
        self._size = 0
        self._next = 0         # the slot the next step goes to: the oldest step's once the ring is full
        self._seen: set[tuple] = set()
        self._unfitted = 0     # decode steps observed since the last fit
        # The answers, as of the last ``observe``: admission reads them per candidate worker.
        self._coef: tuple[float, float, float] | None = None
        self._spt: float | None = None
        self._stall: float | None = None

    def observe(self, steps: tuple[StepTiming, ...]) -> None:
        """Add steps not seen before. A worker's recent steps arrive many times, as a window
        that slides: the new ones are at its end, so the scan stops at the first step seen."""
        new = []
        for s in reversed(steps):
            key = _key(s)
            if key in self._seen:
                break
            self._seen.add(key)
            new.append(s)
        if not new:
            return
        new.reverse()
        prefill_changed = self._append(new)
        self._unfitted += sum(1 for s in new if s.num_prefill_tokens == 0)
        refit = self._unfitted and (self._coef is None or self._unfitted >= REFIT_AFTER)
        if refit:
            self._coef = self._fit_decode_steps()
        if prefill_changed:
            self._spt = self._seconds_per_prefill_token()
        if prefill_changed or refit:
            self._stall = self._prefill_stall_per_token()
        if len(self._seen) > 4 * len(self._rows):
            window = self._window()
            self._seen = set(zip(*(window[:, c].tolist() for c in (_SEQS, _TOKENS, _KV, _DUR))))

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

    def _append(self, new: list[StepTiming]) -> bool:
        """Write ``new`` (oldest first) over the oldest rows; whether a prefill step came or went.
        A step at a time (a report brings one or two new steps: numpy's fancy indexing costs more)."""
        rows, capacity = self._rows, len(self._rows)
        changed = False
        for s in new[-capacity:]:
            slot = self._next
            changed = changed or s.num_prefill_tokens > 0 or (slot < self._size and rows[slot, _PREFILL] > 0)
            rows[slot] = _row(s)
            self._next = (slot + 1) % capacity
            self._size = max(self._size, slot + 1)
        return bool(changed)

    def _window(self) -> np.ndarray:
        """The steps held, in no particular order (every answer is a sum or a median over them)."""
        return self._rows[:self._size]

    def _seconds_per_prefill_token(self) -> float | None:
        rows = self._window()
        tokens = rows[:, _TOKENS]
        mostly_prefill = rows[(2 * rows[:, _PREFILL] >= tokens) & (tokens > 0)]
        total = float(mostly_prefill[:, _TOKENS].sum())
        return float(mostly_prefill[:, _DUR].sum()) / total if total else None

    def _prefill_stall_per_token(self) -> float | None:
        rows = self._window()
        rows = rows[rows[:, _PREFILL] > 0]
        total = float(rows[:, _PREFILL].sum())
        decode_seqs = rows[:, _TOKENS] - rows[:, _PREFILL]
        if not total or (self._coef is None and (decode_seqs > 0).any()):
            return None
        a, b, c = self._coef or (0.0, 0.0, 0.0)
        decode = np.where(decode_seqs > 0, a + b * decode_seqs + c * rows[:, _KV], 0.0)
        return float(np.maximum(0.0, rows[:, _DUR] - decode).sum()) / total

    def _fit_decode_steps(self) -> tuple[float, float, float] | None:
        self._unfitted = 0
        rows = self._window()
        decode = rows[rows[:, _PREFILL] == 0]
        if len(decode) < MIN_STEPS:
            return None
        return tuple(float(c) for c in _fit_steps(decode[:, :_NUM_FEATURES], decode[:, _DUR]))


def _fit_steps(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The non-negative fit, then again without the rows it explains worst (outliers)."""
    coef = _nnls(x, y)
    residual = np.abs(x @ coef - y)
    keep = residual <= max(OUTLIER_FACTOR * float(np.median(residual)), 1e-3)
    if MIN_STEPS <= keep.sum() < len(keep):
        coef = _nnls(x[keep], y[keep])
    return coef


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: with 3 features, trying every subset of them is
    exact and cheap. All seven come from one Gram matrix of the columns scaled to [0, 1]
    (numpy: one pass over the rows); each is a 1-3 unknown solve of its normal equations and its
    squared error a quadratic form (not ``y.y - coef.moment``, equal in exact arithmetic but
    first-order in the solve's rounding: it flipped choices between fits that differ by less),
    in plain floats (microseconds; admission refits each worker every few of its steps)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    gram, moment, total = (xs.T @ xs).tolist(), (xs.T @ y).tolist(), float(y @ y)
    n = x.shape[1]
    best, best_err = [0.0] * n, total
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = _solve(gram, moment, cols)
            if sub is None or min(sub) < 0:
                continue   # collinear columns (a smaller subset reaches the same fits), or infeasible
            err = total - 2 * sum(c * moment[i] for c, i in zip(sub, cols)) \
                + sum(c * gram[i][j] * d for c, i in zip(sub, cols) for d, j in zip(sub, cols))
            if err < best_err:
                best, best_err = [0.0] * n, err
                for i, c in zip(cols, sub):
                    best[i] = c
    return np.array(best) / scale


def _solve(g: list[list[float]], m: list[float], cols: tuple[int, ...]) -> list[float] | None:
    """The normal equations restricted to ``cols`` (1-3 of them), by Cramer's rule; None when
    that part of the symmetric positive semi-definite ``g`` is singular (a determinant this
    small relative to its diagonal's product: the columns are collinear)."""
    if len(cols) == 1:
        (i,) = cols
        return [m[i] / g[i][i]] if g[i][i] > 0 else None
    if len(cols) == 2:
        i, j = cols
        det = g[i][i] * g[j][j] - g[i][j] * g[i][j]
        if det <= SINGULAR * g[i][i] * g[j][j]:
            return None
        return [(m[i] * g[j][j] - g[i][j] * m[j]) / det, (g[i][i] * m[j] - g[i][j] * m[i]) / det]
    (a, b, c), (_, d, e), (_, _, f) = g          # cols == (0, 1, 2): [[a b c] [b d e] [c e f]]
    co_a, co_b, co_c = d * f - e * e, c * e - b * f, b * e - c * d   # the first row's cofactors
    det = a * co_a + b * co_b + c * co_c
    if det <= SINGULAR * a * d * f:
        return None
    co_d, co_e, co_f = a * f - c * c, b * c - a * e, a * d - b * b
    return [(co_a * m[0] + co_b * m[1] + co_c * m[2]) / det,
            (co_b * m[0] + co_d * m[1] + co_e * m[2]) / det,
            (co_c * m[0] + co_e * m[1] + co_f * m[2]) / det]
