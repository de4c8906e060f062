"""SLO-aware admission and pair choice.

For every candidate (prefill, decode) pair the router predicts, from live worker stats, its own
in-flight counts and step-time models fitted online (``router.step_model``):
  TTFT = (prompt tokens waiting for prefill on the prefilling worker + this prompt)
         x its seconds per prefill token + the recent KV hand-off time,
  TPOT = the decode worker's step time with this request added (batch size, KV tokens),
         divided by (1 - u) when that worker also prefills (colocated, or conditional
         disaggregation): u is the share of its time prefill will take while this request
         decodes, from the rate of prompt tokens sent to it (decayed over 20 s) plus this
         prompt spread over the request's lifetime. Prefill steps stall every decode on that
         worker, so at u = 0.5 it delivers tokens at half its decode speed; near u = 1 nothing
         meets a TPOT target.
Both predictions are scaled by an online correction: a log-space EMA of observed / predicted
per finished request (TTFT at the first token, TPOT at the end), absorbing what the models leave
out (RPC latency, contention from other processes, load that arrives later).
Pair choice: among the pairs predicted to meet both targets, disaggregated pairs first, then
the lowest TTFT (balances prefill queues), then the most headroom. Conditional disaggregation:
the decode worker prefilling the prompt itself is a candidate too (no hand-off, but its prefill
interferes with its decodes); it is taken when no prefill worker can meet the request's TTFT
and its own predictions fit: extra prefill capacity exactly when the prefill side is the
bottleneck.
Decision (targets scaled down for lower priority classes, so they are shed first):
  admit  - both predictions within target: the chosen pair runs it;
  queue  - TTFT fits but the decode side is full (TPOT over target, or no KV room): wait for
           capacity until the TTFT deadline, re-evaluated whenever a worker reports;
  reject - TTFT cannot be met even now, or the deadline passed: RESOURCE_EXHAUSTED with the
           prediction in the message.
With no targets (best effort) or before any step timing arrived, requests are admitted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from engine.errors import CapacityError, WorkerFailedError
from engine.types import RequestSpec
from router.registry import WorkerHandle, WorkerRegistry
from router.step_model import StepTimeModel

logger = logging.getLogger(__name__)

# Predictions must fit a share of their target: the models are fitted, not exact. TTFT is a hard
# per-request deadline predicted from a queue (errors add up), TPOT an average over a lifetime
# whose bias the online correction tracks.
TTFT_SAFETY = 0.8
TPOT_SAFETY = 0.9
MAX_PREFILL_SHARE = 0.95  # beyond this a worker that prefills is treated as saturated
DEFAULT_TPOT_S = 0.1      # sizes the prefill-load window when a request has no TPOT target
PRIORITY_STEP = 0.15      # each lower priority class gets 15% less of its targets
MIN_PRIORITY_SCALE = 0.4


@dataclass(frozen=True, slots=True)
class Prediction:
    prefill: WorkerHandle | None   # None: the decode worker prefills (colocated / conditional)
    decode: WorkerHandle
    ttft_s: float | None
    tpot_s: float | None

    def headroom(self, ttft_target: float | None, tpot_target: float | None) -> float:
        """Smallest relative slack against the targets (higher is better; < 0 misses one)."""
        slacks = [1.0 - p / t for p, t in ((self.ttft_s, ttft_target), (self.tpot_s, tpot_target))
                  if p is not None and t]
        return min(slacks) if slacks else float("inf")


@dataclass(frozen=True, slots=True)
class Decision:
    action: str                    # "admit" | "queue" | "reject"
    reason: str
    prediction: Prediction | None = None


class Admission:
    def __init__(self, registry: WorkerRegistry, enabled: bool = True, conditional: bool = True) -> None:
        self.registry = registry
        self.enabled = enabled
        self.conditional = conditional
        self.models: dict[str, StepTimeModel] = {}
        self.handoff_s = 0.0           # EMA of measured hand-off time
        # EMA of observed / predicted TTFT: absorbs what the step models leave out (router and
        # RPC latency, batching granularity, a busy machine). Clamped so one outlier can't
        # shut admission down.
        self.ttft_correction = 1.0
        self.tpot_correction = 1.0     # the same for TPOT: contention, future load, batching
        self._changed = asyncio.Condition()
        self.num_queued = 0

    # ---- inputs ---------------------------------------------------------------------------
    def observe_stats(self, worker: WorkerHandle) -> None:
        if worker.stats is not None:
            steps = worker.stats.recent_steps
            if worker.role == "decode":  # decode TPOT model: pure decode steps only
                steps = tuple(s for s in steps if s.num_prefill_tokens == 0)
            self.model(worker.worker_id).observe(steps)

    def observe_handoff(self, seconds: float) -> None:
        self.handoff_s = seconds if self.handoff_s == 0 else 0.8 * self.handoff_s + 0.2 * seconds

    def observe_ttft(self, predicted_s: float | None, observed_s: float) -> None:
        self.ttft_correction = _corrected(self.ttft_correction, predicted_s, observed_s, 0.8, 3.0)

    def observe_tpot(self, predicted_s: float | None, observed_s: float) -> None:
        self.tpot_correction = _corrected(self.tpot_correction, predicted_s, observed_s, 0.5, 2.0)

    def model(self, worker_id: str) -> StepTimeModel:
        return self.models.setdefault(worker_id, StepTimeModel())

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---- predictions -----------------------------------------------------------------------
    def predict(self, spec: RequestSpec, prefill: WorkerHandle | None, decode: WorkerHandle,
                now: float | None = None) -> Prediction:
        prompt = len(spec.prompt_token_ids)
        now = time.perf_counter() if now is None else now
        return Prediction(prefill, decode, self._ttft(prompt, prefill, decode),
                          self._tpot(spec, decode, prefill is None, now))

    def _prefill_seconds_per_token(self, prefill: WorkerHandle | None) -> float | None:
        """Measured on prefill workers (a decode worker prefilling runs the same model on the
        same kind of core); in colocated mode, on the workers themselves."""
        workers = [prefill] if prefill else (self.registry.alive("prefill") or self.registry.alive("decode"))
        rates = [r for r in (self.model(w.worker_id).seconds_per_prefill_token() for w in workers) if r is not None]
        return min(rates) if rates else None

    def _ttft(self, prompt: int, prefill: WorkerHandle | None, decode: WorkerHandle) -> float | None:
        per_token = self._prefill_seconds_per_token(prefill)
        if per_token is None:
            return None
        prefiller = prefill or decode
        # The router's count is fresh; the worker's own adds prompts it must recompute.
        queued = max(prefiller.num_prefill_tokens, _waiting_tokens(prefiller))
        return ((queued + prompt) * per_token + (self.handoff_s if prefill else 0.0)) * self.ttft_correction

    def _tpot(self, spec: RequestSpec, decode: WorkerHandle, prefills_here: bool, now: float) -> float | None:
        prompt = len(spec.prompt_token_ids)
        seqs = max(decode.num_inflight, decode.stats.num_running if decode.stats else 0) + 1
        step = self.model(decode.worker_id).predict(seqs, _kv_tokens(decode) + prompt, seqs)
        if step is None:
            return None
        share = self._prefill_share(spec, decode, prompt if prefills_here else 0, now)
        tpot = step * self.tpot_correction / (1.0 - share) if share < MAX_PREFILL_SHARE else float("inf")
        logger.debug("%s tpot: seqs %d step %.3f share %.2f correction %.2f -> %.3f s",
                     decode.worker_id, seqs, step, share, self.tpot_correction, tpot)
        return tpot

    def _prefill_share(self, spec: RequestSpec, worker: WorkerHandle, prompt: int, now: float) -> float:
        """Fraction of ``worker``'s time prefill takes while this request decodes: the rate of
        prompt tokens sent to it (recent traffic stands in for what keeps arriving) plus this
        prompt spread over the request's lifetime (max_tokens x TPOT target), times its
        seconds per prefill token."""
        per_token = self._prefill_seconds_per_token(None) or 0.0
        lifetime = spec.sampling.max_tokens * (self._targets(spec)[1] or DEFAULT_TPOT_S)
        return per_token * (worker.prefill_token_rate(now) + prompt / lifetime)

    def candidates(self, spec: RequestSpec, now: float | None = None) -> list[Prediction]:
        decodes = self.registry.alive("decode")
        if not decodes:
            raise WorkerFailedError("no decode worker is alive")
        if not self.registry.prefill:  # colocated mode
            return [self.predict(spec, None, d, now) for d in decodes]
        prefills = self.registry.alive("prefill")
        if not prefills:
            raise WorkerFailedError("no prefill worker is alive")
        preds = [self.predict(spec, p, d, now) for p in prefills for d in decodes]
        if self.conditional:
            preds += [self.predict(spec, None, d, now) for d in decodes]
        return preds

    # ---- decisions ---------------------------------------------------------------------------
    def decide(self, spec: RequestSpec, now: float | None = None) -> Decision:
        ttft_t, tpot_t = self._targets(spec)
        preds = self.candidates(spec, now)
        disagg = [p for p in preds if p.prefill is not None] or preds
        if not self.enabled or (ttft_t is None and tpot_t is None) or any(p.ttft_s is None for p in preds):
            best = min(disagg, key=_load)  # best effort, or no timings yet: least loaded
            return Decision("admit", "best_effort" if self.enabled else "admission_off", best)
        best = self._choose(spec, preds, ttft_t, tpot_t)
        if _idle(best):  # refusing an idle pair helps no one; its timings also refresh the models
            return Decision("admit", "idle", best)
        if ttft_t and best.ttft_s > ttft_t * TTFT_SAFETY:
            return Decision("reject", f"predicted TTFT {best.ttft_s * 1e3:.0f} ms > target {ttft_t * 1e3:.0f} ms", best)
        if tpot_t and best.tpot_s is not None and best.tpot_s > tpot_t * TPOT_SAFETY:
            return Decision("queue", f"predicted TPOT {best.tpot_s * 1e3:.1f} ms > target {tpot_t * 1e3:.1f} ms", best)
        if not _has_kv_room(best.decode, spec):
            return Decision("queue", "decode KV cache full", best)
        return Decision("admit", "within_slo", best)

    @staticmethod
    def _choose(spec: RequestSpec, preds: list[Prediction], ttft_t: float | None, tpot_t: float | None) -> Prediction:
        """Among the pairs predicted to meet both targets (with KV room): disaggregated ones
        first (a decode worker takes a prompt only when no prefill worker can meet its TTFT),
        then the lowest TTFT (it balances prefill queues; TPOT already fits), then the most
        headroom. When none meets both: the most headroom among those meeting TTFT (the
        request may queue for decode capacity), else among all (it will be rejected)."""
        fits_ttft = [p for p in preds if _within(p.ttft_s, ttft_t, TTFT_SAFETY)]
        fits = [p for p in fits_ttft if _within(p.tpot_s, tpot_t, TPOT_SAFETY) and _has_kv_room(p.decode, spec)]
        if fits:
            pool = [p for p in fits if p.prefill is not None] or fits
            return min(pool, key=lambda p: (p.ttft_s, -p.headroom(ttft_t, tpot_t)))
        return max(fits_ttft or preds, key=lambda p: p.headroom(ttft_t, tpot_t))

    async def acquire(self, spec: RequestSpec, metrics=None) -> Prediction:
        """Admit (returning the pair), wait in the queue, or raise CapacityError."""
        ttft_t, _ = self._targets(spec)
        deadline = time.perf_counter() + (ttft_t or 30.0)
        decision = self.decide(spec)
        queued = False
        try:
            while decision.action == "queue":
                if not queued:
                    queued = True
                    self._count_queue(+1, metrics, decision)
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise CapacityError(f"queued past its TTFT deadline ({decision.reason})")
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass
                decision = self.decide(spec)
        finally:
            if queued:
                self._count_queue(-1, metrics)
        if decision.action == "reject":
            raise CapacityError(decision.reason)
        if metrics is not None:
            metrics.admission("admit", decision.reason)
        return decision.prediction

    def _count_queue(self, delta: int, metrics, decision: Decision | None = None) -> None:
        self.num_queued += delta
        if metrics is not None:
            metrics.set_queued(self.num_queued)
            if decision is not None:
                metrics.admission("queue", "tpot" if "TPOT" in decision.reason else "kv_full")

    @staticmethod
    def _targets(spec: RequestSpec) -> tuple[float | None, float | None]:
        scale = max(MIN_PRIORITY_SCALE, 1.0 - PRIORITY_STEP * max(0, spec.priority))
        ttft = spec.slo.ttft_s * scale if spec.slo.ttft_s else None
        tpot = spec.slo.tpot_s * scale if spec.slo.tpot_s else None
        return ttft, tpot


def _corrected(current: float, predicted_s: float | None, observed_s: float, low: float, high: float) -> float:
    """``predicted_s`` already carries ``current``: move it geometrically toward the
    observed/predicted ratio (an EMA in log space), so it converges on the true bias; clamped
    so one outlier can't shut admission down or open it wide."""
    if not predicted_s or not math.isfinite(predicted_s) or observed_s <= 0:
        return current
    return min(high, max(low, current * (observed_s / predicted_s) ** 0.2))


def _within(predicted: float | None, target: float | None, safety: float) -> bool:
    return not target or predicted is None or predicted <= target * safety


def _load(p: Prediction) -> tuple[int, int, int]:
    free = p.decode.stats.num_free_blocks if p.decode.stats else 0
    return (p.prefill.num_prefill_tokens if p.prefill else 0, p.decode.num_inflight, -free)


def _idle(p: Prediction) -> bool:
    busy = p.decode.num_inflight or (p.decode.stats and (p.decode.stats.num_running or p.decode.stats.num_waiting))
    return not busy and not (p.prefill and p.prefill.num_prefill_tokens)


def _waiting_tokens(w: WorkerHandle) -> int:
    return w.stats.num_waiting_tokens if w.stats else 0


def _kv_tokens(w: WorkerHandle) -> int:
    if w.stats is None:
        return 0
    return (w.stats.num_total_blocks - w.stats.num_free_blocks) * w.stats.block_size


def _has_kv_room(w: WorkerHandle, spec: RequestSpec) -> bool:
    if w.stats is None:
        return True
    need = -(-(len(spec.prompt_token_ids) + spec.sampling.max_tokens) // w.stats.block_size)
    return need <= w.stats.num_free_blocks
