"""SLO-aware admission and pair choice.

For every candidate (prefill, decode) pair the router predicts, from live worker stats, its own
in-flight counts and step-time models fitted online (``router.step_model``):
  TTFT = time already spent queued + (prompt tokens waiting for prefill on the prefilling
         worker + this prompt's tokens not in its prefix cache) x its seconds per prefill token
         (no KV hand-off term: the first token goes ahead of it). The cached part is the
         router's guess (``router.prefix_index``): a prefix placed on that worker recently;
  TPOT = the decode worker's step time with this request added (batch size, KV tokens),
         divided by (1 - u) when that worker also prefills (colocated, or conditional
         disaggregation): u is the share of its time prefill takes over the long run, from the
         rate of prompt tokens sent to it (a minute's average). Prompts already queued there
         are prefilled before this request's first token: they cost its TTFT, not its TPOT;
  the admitted requests' TPOT: each request admitted to that worker, projected from where it
         is (time since its first token, tokens left) through the prefill queued behind it there
         plus this prompt when it prefills there, then steps at the predicted rate. A burst of
         prompts is paid by the requests decoding while it is prefilled; this is what keeps it
         within their targets, at once, while the long-run rate is still catching up.
Both carry an online correction, a log-space EMA of observed / predicted that absorbs what the
models leave out (RPC latency, chunking granularity, batch growth). TTFT: the admission-time
prediction against the first token. TPOT: a prediction made afresh at each request's first
token (its projection from the state then) against its TPOT at the end; learning it from the
admission-time prediction instead is biased upward (a request is admitted when the load
estimate happens to read low, then meets the average load), which made admission reject
requests that would have met their target.
Pair choice: among the pairs predicted to meet both targets, disaggregated pairs first, then
the lowest TTFT (balances prefill queues, and weighs a cached prefix against a longer queue: both
are prompt tokens to compute), then the most headroom. Without targets or timings: the least
queued work (prefill tokens queued there minus the prefix expected cached there), then the
fewest requests decoding, then the decode worker holding most of the prompt already (fewer
bytes to move). A decode worker that holds all of a prompt but its last block
(``LOCAL_PREFILL_TOKENS`` or fewer to compute) is taken like a disaggregated pair: a hand-off
would cost more than that prefill. Conditional disaggregation:
the decode worker prefilling the prompt itself is a candidate too (no hand-off, but its prefill
interferes with its decodes); it is taken when no prefill worker can meet the request's TTFT
and its own predictions fit: extra prefill capacity exactly when the prefill side is the
bottleneck.
Decision (targets scaled down for lower priority classes, so they are shed first):
  admit  - every prediction within target: the chosen pair runs it;
  queue  - TTFT fits but the decode side is full (its or a running request's TPOT over target,
           or no KV room): wait for capacity, re-evaluated when a worker reports (the oldest
           ``MAX_WAKE_PER_NOTIFY`` per report, ``router.wakeup``), until the time queued leaves no
           room for its TTFT; a queue already ``max_queued`` long refuses at once;
  reject - TTFT cannot be met even now, or the deadline passed: RESOURCE_EXHAUSTED with the
           prediction in the message.
With no targets (best effort) or before any step timing arrived, requests are admitted.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from engine.errors import CapacityError, WorkerFailedError
from engine.types import RequestSpec
from router.registry import DecodeProgress, WorkerHandle, WorkerRegistry
from router.step_model import StepTimeModel
from router.wakeup import FairWakeup

logger = logging.getLogger(__name__)

# Predictions must fit a share of their target: the models are fitted, not exact. TTFT is a hard
# per-request deadline predicted from a queue (errors add up), TPOT an average over a lifetime.
TTFT_SAFETY = 0.8
TPOT_SAFETY = 0.9
MAX_PREFILL_SHARE = 0.95  # beyond this a worker that prefills is treated as saturated
PRIORITY_STEP = 0.15      # each lower priority class gets 15% less of its targets
MIN_PRIORITY_SCALE = 0.4
RESUME_WAIT_S = 60.0      # a migrating request waits this long for a worker to come back
MAX_WAKE_PER_NOTIFY = 8   # queued requests re-evaluated per worker report: bounded work per step
LOCAL_PREFILL_TOKENS = 16  # a decode worker prefilling this few is cheaper than a hand-off (~one decode step's cost)


@dataclass(frozen=True, slots=True)
class Prediction:
    prefill: WorkerHandle | None   # None: the decode worker prefills (colocated / conditional)
    decode: WorkerHandle
    ttft_s: float | None           # including the time already spent queued
    tpot_s: float | None           # this request's
    running_tpot_ratio: float | None = None  # worst projected / target TPOT of those decoding there
    waited_s: float = 0.0
    num_prompt_tokens: int = 0
    cached_tokens: int = 0         # expected in the prefilling worker's prefix cache
    decode_cached_tokens: int = 0  # expected in the decode worker's (not moved in a hand-off)

    @property
    def tokens_to_prefill(self) -> int:
        return self.num_prompt_tokens - self.cached_tokens

    @property
    def cheap_local(self) -> bool:
        """The decode worker prefills, and holds all of the prompt in its cache but a block's
        worth: as good as a hand-off. (Short uncached prompts stay disaggregated: see above.)"""
        return self.prefill is None and self.cached_tokens > 0 and self.tokens_to_prefill <= LOCAL_PREFILL_TOKENS

    def headroom(self, ttft_target: float | None, tpot_target: float | None) -> float:
        """Smallest relative slack against the targets (higher is better; < 0 misses one)."""
        slacks = [1.0 - p / t for p, t in ((self.ttft_s, ttft_target), (self.tpot_s, tpot_target))
                  if p is not None and t]
        if self.running_tpot_ratio is not None:
            slacks.append(1.0 - self.running_tpot_ratio)
        return min(slacks) if slacks else float("inf")

    @property
    def spares_running(self) -> bool:
        """No request decoding there would be pushed past the safety share of its TPOT target."""
        return self.running_tpot_ratio is None or self.running_tpot_ratio <= TPOT_SAFETY

    def fits_tpot(self, target: float | None) -> bool:
        return self.spares_running and _within(self.tpot_s, target, TPOT_SAFETY)

    def fits_ttft(self, target: float | None) -> bool:
        """The predicted part, not the time already queued (known exactly), must fit the
        safety share of what is left: a request that waited for decode capacity is not
        rejected for a margin on time that is no longer uncertain."""
        if not target or self.ttft_s is None:
            return True
        return self.ttft_s - self.waited_s <= (target - self.waited_s) * TTFT_SAFETY


@dataclass(frozen=True, slots=True)
class Decision:
    action: str                    # "admit" | "queue" | "reject"
    reason: str
    prediction: Prediction | None = None


class Admission:
    def __init__(self, registry: WorkerRegistry, enabled: bool = True, conditional: bool = True,
                 max_queued: int | None = None) -> None:
        self.registry = registry
        self.enabled = enabled
        self.conditional = conditional
        self.models: dict[str, StepTimeModel] = {}
        # EMA of observed / predicted TTFT: absorbs what the step models leave out (router and
        # RPC latency, batching granularity, a busy machine). Clamped so one outlier can't
        # shut admission down.
        self.ttft_correction = 1.0
        self.tpot_correction = 1.0     # the same for TPOT (see the module docstring)
        self._waiters = FairWakeup()
        self.num_queued = 0
        self.max_queued = max_queued   # a full queue answers RESOURCE_EXHAUSTED at once (None: unbounded)

    # ---- inputs ---------------------------------------------------------------------------
    def observe_stats(self, worker: WorkerHandle) -> None:
        if worker.stats is not None:
            self.model(worker.worker_id).observe(worker.stats.recent_steps)

    def observe_ttft(self, pair: Prediction, observed_s: float) -> None:
        """``observed_s`` from arrival; the time queued is known exactly, only the rest was predicted."""
        if pair.ttft_s is not None:
            self.ttft_correction = _corrected(self.ttft_correction, pair.ttft_s - pair.waited_s,
                                              observed_s - pair.waited_s, 0.8, 3.0)

    def expect_tpot(self, decode: WorkerHandle, progress: DecodeProgress, now: float | None = None) -> None:
        """At a request's first token: its projected TPOT from the state now, kept on
        ``progress`` for ``observe_tpot`` (a prediction admission did not select on)."""
        now = time.perf_counter() if now is None else now
        step = self._decode_step(decode, 0, now, joining=False)
        if step is not None:
            behind = min(_queued_prefill_tokens(decode), decode.prefill_tokens_sent - progress.prefill_mark)
            progress.predicted_tpot_s = progress.projected_tpot(now, step, behind * self._stall_per_token(decode))

    def observe_tpot(self, progress: DecodeProgress, observed_s: float) -> None:
        self.tpot_correction = _corrected(self.tpot_correction, progress.predicted_tpot_s, observed_s, 0.5, 1.5)

    def model(self, worker_id: str) -> StepTimeModel:
        return self.models.setdefault(worker_id, StepTimeModel())

    async def notify(self) -> None:
        self._waiters.wake(MAX_WAKE_PER_NOTIFY)

    async def capacity_changed(self, timeout_s: float) -> None:
        """Return at the next capacity change (a worker report, a finished request) or after
        ``timeout_s``: a request whose reservation was refused retries then, not in a spin."""
        ticket = self._waiters.enter()
        try:
            await self._waiters.wait(ticket, timeout_s)
        finally:
            self._waiters.leave(ticket)

    # ---- predictions -----------------------------------------------------------------------
    def predict(self, spec: RequestSpec, prefill: WorkerHandle | None, decode: WorkerHandle,
                now: float | None = None, waited_s: float = 0.0) -> Prediction:
        prompt = len(spec.prompt_token_ids)
        now = time.perf_counter() if now is None else now
        decode_cached = decode.prefix.expected_hit(spec.prompt_token_ids)
        cached = prefill.prefix.expected_hit(spec.prompt_token_ids) if prefill else decode_cached
        ttft = self._ttft(prompt - cached, prefill, decode)
        step = self._decode_step(decode, prompt, now)
        own_prompt = prompt - cached if prefill is None else 0   # prefilled on the decode worker itself
        running = self._running_tpot_ratio(decode, step, own_prompt, now) if step is not None else None
        return Prediction(prefill, decode, None if ttft is None else waited_s + ttft, step, running, waited_s,
                          prompt, cached, decode_cached)

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
        queued = _queued_prefill_tokens(prefill or decode)
        # No hand-off term: the first token leaves the prefill worker before its KV moves.
        return (queued + prompt) * per_token * self.ttft_correction

    def _decode_step(self, decode: WorkerHandle, prompt: int, now: float, joining: bool = True) -> float | None:
        """Seconds per token on ``decode`` (with this request added when ``joining``): its step
        time, stretched by the long-run share of that worker's time prefill takes (inf when
        prefill saturates it), times the TPOT correction."""
        seqs = max(decode.num_inflight, decode.stats.num_running if decode.stats else 0) + int(joining)
        step = self.model(decode.worker_id).predict(max(1, seqs), _kv_tokens(decode) + prompt)
        if step is None:
            return None
        share = self._stall_per_token(decode) * decode.prefill_token_rate(now)
        tpot = step * self.tpot_correction / (1.0 - share) if share < MAX_PREFILL_SHARE else float("inf")
        logger.debug("%s tpot: seqs %d step %.3f share %.2f -> %.3f s", decode.worker_id, seqs, step, share, tpot)
        return tpot

    def _stall_per_token(self, decode: WorkerHandle) -> float:
        """Seconds a prompt token prefilled on ``decode`` stalls its decodes: measured there once
        it has prefilled (colocated, or conditional disaggregation), else the prefill workers'
        full per-token time (an upper bound)."""
        stall = self.model(decode.worker_id).prefill_stall_per_token()
        return stall if stall is not None else (self._prefill_seconds_per_token(None) or 0.0)

    def _running_tpot_ratio(self, decode: WorkerHandle, step_s: float, own_prompt: int, now: float) -> float | None:
        """Worst projected / target TPOT among the requests admitted to ``decode`` if this one
        joins: each stalls, after its first token, for the prefill queued behind it there plus
        ``own_prompt``, then steps at ``step_s`` (a request still awaiting its first token counts
        too: the prompts queued behind it are prefilled after it starts decoding). Requests
        already past the safety line without this prompt are left out: one such request would
        otherwise block the worker until it finishes (a request's worth of goodput kept, several
        lost), or it is lost either way."""
        per_token = self._stall_per_token(decode)
        queued = _queued_prefill_tokens(decode)
        own_stall = own_prompt * per_token
        worst = None
        for progress in decode.decoding.values():
            target = progress.tpot_target_s
            behind = min(queued, decode.prefill_tokens_sent - progress.prefill_mark) * per_token
            before = progress.projected_tpot(now, step_s, behind) if target else None
            if before is None or before > target * TPOT_SAFETY:
                continue
            ratio = progress.projected_tpot(now, step_s, behind + own_stall) / target
            worst = ratio if worst is None else max(worst, ratio)
        return worst

    def candidates(self, spec: RequestSpec, now: float | None = None, waited_s: float = 0.0) -> list[Prediction]:
        decodes = self.registry.alive("decode")
        if not decodes:
            raise WorkerFailedError("no decode worker is alive")
        if not self.registry.prefill:  # colocated mode
            return [self.predict(spec, None, d, now, waited_s) for d in decodes]
        prefills = self.registry.alive("prefill")
        preds = [self.predict(spec, p, d, now, waited_s) for p in prefills for d in decodes]
        if self.conditional or not prefills:   # no prefill worker up: the decode workers prefill
            preds += [self.predict(spec, None, d, now, waited_s) for d in decodes]
        return preds

    # ---- decisions ---------------------------------------------------------------------------
    def decide(self, spec: RequestSpec, now: float | None = None, waited_s: float = 0.0,
               best_effort: bool = False) -> Decision:
        """``best_effort``: no SLO check, the least loaded pair (a migrating request was
        admitted once already)."""
        if not self.registry.can_serve and self.registry.recovering("decode"):
            return Decision("queue", "waiting for a decode worker to restart")
        ttft_t, tpot_t = self._targets(spec)
        preds = self.candidates(spec, now, waited_s)
        disagg = [p for p in preds if p.prefill is not None] or preds
        if best_effort:   # still only where the prompt's blocks fit now, or the reservation fails
            roomy = [p for p in disagg if _has_prompt_room(p.decode, spec)]
            if not roomy:
                return Decision("queue", "decode KV cache full", min(disagg, key=_load))
            return Decision("admit", "migration", min(roomy, key=_load))
        if not self.enabled or (ttft_t is None and tpot_t is None) or any(p.ttft_s is None for p in preds):
            best = min(disagg, key=_load)  # best effort, or no timings yet: least loaded
            return Decision("admit", "best_effort" if self.enabled else "admission_off", best)
        best = self._choose(spec, preds, ttft_t, tpot_t)
        if _idle(best):  # refusing an idle pair helps no one; its timings also refresh the models
            return Decision("admit", "idle", best)
        if not best.fits_ttft(ttft_t):
            queued = f" ({best.waited_s * 1e3:.0f} ms of it queued)" if best.waited_s else ""
            return Decision("reject", f"predicted TTFT {best.ttft_s * 1e3:.0f} ms{queued} > target {ttft_t * 1e3:.0f} ms", best)
        if tpot_t and best.tpot_s is not None and best.tpot_s > tpot_t * TPOT_SAFETY:
            return Decision("queue", f"predicted TPOT {best.tpot_s * 1e3:.1f} ms > target {tpot_t * 1e3:.1f} ms", best)
        if not best.spares_running:
            return Decision("queue", f"a running request's TPOT would reach {best.running_tpot_ratio:.0%} of its target", best)
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
        fits_ttft = [p for p in preds if p.fits_ttft(ttft_t)]
        fits = [p for p in fits_ttft if p.fits_tpot(tpot_t) and _has_kv_room(p.decode, spec)]
        if fits:
            pool = [p for p in fits if p.prefill is not None or p.cheap_local] or fits
            return min(pool, key=lambda p: (p.ttft_s, -p.headroom(ttft_t, tpot_t)))
        return max(fits_ttft or preds, key=lambda p: p.headroom(ttft_t, tpot_t))

    async def acquire(self, spec: RequestSpec, metrics=None, resuming: bool = False) -> Prediction:
        """Admit (returning the pair), wait in the queue, or raise CapacityError.
        ``resuming``: a migrating request, placed best effort; it waits up to
        ``RESUME_WAIT_S`` for a worker to come back."""
        ttft_t, _ = self._targets(spec)
        start = time.perf_counter()
        # Backstop: the TTFT prediction counts the wait too.
        deadline = start + (RESUME_WAIT_S if resuming else (ttft_t or 30.0))
        decision = self.decide(spec, best_effort=resuming)
        ticket = None
        try:
            while decision.action == "queue":
                queue_reason = decision.reason
                if ticket is None:
                    if self.max_queued is not None and self.num_queued >= self.max_queued and not resuming:
                        raise CapacityError(f"max_queued_requests: {self.num_queued} requests are queued "
                                            f"({decision.reason}); retry later")
                    ticket = self._waiters.enter()
                    self._count_queue(+1, metrics, decision)
                remaining = deadline - time.perf_counter()
                if remaining <= 0 and decision.prediction is None:
                    raise WorkerFailedError(f"no serving worker came back in time ({decision.reason})")
                if remaining <= 0:
                    raise CapacityError(f"queued past its TTFT deadline ({decision.reason})")
                await self._waiters.wait(ticket, remaining)
                decision = self.decide(spec, waited_s=time.perf_counter() - start, best_effort=resuming)
        finally:
            if ticket is not None:
                self._waiters.leave(ticket)
                self._count_queue(-1, metrics)
        queued = ticket is not None
        if decision.action == "reject":
            raise CapacityError(decision.reason + (f"; queued for: {queue_reason}" if queued else ""))
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


def _load(p: Prediction) -> tuple[int, int, int, int]:
    free = p.decode.stats.num_free_blocks if p.decode.stats else 0
    queued = p.prefill.num_prefill_tokens if p.prefill else 0
    return (queued - p.cached_tokens, p.decode.num_inflight, -p.decode_cached_tokens, -free)


def _idle(p: Prediction) -> bool:
    busy = p.decode.num_inflight or (p.decode.stats and (p.decode.stats.num_running or p.decode.stats.num_waiting))
    return not busy and not (p.prefill and p.prefill.num_prefill_tokens)


def _queued_prefill_tokens(w: WorkerHandle) -> int:
    """The router's count is fresh; the worker's own adds prompts it must recompute."""
    return max(w.num_prefill_tokens, w.stats.num_waiting_tokens if w.stats else 0)


def _kv_tokens(w: WorkerHandle) -> int:
    if w.stats is None:
        return 0
    return (w.stats.num_total_blocks - w.stats.num_free_blocks) * w.stats.block_size


def _has_prompt_room(w: WorkerHandle, spec: RequestSpec) -> bool:
    """Room for what ``reserve`` takes now: the prompt's blocks (decoding may preempt later)."""
    if w.stats is None:
        return True
    return -(-len(spec.prompt_token_ids) // w.stats.block_size) <= w.stats.num_free_blocks


def _has_kv_room(w: WorkerHandle, spec: RequestSpec) -> bool:
    if w.stats is None:
        return True
    need = -(-(len(spec.prompt_token_ids) + spec.sampling.max_tokens) // w.stats.block_size)
    return need <= w.stats.num_free_blocks
