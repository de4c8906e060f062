"""``StepTimeModel`` keeps its window in a ring of rows and refits from it: its answers must be
those of a fit from scratch over the same steps (here: every subset of the features solved by
numpy's least squares, the feasible one with the least error, then again without outliers)."""

from __future__ import annotations

import itertools
import random
from collections import deque

import numpy as np
import pytest

from engine.types import StepTiming
from router.step_model import MIN_STEPS, OUTLIER_FACTOR, REFIT_AFTER, StepTimeModel

WINDOW = 256
QUERIES = ((1, 0), (8, 3000), (40, 12000), (99, 30000))


def reference_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    best, best_err = np.zeros(x.shape[1]), float(y @ y)
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sub = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            err = float(np.sum((x[:, cols] @ sub - y) ** 2))
            if sub.min() >= 0 and err < best_err:
                best, best_err = np.zeros(x.shape[1]), err
                best[list(cols)] = sub
    return best


def reference_fit(steps: list[StepTiming]) -> tuple[float, float, float] | None:
    decode = [s for s in steps if s.num_prefill_tokens == 0]
    if len(decode) < MIN_STEPS:
        return None
    x = np.array([[1.0, s.num_seqs, s.num_kv_tokens] for s in decode])
    y = np.array([s.duration_s for s in decode])
    coef = reference_nnls(x, y)
    residual = np.abs(x @ coef - y)
    keep = residual <= max(OUTLIER_FACTOR * float(np.median(residual)), 1e-3)
    if MIN_STEPS <= keep.sum() < len(keep):
        coef = reference_nnls(x[keep], y[keep])
    return tuple(coef)


def reference_prefill(steps: list[StepTiming], coef) -> tuple[float | None, float | None]:
    mostly = [s for s in steps if 2 * s.num_prefill_tokens >= s.num_tokens > 0]
    tokens = sum(s.num_tokens for s in mostly)
    spt = sum(s.duration_s for s in mostly) / tokens if tokens else None
    mixed = [s for s in steps if s.num_prefill_tokens > 0]
    prompt = sum(s.num_prefill_tokens for s in mixed)
    if not prompt or (coef is None and any(s.num_tokens > s.num_prefill_tokens for s in mixed)):
        return spt, None
    a, b, c = coef or (0.0, 0.0, 0.0)
    stall = sum(max(0.0, s.duration_s - (a + b * (s.num_tokens - s.num_prefill_tokens) + c * s.num_kv_tokens
                                         if s.num_tokens > s.num_prefill_tokens else 0.0)) for s in mixed)
    return spt, stall / prompt


def step(rng: random.Random, kv_cost: float) -> StepTiming:
    """A decode step (one in 40 slowed by foreign load, far beyond the trim's threshold: no
    step's fate hangs on a rounding), or now and then one carrying a prompt chunk."""
    seqs, kv = rng.randrange(1, 100), rng.randrange(10, 30000)
    duration = 0.010 + 0.0045 * seqs + kv_cost * kv + rng.uniform(0, 1e-4)
    if rng.random() < 1 / 40:
        duration += 0.020
    prompt = rng.choice((0,) * 12 + (64, 256))
    return StepTiming(seqs, seqs + prompt, prompt, kv, duration + prompt * 1.3e-3)


@pytest.mark.parametrize("kv_cost", [0.0, 2e-7])   # 0: the fit's KV slope sits on its bound
def test_answers_equal_a_fit_from_scratch_over_the_same_window(kv_cost):
    rng = random.Random(7)
    model, recent, history = StepTimeModel(WINDOW), deque(maxlen=64), []
    for _ in range(150):   # ~1,200 steps: the ring wraps four times; prefill steps enter and leave it
        decode_steps = 0
        while decode_steps < REFIT_AFTER:   # every report brings enough decode steps for a refit
            s = step(rng, kv_cost)
            decode_steps += s.num_prefill_tokens == 0
            recent.append(s)
            history.append(s)
        model.observe(tuple(recent))
        window = history[-WINDOW:]
        coef = reference_fit(window)
        spt, stall = reference_prefill(window, coef)
        for n, kv in QUERIES:
            assert model.predict(n, kv) == pytest.approx(coef[0] + coef[1] * n + coef[2] * kv, rel=1e-9)
        assert model.seconds_per_prefill_token() == pytest.approx(spt, rel=1e-12)
        assert model.prefill_stall_per_token() == pytest.approx(stall, rel=1e-9)


def test_a_report_seen_again_changes_nothing_and_old_steps_leave_the_window():
    rng = random.Random(3)
    steps = [step(rng, 1e-7) for _ in range(2 * WINDOW)]
    steps += [s for s in (step(rng, 1e-7) for _ in range(99)) if not s.num_prefill_tokens][:REFIT_AFTER]
    model = StepTimeModel(WINDOW)
    for k in range(0, len(steps), REFIT_AFTER):   # reports overlapping their predecessors; the last refits
        model.observe(tuple(steps[max(0, k - 56):k + REFIT_AFTER]))
        model.observe(tuple(steps[max(0, k - 56):k + REFIT_AFTER]))
    fresh = StepTimeModel(WINDOW)
    fresh.observe(tuple(steps[-WINDOW:]))
    assert model.coefficients() == pytest.approx(fresh.coefficients(), rel=1e-12, abs=1e-15)
    assert model.seconds_per_prefill_token() == pytest.approx(fresh.seconds_per_prefill_token(), rel=1e-12)
    assert model.prefill_stall_per_token() == pytest.approx(fresh.prefill_stall_per_token(), rel=1e-12)
