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
         within their targets, at once, while the long-run rate is still catching up. Checked
         where this prompt would be prefilled on the decode worker: a disaggregated pair stalls
         none of them (a request pushed past its safety line by the step alone is left out
         either way), so its check is met without looking;
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
bytes to move). The search takes each worker's part once (``_Search``: a pair's TTFT is its
prefill worker's, its TPOT its decode worker's), so a decision costs O(prefill + decode
workers), not O(pairs); the running-TPOT check (O(requests on that worker)) is made only for a
decode worker that would prefill and can still be chosen; nothing is O(requests queued).
A decode worker that holds all of a prompt but its last block (``LOCAL_PREFILL_TOKENS`` or
fewer to compute) is taken like a disaggregated pair: a hand-off would cost more than that
prefill. Conditional disaggregation:
the decode worker prefilling the prompt itself is a candidate too (no hand-off, but its prefill
interferes with its decodes); it is taken when no prefill worker can meet the request's TTFT
and its own predictions fit: extra prefill capacity exactly when the prefill side is the
bottleneck.
Decision (targets scaled down for lower priority classes, so they are shed first):
  admit  - every prediction within target: the chosen pair runs it;
  queue  - TTFT fits but the decode side is full (its or a running request's TPOT over target,
           or no KV room): wait for capacity, re-evaluated when a worker reports or a request
           ends (the oldest ``MAX_WAKE_PER_NOTIFY`` per wake, ``router.wakeup``; woken by a
           report, a request decides again only when that worker could now take it,
           ``_could_take``, checked in the report's ``notify``: no task switch when not),
           until the time queued leaves no room for its TTFT; a queue already ``max_queued``
           long refuses at once;
  reject - TTFT cannot be met even now, or the deadline passed: RESOURCE_EXHAUSTED with the
           prediction in the message.
With no targets (best effort) or before any step timing arrived, requests are admitted.
"""

from __future__ import annotations

import logging
import enum
import math
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from engine.errors import CapacityError, WorkerFailedError
from engine.types import RequestSpec
from router.registry import DecodeProgress, WorkerHandle, WorkerRegistry
from router.step_model import StepTimeModel
from router.ttft_margin import TtftMargin
from router.wakeup import FairWakeup

logger = logging.getLogger(__name__)

# Predictions must fit a share of their target: the models are fitted, not exact. TTFT is a hard
# per-request deadline predicted from a queue (errors add up): its share follows how far recent
# predictions were off (``router.ttft_margin``); TPOT is an average over a lifetime.
TPOT_SAFETY = 0.9
MAX_PREFILL_SHARE = 0.95  # beyond this a worker that prefills is treated as saturated
PRIORITY_STEP = 0.15      # each lower priority class gets 15% less of its targets
MIN_PRIORITY_SCALE = 0.4
RESUME_WAIT_S = 60.0      # a migrating request waits this long for a worker to come back
MAX_WAKE_PER_NOTIFY = 8   # queued requests re-evaluated per worker report: bounded work per step
# TTFT's fixed part (outside the worker's engine) is learned with this EMA weight, and the
# engine part's correction only from prompts with at least this many tokens to prefill: below
# it a step's floor, not the per-token rate, sets the engine time.
OVERHEAD_EMA = 0.1
MIN_TOKENS_TO_CORRECT = 64
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
    ttft_overhead_s: float = 0.0   # the part of ``ttft_s`` outside the worker's engine (see Admission)

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
        running = 1.0 - self.running_tpot_ratio if self.running_tpot_ratio is not None else math.inf
        return min(_slack(self.ttft_s, ttft_target), _slack(self.tpot_s, tpot_target), running)

    @property
    def spares_running(self) -> bool:
        """No request decoding there would be pushed past the safety share of its TPOT target."""
        return self.running_tpot_ratio is None or self.running_tpot_ratio <= TPOT_SAFETY

    def fits_tpot(self, target: float | None) -> bool:
        return self.spares_running and _within(self.tpot_s, target, TPOT_SAFETY)

    def fits_ttft(self, target: float | None, share: float) -> bool:
        return _fits_ttft(self.ttft_s, self.waited_s, target, share)


class Action(enum.Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


class Cause(enum.Enum):
    """Why a decision was taken; its value is the ``reason`` label of the decisions metric."""

    WITHIN_SLO = "within_slo"          # admitted: both predictions inside their targets
    IDLE = "idle"                      # admitted: an idle pair is never refused
    BEST_EFFORT = "best_effort"        # admitted: no targets, or no timings yet
    ADMISSION_OFF = "admission_off"
    MIGRATION = "migration"            # a resumed request, placed without an SLO check
    TTFT = "ttft"                      # rejected: predicted TTFT past its target
    TPOT = "tpot"                      # queued: predicted TPOT past its target
    RUNNING_TPOT = "running_tpot"      # queued: a running request's TPOT would suffer
    KV_FULL = "kv_full"                # queued: no room for the prompt's blocks
    RESTARTING = "restarting"          # queued: no decode worker up, one is coming back


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    cause: Cause
    detail: str = ""               # the numbers behind the cause, for error messages
    prediction: Prediction | None = None

    @property
    def reason(self) -> str:
        return self.detail or self.cause.value


class Admission:
    def __init__(self, registry: WorkerRegistry, enabled: bool = True, conditional: bool = True,
                 max_queued: int | None = None) -> None:
        self.registry = registry
        self.enabled = enabled
        self.conditional = conditional
        self.models: dict[str, StepTimeModel] = {}
        # A TTFT is predicted as time queued here + the fixed part outside the worker's engine
        # (dispatch, RPCs, the first token's way back: an EMA of what was observed) + the
        # engine's part (prompt tokens queued and its own, at the step model's rate, times an
        # EMA of observed / predicted engine time: batching granularity, a busy machine;
        # clamped so one outlier can't shut admission down). Kept apart because a prompt found
        # in the prefix cache costs the fixed part and almost no engine time: their ratio
        # taught as one would push the correction to its clamp and refuse the next uncached
        # prompt for a TTFT several times its real one.
        self.ttft_overhead_s = 0.0
        self.ttft_correction = 1.0
        self.ttft_margin = TtftMargin()   # the share of a TTFT target a prediction may use
        self.tpot_correction = 1.0     # the same for TPOT (see the module docstring)
        self._waiters = FairWakeup()
        self.num_queued = 0
        self.max_queued = max_queued   # a full queue answers RESOURCE_EXHAUSTED at once (None: unbounded)

    # ---- inputs ---------------------------------------------------------------------------
    def observe_stats(self, worker: WorkerHandle) -> None:
        if worker.stats is not None:
            self.model(worker.worker_id).observe(worker.stats.recent_steps)

    def observe_ttft(self, pair: Prediction, observed_s: float, engine_s: float | None = None) -> None:
        """``observed_s`` from arrival; the time queued is known exactly, only the rest was
        predicted. ``engine_s``: the worker's own queue + compute time for the prompt, when it
        reported it (a prefill worker does): what is left of ``observed_s`` is the fixed part."""
        if pair.ttft_s is None:
            return
        outside = observed_s - pair.waited_s
        self.ttft_margin.observe(pair.ttft_s - pair.waited_s, outside)
        if engine_s is not None:
            self.ttft_overhead_s += OVERHEAD_EMA * (max(0.0, outside - engine_s) - self.ttft_overhead_s)
        else:
            engine_s = outside - pair.ttft_overhead_s
        if pair.tokens_to_prefill >= MIN_TOKENS_TO_CORRECT:
            self.ttft_correction = _corrected(self.ttft_correction, pair.ttft_s - pair.waited_s - pair.ttft_overhead_s,
                                              engine_s, 0.8, 3.0)

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
        model = self.models.get(worker_id)
        if model is None:
            model = self.models[worker_id] = StepTimeModel()
        return model

    def notify(self, worker: WorkerHandle | None = None) -> None:
        """Capacity may have changed: wake the next few queued requests to decide again. A plain
        call (it sets their events): a task per worker report cost more than the wake itself.
        ``worker``: only that worker's state changed (its report); None: anything may have.
        Named, each queued request's ``_could_take`` check of it runs here: a request it cannot
        take is not woken (a task switch per request cost more than the check)."""
        self._waiters.wake(MAX_WAKE_PER_NOTIFY, worker)

    @property
    def num_waiting(self) -> int:
        """Requests waiting here now: queued for room, or for a capacity change after a refusal."""
        return len(self._waiters)

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
        search = _Search(self, spec, now, waited_s)
        side = search.decode_side(decode)
        return search.local(side) if prefill is None else search.pair(search.prefill_side(prefill), side)

    def _prefill_seconds_per_token(self, prefill: WorkerHandle | None) -> float | None:
        """Measured on prefill workers (a decode worker prefilling runs the same model on the
        same kind of core); in colocated mode, on the workers themselves."""
        if prefill is not None:
            return self.model(prefill.worker_id).seconds_per_prefill_token()
        workers = self.registry.alive("prefill") or self.registry.alive("decode")
        rates = [r for r in (self.model(w.worker_id).seconds_per_prefill_token() for w in workers) if r is not None]
        return min(rates) if rates else None

    def _decode_step(self, decode: WorkerHandle, prompt: int, now: float, joining: bool = True,
                     fallback_stall: float | None = None) -> float | None:
        """Seconds per token on ``decode`` (with this request added when ``joining``): its step
        time, stretched by the long-run share of that worker's time prefill takes (inf when
        prefill saturates it), times the TPOT correction."""
        seqs = max(decode.num_inflight, decode.stats.num_running if decode.stats else 0) + int(joining)
        step = self.model(decode.worker_id).predict(max(1, seqs), _kv_tokens(decode) + prompt)
        if step is None:
            return None
        rate = decode.prefill_token_rate(now)
        share = self._stall_per_token(decode, fallback_stall) * rate if rate else 0.0
        return step * self.tpot_correction / (1.0 - share) if share < MAX_PREFILL_SHARE else float("inf")

    def _stall_per_token(self, decode: WorkerHandle, fallback: float | None = None) -> float:
        """Seconds a prompt token prefilled on ``decode`` stalls its decodes: measured there once
        it has prefilled (colocated, or conditional disaggregation), else the prefill workers'
        full per-token time (an upper bound; ``fallback`` when the caller has it already)."""
        stall = self.model(decode.worker_id).prefill_stall_per_token()
        if stall is not None:
            return stall
        return fallback if fallback is not None else (self._prefill_seconds_per_token(None) or 0.0)

    def _running_tpot_ratio(self, decode: WorkerHandle, step_s: float, own_prompt: int, now: float,
                            per_token: float) -> float | None:
        """Worst projected / target TPOT among the requests admitted to ``decode`` if this one
        prefills there (``own_prompt`` tokens): each stalls, after its first token, for the
        prefill queued behind it there plus ``own_prompt``, then steps at ``step_s`` (a request
        still awaiting its first token counts too: the prompts queued behind it are prefilled
        after it starts decoding). Requests already past the safety line without this prompt
        are left out: one such request would otherwise block the worker until it finishes (a
        request's worth of goodput kept, several lost), or it is lost either way. O(requests
        there): asked only of the decode workers a decision considers prefilling on."""
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

    # ---- decisions ---------------------------------------------------------------------------
    def decide(self, spec: RequestSpec, now: float | None = None, waited_s: float = 0.0,
               best_effort: bool = False) -> Decision:
        """``best_effort``: no SLO check, the least loaded pair (a migrating request was
        admitted once already)."""
        if not self.registry.can_serve and self.registry.recovering("decode"):
            return Decision(Action.QUEUE, Cause.RESTARTING, "waiting for a decode worker to restart")
        ttft_t, tpot_t = self._targets(spec)
        search = _Search(self, spec, now, waited_s)
        if best_effort:   # still only where the prompt's blocks fit now, or the reservation fails
            roomy = search.least_loaded(lambda d: _has_prompt_room(d.worker, spec))
            if roomy is None:
                return Decision(Action.QUEUE, Cause.KV_FULL, "decode KV cache full", search.least_loaded())
            return Decision(Action.ADMIT, Cause.MIGRATION, prediction=roomy)
        if not self.enabled or (ttft_t is None and tpot_t is None) or not search.has_timings():
            # Best effort, or no timings yet: the least loaded pair where the prompt's blocks fit
            # beside the reservations promised there (a prefill whose reservation is refused is
            # computed again: it waits for room here instead).
            # (A decode worker prefilling takes no reservation: its engine queues what does not fit.)
            room = (lambda d: _has_prompt_room(d.worker, spec)) if search.prefills else None
            best = search.least_loaded(room)
            if best is None:
                return Decision(Action.QUEUE, Cause.KV_FULL, "decode KV cache full", search.least_loaded())
            return Decision(Action.ADMIT, Cause.BEST_EFFORT if self.enabled else Cause.ADMISSION_OFF, prediction=best)
        best = search.choose(ttft_t, tpot_t)
        if _idle(best):  # refusing an idle pair helps no one; its timings also refresh the models
            return Decision(Action.ADMIT, Cause.IDLE, prediction=best)
        share = self.ttft_margin.share
        if not best.fits_ttft(ttft_t, share):
            return Decision(Action.REJECT, Cause.TTFT, _ttft_miss_message(best, ttft_t, share), best)
        if tpot_t and best.tpot_s is not None and best.tpot_s > tpot_t * TPOT_SAFETY:
            return Decision(Action.QUEUE, Cause.TPOT, f"predicted TPOT {best.tpot_s * 1e3:.1f} ms > target {tpot_t * 1e3:.1f} ms", best)
        if not best.spares_running:
            return Decision(Action.QUEUE, Cause.RUNNING_TPOT, f"a running request's TPOT would reach {best.running_tpot_ratio:.0%} of its target", best)
        if not _has_kv_room(best.decode, spec):
            return Decision(Action.QUEUE, Cause.KV_FULL, "decode KV cache full", best)
        return Decision(Action.ADMIT, Cause.WITHIN_SLO, prediction=best)

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
            while decision.action is Action.QUEUE:
                queue_reason = decision.reason
                if ticket is None:
                    if self.max_queued is not None and self.num_queued >= self.max_queued and not resuming:
                        raise CapacityError(f"max_queued_requests: {self.num_queued} requests are queued "
                                            f"({decision.reason}); retry later")
                    ticket = self._waiters.enter(None if resuming else lambda worker: self._could_take(worker, spec))
                    self._count_queue(+1, metrics, decision)
                remaining = deadline - time.perf_counter()
                if remaining <= 0 and decision.prediction is None:
                    raise WorkerFailedError(f"no serving worker came back in time ({decision.reason})")
                if remaining <= 0:
                    raise CapacityError(f"queued past its TTFT deadline ({decision.reason})")
                # Woken by one worker's report, the check ran in ``notify``, but earlier waiters may
                # have taken that worker's room since: checked again (a decision only if still free).
                source = await self._waiters.wait(ticket, remaining)
                if source is not None and not resuming and not self._could_take(source, spec):
                    continue   # only ``source`` changed and it still has no room: the last decision holds
                decision = self.decide(spec, waited_s=time.perf_counter() - start, best_effort=resuming)
        finally:
            if ticket is not None:
                self._waiters.leave(ticket)
                self._count_queue(-1, metrics)
        queued = ticket is not None
        if decision.action is Action.REJECT:
            raise CapacityError(decision.reason + (f"; queued for: {queue_reason}" if queued else ""))
        if metrics is not None:
            metrics.admission(Action.ADMIT.value, decision.cause.value)
        return decision.prediction

    def _could_take(self, worker: WorkerHandle, spec: RequestSpec) -> bool:
        """Whether a queued request could now go to ``worker``, the one worker whose report woke
        it: a decode worker whose TPOT with the request joining is within target and whose KV
        has room (what every candidate on it must pass, disaggregated or prefilling itself). A
        prefill worker's report never can: a request queues for decode capacity. The other
        workers are as they were at the request's last decision (each wakes it with its own
        report), so a worker that cannot take it leaves that decision standing: one worker
        checked instead of a decision over all of them, on every report while requests queue."""
        if worker.role == "prefill" or not worker.alive:
            return False
        if not worker.num_inflight and not (worker.stats and (worker.stats.num_running or worker.stats.num_waiting)):
            return True   # idle: a decision admits there whatever it predicts (``_idle``)
        ttft_t, tpot_t = self._targets(spec)
        if not self.enabled or (ttft_t is None and tpot_t is None):
            # queued best effort: for the prompt's room alone (a reservation's; none without prefill workers)
            return not self.registry.alive("prefill") or _has_prompt_room(worker, spec)
        side = _Search(self, spec, None, 0.0).decode_side(worker)
        return _within(side.tpot_s, tpot_t, TPOT_SAFETY) and _has_kv_room(worker, spec)

    def _count_queue(self, delta: int, metrics, decision: Decision | None = None) -> None:
        self.num_queued += delta
        if metrics is not None:
            metrics.set_queued(self.num_queued)
            if decision is not None:
                metrics.admission(Action.QUEUE.value, decision.cause.value)

    @staticmethod
    def _targets(spec: RequestSpec) -> tuple[float | None, float | None]:
        scale = max(MIN_PRIORITY_SCALE, 1.0 - PRIORITY_STEP * max(0, spec.priority))
        ttft = spec.slo.ttft_s * scale if spec.slo.ttft_s else None
        tpot = spec.slo.tpot_s * scale if spec.slo.tpot_s else None
        return ttft, tpot


# The sides are built for every worker in every decision and never change once built; not
# frozen: a frozen dataclass's __init__ (object.__setattr__ per field) costs four times as much.
@dataclass(slots=True)
class _PrefillSide:
    """A prefill worker's part of every pair it is in: the TTFT depends on it alone."""

    worker: WorkerHandle
    cached: int                # prompt tokens expected in its prefix cache
    ttft_s: float | None       # including the time already queued


@dataclass(slots=True)
class _DecodeSide:
    """A decode worker's part of every pair it is in: the TPOT depends on it alone. Its other
    per-decision terms too, each computed once: the rules read them once per rule and candidate."""

    worker: WorkerHandle
    cached: int
    tpot_s: float | None
    kv_room: bool                       # room for the prompt and every token it may generate
    local_ttft_s: float | None = math.nan   # ``_Search.local_ttft``'s (nan: not asked for yet)


class _Search:
    """One decision's candidates with each worker's part computed once: |P| + |D| predictions,
    not |P| x |D|. A disaggregated pair's TTFT depends on its prefill worker alone and its TPOT
    on its decode worker alone (its prompt is prefilled elsewhere: it stalls no request
    decoding there, so the running-TPOT check is trivially met; the step it adds is in its own
    TPOT and, through the step time, in theirs), and every rule of the choice is lexicographic
    in the two parts or the smaller of their slacks. So the chosen pair is found side by side:
    the pair scanning every pair in (prefill, decode) order would choose, ties included.
    Candidates where the decode worker prefills (colocated, conditional disaggregation) are
    formed only when a rule needs them, and the O(requests there) running-TPOT check only for
    those that can still be chosen."""

    def __init__(self, admission: Admission, spec: RequestSpec, now: float | None, waited_s: float) -> None:
        self.admission = admission
        self.spec = spec
        self.prompt = len(spec.prompt_token_ids)
        self.now = time.perf_counter() if now is None else now
        self.waited_s = waited_s

    @cached_property
    def ttft_share(self) -> float:
        return self.admission.ttft_margin.share

    @cached_property
    def local_rate(self) -> float | None:
        """Seconds per prompt token where the decode worker prefills (the prefill workers' rate)."""
        return self.admission._prefill_seconds_per_token(None)

    @cached_property
    def decodes(self) -> list[_DecodeSide]:
        decodes = self.admission.registry.alive("decode")
        if not decodes:
            raise WorkerFailedError("no decode worker is alive")
        return [self.decode_side(d) for d in decodes]

    @cached_property
    def prefills(self) -> list[_PrefillSide]:
        """Empty when no pair is disaggregated (colocated mode, or no prefill worker up)."""
        registry = self.admission.registry
        return [self.prefill_side(p) for p in registry.alive("prefill")] if registry.prefill else []

    @property
    def with_local(self) -> bool:
        """The decode workers prefilling are candidates too: colocated mode, no prefill worker
        up, or conditional disaggregation."""
        return not self.prefills or self.admission.conditional

    # ---- the parts and the pairs ------------------------------------------------------------
    def prefill_side(self, p: WorkerHandle) -> _PrefillSide:
        cached = p.prefix.expected_hit(self.spec.prompt_token_ids)
        per_token = self.admission._prefill_seconds_per_token(p)
        return _PrefillSide(p, cached, self._ttft(p, self.prompt - cached, per_token))

    def decode_side(self, d: WorkerHandle) -> _DecodeSide:
        step = self.admission._decode_step(d, self.prompt, self.now, fallback_stall=self.local_rate or 0.0)
        cached = d.prefix.expected_hit(self.spec.prompt_token_ids)
        return _DecodeSide(d, cached, step, _has_kv_room(d, self.spec))

    def _ttft(self, worker: WorkerHandle, tokens: int, per_token: float | None) -> float | None:
        """No hand-off term: the first token leaves the prefill worker before its KV moves."""
        if per_token is None:
            return None
        queued = _queued_prefill_tokens(worker)
        return self.waited_s + self.admission.ttft_overhead_s + (queued + tokens) * per_token * self.admission.ttft_correction

    def local_ttft(self, d: _DecodeSide) -> float | None:
        """The TTFT when ``d``'s worker prefills the prompt itself. Computed on first use: most
        decisions ask it of the few decode workers holding the prompt, a queued request's of
        every one, by three rules."""
        ttft = d.local_ttft_s
        if ttft != ttft:   # nan: not computed yet (a computed TTFT is never nan)
            ttft = d.local_ttft_s = self._ttft(d.worker, self.prompt - d.cached, self.local_rate)
        return ttft

    def pair(self, p: _PrefillSide, d: _DecodeSide) -> Prediction:
        return Prediction(p.worker, d.worker, p.ttft_s, d.tpot_s, None, self.waited_s, self.prompt, p.cached, d.cached,
                          self.admission.ttft_overhead_s)

    def local(self, d: _DecodeSide) -> Prediction:
        """The decode worker prefills the prompt itself (what is not in its cache)."""
        own = self.prompt - d.cached
        running = None
        if d.tpot_s is not None:
            stall = self.admission._stall_per_token(d.worker, self.local_rate or 0.0)
            running = self.admission._running_tpot_ratio(d.worker, d.tpot_s, own, self.now, stall)
        return Prediction(None, d.worker, self.local_ttft(d), d.tpot_s, running, self.waited_s, self.prompt,
                          d.cached, d.cached, self.admission.ttft_overhead_s)

    def has_timings(self) -> bool:
        """Every candidate has a TTFT prediction (each worker has reported its steps)."""
        return all(p.ttft_s is not None for p in self.prefills) and not (self.with_local and self.local_rate is None)

    # ---- the rules ----------------------------------------------------------------------------
    def least_loaded(self, room: Callable[[_DecodeSide], bool] | None = None) -> Prediction | None:
        """Least queued work (prefill tokens queued minus the prefix expected cached there),
        then the fewest requests decoding, then the decode worker holding most of the prompt,
        then the most free blocks; among decode workers passing ``room`` (None if none does).
        Disaggregated pairs when there are any."""
        decodes = [d for d in self.decodes if room is None or room(d)]
        if not decodes:
            return None
        if self.prefills:
            p = min(self.prefills, key=lambda s: s.worker.num_prefill_tokens - s.cached)
            return self.pair(p, min(decodes, key=_decode_load))
        return self.local(min(decodes, key=lambda d: (-d.cached, *_decode_load(d))))

    def choose(self, ttft_t: float | None, tpot_t: float | None) -> Prediction:
        """Among the pairs predicted to meet both targets (with KV room): disaggregated ones
        first (a decode worker takes a prompt only when no prefill worker can meet its TTFT),
        then the lowest TTFT (it balances prefill queues; TPOT already fits), then the most
        headroom. When none meets both: the most headroom among those meeting TTFT (the
        request may queue for decode capacity), else among all (it will be rejected)."""
        fit_p = [p for p in self.prefills if _fits_ttft(p.ttft_s, self.waited_s, ttft_t, self.ttft_share)]
        fit_d = [d for d in self.decodes if _within(d.tpot_s, tpot_t, TPOT_SAFETY) and d.kv_room]
        if fit_p and fit_d:
            p = min(fit_p, key=lambda s: s.ttft_s)
            slack = _slack(p.ttft_s, ttft_t)
            best = self.pair(p, max(fit_d, key=lambda d: min(slack, _slack(d.tpot_s, tpot_t))))
            cheap = self._best_local(ttft_t, tpot_t, cheap_only=True)
            rank = lambda c: (c.ttft_s, -c.headroom(ttft_t, tpot_t))  # noqa: E731
            return best if cheap is None or rank(best) <= rank(cheap) else cheap
        local = self._best_local(ttft_t, tpot_t, cheap_only=True) or self._best_local(ttft_t, tpot_t, cheap_only=False)
        return local or self._most_headroom(ttft_t, tpot_t, fit_p)

    def _best_local(self, ttft_t: float | None, tpot_t: float | None, cheap_only: bool) -> Prediction | None:
        """The lowest (TTFT, -headroom) among the decode workers prefilling that meet both
        targets (only those holding all of the prompt but a block: ``cheap_only``)."""
        if not self.with_local:
            return None
        cands = []
        for i, d in enumerate(self.decodes):
            if cheap_only and not (d.cached > 0 and self.prompt - d.cached <= LOCAL_PREFILL_TOKENS):
                continue
            ttft = self.local_ttft(d)
            if _fits_ttft(ttft, self.waited_s, ttft_t, self.ttft_share) and _within(d.tpot_s, tpot_t, TPOT_SAFETY) \
                    and d.kv_room:
                cands.append((ttft, i, d))
        return self._most_headroom_local(cands, ttft_t, tpot_t, must_spare_running=True)

    def _most_headroom(self, ttft_t: float | None, tpot_t: float | None, fit_p: list[_PrefillSide]) -> Prediction:
        """The most headroom among the candidates meeting TTFT, else among all. A
        disaggregated pair's headroom is the smaller of its two parts' slacks: the best is
        min(best prefill slack, best decode slack), reached first by the first prefill and
        then the first decode worker reaching it."""
        local = [(0.0, i, d) for i, d in enumerate(self.decodes)] if self.with_local else []
        locals_fit = [c for c in local if _fits_ttft(self.local_ttft(c[2]), self.waited_s, ttft_t, self.ttft_share)]
        any_fit = bool(fit_p or locals_fit)
        prefills = fit_p if any_fit else self.prefills
        best = None
        if prefills:
            a = [_slack(p.ttft_s, ttft_t) for p in prefills]
            h = [_slack(d.tpot_s, tpot_t) for d in self.decodes]
            value = min(max(a), max(h))
            p = next(p for p, ap in zip(prefills, a) if ap >= value)
            best = self.pair(p, next(d for d, hd in zip(self.decodes, h) if hd >= value))
        return self._most_headroom_local(locals_fit if any_fit else local, ttft_t, tpot_t, must_spare_running=False, best=best)

    def _most_headroom_local(self, cands: list[tuple[float, int, _DecodeSide]], ttft_t: float | None,
                             tpot_t: float | None, must_spare_running: bool,
                             best: Prediction | None = None) -> Prediction | None:
        """The first by (group, -headroom, decode order) of ``cands`` ((group, order, side):
        the decode worker prefilling), or ``best`` (before all of them) when none beats it.
        Headroom's running-TPOT term needs the O(requests there) check: it is made best bound
        first (the TTFT and TPOT slacks bound the headroom from above), for no candidate that
        cannot win."""
        best_h, best_i = (best.headroom(ttft_t, tpot_t), -1) if best is not None else (-math.inf, -1)
        group = None if best is None else 0.0

        def bound(c) -> float:
            return min(_slack(self.local_ttft(c[2]), ttft_t), _slack(c[2].tpot_s, tpot_t))

        bounded = ((c[0], c[1], c[2], bound(c)) for c in cands)
        if best is not None:   # bounded by ``best``'s headroom (a tie goes to ``best``): never wins, never sorted
            bounded = [c for c in bounded if c[3] > best_h]
        for key, i, d, upper in sorted(bounded, key=lambda c: (c[0], -c[3], c[1])):
            if group is not None and key > group:
                break   # a later group cannot win
            if best is not None and (upper < best_h or (upper == best_h and i > best_i)):
                continue
            pred = self.local(d)
            if must_spare_running and not pred.spares_running:
                continue
            h = pred.headroom(ttft_t, tpot_t)
            if best is None or h > best_h or (h == best_h and i < best_i):
                best, best_h, best_i, group = pred, h, i, key
        return best


def _corrected(current: float, predicted_s: float | None, observed_s: float, low: float, high: float) -> float:
    """``predicted_s`` already carries ``current``: move it geometrically toward the
    observed/predicted ratio (an EMA in log space), so it converges on the true bias; clamped
    so one outlier can't shut admission down or open it wide."""
    if not predicted_s or not math.isfinite(predicted_s) or observed_s <= 0:
        return current
    return min(high, max(low, current * (observed_s / predicted_s) ** 0.2))


def _within(predicted: float | None, target: float | None, safety: float) -> bool:
    return not target or predicted is None or predicted <= target * safety

def _decode_load(d: _DecodeSide) -> tuple[int, int, int]:
    free = d.worker.stats.num_free_blocks if d.worker.stats else 0
    return (d.worker.num_inflight, -d.cached, -free)


def _slack(predicted: float | None, target: float | None) -> float:
    """Relative slack of a prediction against its target (inf when either is unset)."""
    return 1.0 - predicted / target if predicted is not None and target else math.inf


def _fits_ttft(ttft_s: float | None, waited_s: float, target: float | None, share: float) -> bool:
    """The predicted part, not the time already queued (known exactly), must fit the safety
    ``share`` of what is left (``router.ttft_margin``): a request that waited for decode
    capacity is not rejected for a margin on time that is no longer uncertain."""
    if not target or ttft_s is None:
        return True
    return ttft_s - waited_s <= (target - waited_s) * share


def _ttft_miss_message(best: Prediction, target: float, share: float) -> str:
    """Why a request is refused for TTFT, in the terms ``_fits_ttft`` decides by (a prediction
    under its target can still miss the safety share)."""
    msg = f"predicted TTFT {best.ttft_s * 1e3:.0f} ms"
    if best.waited_s:
        msg += f" ({best.waited_s * 1e3:.0f} ms of it queued)"
    if best.ttft_s <= target:
        left = (target - best.waited_s) * 1e3
        return msg + (f" leaves less than a {1 - share:.0%} safety margin of the {left:.0f} ms left "
                      f"of the TTFT target {target * 1e3:.0f} ms")
    return msg + f" > target {target * 1e3:.0f} ms"


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
    """Room for what ``reserve`` takes now: the prompt's blocks (decoding may preempt later),
    beside the reservations already promised there (``WorkerHandle.free_blocks``)."""
    if w.stats is None:
        return True
    return w.blocks_for(len(spec.prompt_token_ids)) <= w.free_blocks


def _has_kv_room(w: WorkerHandle, spec: RequestSpec) -> bool:
    if w.stats is None:
        return True
    return w.blocks_for(len(spec.prompt_token_ids) + spec.sampling.max_tokens) <= w.free_blocks
