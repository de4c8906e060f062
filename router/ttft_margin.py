"""The share of a TTFT target admission lets a prediction use, calibrated on how far recent
predictions were off.

A fixed margin (predictions must fit 80% of what is left of the target) is right for one spread
of prediction errors only: where predictions are close, it refuses requests that would have met
their target (at a tight SLO every admission decision near the knee is such a request: the
goodput run at TTFT 3 s lost all its misses to refusals, none to late first tokens); where they
are far off, it admits requests that miss. So the margin follows the errors: the share is
1 / (the ``QUANTILE`` of recent observed / predicted ratios of the predicted part), within
[``MIN_SHARE``, ``MAX_SHARE``]; until ``MIN_SAMPLES`` first tokens were seen it is the fixed
``DEFAULT_SHARE``. The ratios are measured after admission's correction (what it decided by).
Requests are admitted when their prediction read low, so the ratios lean high: the margin errs
toward refusing.

Life cycle: one per ``Admission``; ``observe`` at each first token whose TTFT was predicted ->
``share`` read at each decision.
"""

from __future__ import annotations

import collections
import math

DEFAULT_SHARE = 0.8
MIN_SHARE, MAX_SHARE = 0.6, 0.95
QUANTILE = 0.9          # the attainment goodput is judged at
WINDOW = 200
MIN_SAMPLES = 30


class TtftMargin:
    def __init__(self) -> None:
        self._ratios: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.share = DEFAULT_SHARE

    def observe(self, predicted_s: float | None, observed_s: float) -> None:
        """``predicted_s``, ``observed_s``: the part after the time already queued."""
        if not predicted_s or not math.isfinite(predicted_s) or observed_s <= 0:
            return
        self._ratios.append(observed_s / predicted_s)
        if len(self._ratios) >= MIN_SAMPLES:
            ordered = sorted(self._ratios)
            high = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
            self.share = min(MAX_SHARE, max(MIN_SHARE, 1.0 / high))
