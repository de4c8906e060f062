"""SLO-aware admission: decide, queue, wake, and learn what predictions are made from.

Each request is decided on the pair ``router.pair_search`` predicts and chooses. What those
predictions are made from is kept here, learned online: a step-time model per worker
(``router.step_model``, fitted to the steps its reports carry), read through ``decode_step``,
``prefill_seconds_per_token`` and ``stall_per_token``; and their corrections.
TTFT and TPOT each carry an online correction, a log-space EMA of observed / predicted that
absorbs what the models leave out (RPC latency, chunking granularity, batch growth). TTFT: the
admission-time prediction against the first token. TPOT: a prediction made afresh at each
request's first token (its projection from the state then) against its TPOT at the end;
learning it from the admission-time prediction instead is biased upward (a request is admitted
when the load estimate happens to read low, then meets the average load), which made admission
reject requests that would have met their target.
Decision (targets scaled down for lower priority classes, so they are shed first):
  admit  - every prediction within target: the chosen pair runs it;
  queue  - TTFT fits but the decode side is full (its or a running request's TPOT over target,
           or no KV room): wait for capacity, re-evaluated when a worker reports or a request
           ends (per wake the ``MAX_WAKE_PER_NOTIFY`` of the highest priority waiting longest,
           ``router.wakeup``; woken by a
           report, a request decides again only when that worker could now take it,
           ``_could_take``, checked in the report's ``notify``: no task switch when not),
           until the time queued leaves no room for its TTFT (30 s without one); a queue
           already ``max_queued`` long refuses at once. KV room goes by priority, then first
           come, first served (``router.room_line``): the first request queued for it holds the
           room it waits for against every later one of its class or a lower one on the decode
           worker with the most room, once it has waited ``HOLD_AFTER_S``
           (``_hold``; a migrating request is not held back), as an engine's waiting queue does;
  reject - TTFT cannot be met even now, or the deadline passed, or the TPOT target is below a
           step of the request alone (``tpot_floor``: no wait helps): RESOURCE_EXHAUSTED with the
           prediction in the message.
With no targets (best effort), requests are admitted. Before any step timing arrived, a request
with targets is admitted only where the worker prefilling it has no prompt queued (one prompt at
a time per prefill worker): the rest queue (``Cause.NO_TIMINGS``) until a report brings timings,
then are decided on them. Admitting everything blind admitted a whole cold-start burst: 24 prompts
at once with a 1.5 s TTFT target, 10 of them 1.5-2.4 s late (found by a probe).

Life cycle: one ``Admission`` per router. Worker reports feed ``observe_stats`` and ``notify``;
each request calls ``acquire`` once (admitted, queued until capacity changes, or refused), then
its first token feeds ``observe_ttft`` and ``expect_tpot``, its end ``observe_tpot``.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass

from engine.errors import DEFAULT_RETRY_AFTER_S, CapacityError, WorkerFailedError
from engine.types import RequestSpec
from router.pair_search import (PairSearch, Prediction, RoomHold, fits_tpot, has_kv_room, has_room, kv_tokens_of,
                                queued_prefill_tokens)
from router.registry import DecodeProgress, WorkerHandle, WorkerRegistry
from router.room_line import RoomLine
from router.step_model import StepTimeModel
from router.ttft_margin import TtftMargin
from router.wakeup import FairWakeup

MAX_PREFILL_SHARE = 0.95  # beyond this a worker that prefills is treated as saturated
PRIORITY_STEP = 0.15      # each lower priority class gets 15% less of its targets
MIN_PRIORITY_SCALE = 0.4
RESUME_WAIT_S = 60.0      # a migrating request waits this long for a worker to come back
QUEUE_BACKSTOP_S = 30.0   # a request without a TTFT target waits this long in the queue at most
# The first request waiting for KV room holds it against later ones once it has waited this
# long: a short wait is a bin-packing choice (later, smaller requests fit the room as it frees,
# and the first one's turn comes at the next free anyway; holding at once cost 20-30% of the
# throughput of small requests with TTFT targets on a tight pool, a probe measured); a long one
# is starvation (a large request waited 30 s behind 1,552 small ones).
HOLD_AFTER_S = 1.0
MAX_WAKE_PER_NOTIFY = 8   # queued requests re-evaluated per worker report: bounded work per step
MAX_RETRY_AFTER_S = 60.0  # the longest retry hint given (OpenAI's SDK ignores longer ones)
# TTFT's fixed part (outside the worker's engine) is learned with this EMA weight, and the
# engine part's correction only from prompts with at least this many tokens to prefill: below
# it a step's floor, not the per-token rate, sets the engine time.
OVERHEAD_EMA = 0.1
MIN_TOKENS_TO_CORRECT = 64


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
    NO_TIMINGS = "no_timings"          # queued: no step timings yet and its prefill worker is busy
    TPOT_FLOOR = "tpot_floor"          # rejected: TPOT target below a step of the request alone


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    cause: Cause
    detail: str = ""               # the numbers behind the cause, for error messages
    prediction: Prediction | None = None
    room_tokens: int = 0           # KV_FULL: the tokens of room it waits for

    @property
    def reason(self) -> str:
        return self.detail or self.cause.value


@dataclass(frozen=True, slots=True)
class Learned:
    """What admission has learned so far, as the metrics export it (``pdserve_admission_*``):
    the TTFT and TPOT corrections (observed / predicted, applied to every prediction), the share
    of a TTFT target a prediction may use, and TTFT's part outside the workers' engines."""

    ttft_correction: float
    tpot_correction: float
    ttft_margin: float
    ttft_overhead_s: float


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
        # Requests queued for KV room (each with the room it waits for, on the decode worker
        # with the most room when it last decided), by priority then since when: the first holds
        # its room there against every later request of its class or a lower one (``_hold``).
        self._room_line = RoomLine()
        self.num_queued = 0
        self.max_queued = max_queued   # a full queue answers RESOURCE_EXHAUSTED at once (None: unbounded)

    def learned(self) -> Learned:
        return Learned(self.ttft_correction, self.tpot_correction, self.ttft_margin.share, self.ttft_overhead_s)

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
        step = self.decode_step(decode, 0, now, joining=False)
        if step is not None:
            behind = min(queued_prefill_tokens(decode), decode.prefill_tokens_sent - progress.prefill_mark)
            progress.predicted_tpot_s = progress.projected_tpot(now, step, behind * self.stall_per_token(decode))

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

    async def capacity_changed(self, timeout_s: float, priority: int = 0) -> None:
        """Return at the next capacity change (a worker report, a finished request) or after
        ``timeout_s``: a request whose reservation was refused retries then, not in a spin
        (woken in its ``priority``'s turn)."""
        ticket = self._waiters.enter(rank=priority)
        try:
            await self._waiters.wait(ticket, timeout_s)
        finally:
            self._waiters.leave(ticket)

    # ---- predictions (the pair search reads a worker's rates here) --------------------------
    def predict(self, spec: RequestSpec, prefill: WorkerHandle | None, decode: WorkerHandle,
                now: float | None = None, waited_s: float = 0.0) -> Prediction:
        search = PairSearch(self, spec, now, waited_s)
        side = search.decode_side(decode)
        return search.local(side) if prefill is None else search.pair(search.prefill_side(prefill), side)

    def prefill_seconds_per_token(self, prefill: WorkerHandle | None) -> float | None:
        """Measured on prefill workers (a decode worker prefilling runs the same model on the
        same kind of core); in colocated mode, on the workers themselves."""
        if prefill is not None:
            return self.model(prefill.worker_id).seconds_per_prefill_token()
        workers = self.registry.alive("prefill") or self.registry.alive("decode")
        rates = [r for r in (self.model(w.worker_id).seconds_per_prefill_token() for w in workers) if r is not None]
        return min(rates) if rates else None

    def decode_step(self, decode: WorkerHandle, prompt: int, now: float, joining: bool = True,
                    fallback_stall: float | None = None) -> float | None:
        """Seconds per token on ``decode`` (with this request added when ``joining``): its step
        time, stretched by the long-run share of that worker's time prefill takes (inf when
        prefill saturates it), times the TPOT correction."""
        seqs = max(decode.num_inflight, decode.stats.num_running if decode.stats else 0) + int(joining)
        step = self.model(decode.worker_id).predict(max(1, seqs), _kv_tokens(decode) + prompt)
        if step is None:
            return None
        rate = decode.prefill_token_rate(now)
        share = self.stall_per_token(decode, fallback_stall) * rate if rate else 0.0
        return step * self.tpot_correction / (1.0 - share) if share < MAX_PREFILL_SHARE else float("inf")

    def tpot_floor(self, spec: RequestSpec) -> float | None:
        """The least TPOT any decode worker could give ``spec``: its step with this request
        alone (no other sequence, no prefill beside it), times the TPOT correction. A target
        below it cannot be met however long the request waits (found by a probe: such a
        request queued for TPOT until its TTFT deadline, 30 s without one, or an idle worker)."""
        prompt = len(spec.prompt_token_ids)
        steps = [s for s in (self.model(d.worker_id).predict(1, prompt) for d in self.registry.alive("decode"))
                 if s is not None]
        return min(steps) * self.tpot_correction if steps else None

    def stall_per_token(self, decode: WorkerHandle, fallback: float | None = None) -> float:
        """Seconds a prompt token prefilled on ``decode`` stalls its decodes: measured there once
        it has prefilled (colocated, or conditional disaggregation), else the prefill workers'
        full per-token time (an upper bound; ``fallback`` when the caller has it already)."""
        stall = self.model(decode.worker_id).prefill_stall_per_token()
        if stall is not None:
            return stall
        return fallback if fallback is not None else (self.prefill_seconds_per_token(None) or 0.0)

    # ---- decisions ---------------------------------------------------------------------------
    def decide(self, spec: RequestSpec, now: float | None = None, waited_s: float = 0.0,
               best_effort: bool = False, hold: RoomHold | None = None) -> Decision:
        """``best_effort``: no SLO check, the least loaded pair (a migrating request was
        admitted once already). ``hold``: room kept for an earlier request waiting for it
        (``_hold``), not to be taken by this one."""
        if not self.registry.can_serve and self.registry.recovering("decode"):
            return Decision(Action.QUEUE, Cause.RESTARTING, "waiting for a decode worker to restart")
        ttft_t, tpot_t = self._targets(spec)
        search = PairSearch(self, spec, now, waited_s, hold)
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
            room = (lambda d: _has_prompt_room(d.worker, spec, hold)) if search.prefills else None
            best = search.least_loaded(room)
            if best is None:
                return Decision(Action.QUEUE, Cause.KV_FULL, "decode KV cache full", search.least_loaded(),
                                len(spec.prompt_token_ids))
            if self.enabled and (ttft_t is not None or tpot_t is not None) and _prefill_busy(best):
                return Decision(Action.QUEUE, Cause.NO_TIMINGS, "no step timings yet: one prompt at a time per "
                                "prefill worker until they report", best)
            return Decision(Action.ADMIT, Cause.BEST_EFFORT if self.enabled else Cause.ADMISSION_OFF, prediction=best)
        best = search.choose(ttft_t, tpot_t)
        if _idle(best):  # refusing an idle pair helps no one; its timings also refresh the models
            return Decision(Action.ADMIT, Cause.IDLE, prediction=best)
        share = self.ttft_margin.share
        if not best.fits_ttft(ttft_t, share):
            return Decision(Action.REJECT, Cause.TTFT, _ttft_miss_message(best, ttft_t, share, spec), best)
        if not fits_tpot(best.tpot_s, tpot_t):
            floor = self.tpot_floor(spec)
            if floor is not None and not fits_tpot(floor, tpot_t):   # no wait helps: refused at once
                return Decision(Action.REJECT, Cause.TPOT_FLOOR, f"TPOT target {_target(tpot_t, spec.slo.tpot_s, spec, 1)} is below "
                                f"{floor * 1e3:.1f} ms, the predicted step of this request alone on the fastest "
                                f"decode worker", best)
            return Decision(Action.QUEUE, Cause.TPOT, f"predicted TPOT {best.tpot_s * 1e3:.1f} ms > target {tpot_t * 1e3:.1f} ms", best)
        if not best.spares_running:
            return Decision(Action.QUEUE, Cause.RUNNING_TPOT, f"a running request's TPOT would reach {best.running_tpot_ratio:.0%} of its target", best)
        if not has_kv_room(best.decode, spec, hold):
            return Decision(Action.QUEUE, Cause.KV_FULL, "decode KV cache full", best, kv_tokens_of(spec))
        return Decision(Action.ADMIT, Cause.WITHIN_SLO, prediction=best)

    async def acquire(self, spec: RequestSpec, metrics=None, resuming: bool = False,
                      line_since: float | None = None) -> Prediction:
        """Admit (returning the pair), wait in the queue, or raise CapacityError.
        ``resuming``: a migrating request, placed best effort; it waits up to
        ``RESUME_WAIT_S`` for a worker to come back. ``line_since``: a retry of a request
        admitted once (its reservation was refused for room) queues for room in the place of a
        request that began to wait then (its arrival), not behind every later one, and its wait
        and TTFT deadline count from then too (found by a probe: a retry queued for a second
        whole TTFT budget, its prediction leaving out the time already spent)."""
        ttft_t, _ = self._targets(spec)
        start = time.perf_counter() if line_since is None else line_since
        # Backstop: the TTFT prediction counts the wait too.
        deadline = start + (RESUME_WAIT_S if resuming else (ttft_t or QUEUE_BACKSTOP_S))
        decision = self.decide(spec, waited_s=time.perf_counter() - start, best_effort=resuming,
                               hold=self._hold(spec, resuming))
        ticket, admitted = None, False
        waiting = _Waiting(decision.cause)   # what it waits for: the wake check reads it (this loop owns it)
        try:
            while decision.action is Action.QUEUE:
                queue_reason = decision.reason
                waiting.cause = decision.cause
                self._line_up(spec, decision, resuming, line_since)
                if ticket is None:
                    if self.max_queued is not None and self.num_queued >= self.max_queued and not resuming:
                        raise CapacityError(f"max_queued_requests: {self.num_queued} requests are queued "
                                            f"({decision.reason}); retry later", "queue_full")
                    ticket = self._waiters.enter(None if resuming else lambda worker: self._may_go_on(worker, spec, waiting.cause),
                                                 spec.priority)
                    self._count_queue(+1, metrics, decision)
                remaining = deadline - time.perf_counter()
                if remaining <= 0 and resuming and decision.prediction is None:
                    raise WorkerFailedError(f"no serving worker came back in time ({decision.reason})")
                if remaining <= 0:   # a fresh request's own deadline, whatever it waited for (a restart too)
                    raise CapacityError(_queue_deadline_message(ttft_t, decision.reason), "queue_deadline")
                # Woken by one worker's report, the check ran in ``notify``, but earlier waiters may
                # have taken that worker's room since: checked again (a decision only if still free).
                source = await self._waiters.wait(ticket, remaining)
                if source is not None and not resuming and not self._may_go_on(source, spec, waiting.cause):
                    continue   # only ``source`` changed and it still has no room: the last decision holds
                decision = self.decide(spec, waited_s=time.perf_counter() - start, best_effort=resuming,
                                       hold=self._hold(spec, resuming))
            admitted = decision.action is Action.ADMIT
        finally:
            self._leave_line(spec.req_id, wake=not admitted)
            if ticket is not None:
                self._waiters.leave(ticket)
                self._count_queue(-1, metrics)
        queued = ticket is not None
        if decision.action is Action.REJECT:
            raise CapacityError(decision.reason + (f"; queued for: {queue_reason}" if queued else ""),
                                decision.cause.value, _retry_after_s(decision, ttft_t, self.ttft_margin.share))
        if metrics is not None and line_since is None:   # a retry is the same request's admission: counted once
            metrics.admission(Action.ADMIT.value, decision.cause.value)
        return decision.prediction

    def _hold(self, spec: RequestSpec, resuming: bool = False) -> RoomHold | None:
        """The room a request must leave free: what the first request queued for room waits
        for, unless it is that request, one of a higher priority class (lower ``priority``:
        room goes to it first), or a migrating one (admitted once already: it resumes best
        effort). First come, first served for KV room within a class, as an engine's waiting
        queue is: without it, a stream of small requests fitting the room as it freed kept a
        large one queued until its deadline (found by a probe). Held on one decode worker only
        (the others take requests as before), where the first one goes once the room is there,
        and only once it has waited ``HOLD_AFTER_S``."""
        first = self._room_line.first()
        if first is None or resuming:
            return None
        req_id, hold, priority = first
        if req_id == spec.req_id or spec.priority < priority or time.perf_counter() - hold.since < HOLD_AFTER_S:
            return None
        return hold

    def _line_up(self, spec: RequestSpec, decision: Decision, resuming: bool, line_since: float | None = None) -> None:
        """A request queued for KV room keeps its place in the room line (joining it the first
        time: at the back of its class, or where ``line_since`` puts it); queued for anything
        else, it leaves it."""
        if decision.cause is Cause.KV_FULL and not resuming:
            # where most room is now: the worker it can get into soonest (re-chosen at each decision)
            roomiest = max(self.registry.alive("decode"), key=lambda w: w.free_blocks or 0, default=None)
            if roomiest is None:
                return
            held = self._room_line.get(spec.req_id)
            since = held.since if held is not None else line_since
            if since is None:
                since = time.perf_counter()
            self._room_line.place(spec.req_id, RoomHold(roomiest.worker_id, decision.room_tokens, since), spec.priority)
        else:
            self._leave_line(spec.req_id)

    def _leave_line(self, req_id: str, wake: bool = True) -> None:
        """Out of the room line. ``wake``: when the first one leaves without taking its room
        (refused, gone, queued for something else now), what it held may be what the next one
        needs: the queue decides again (one taking its room changes nothing for the others
        until a worker reports, which wakes them: a bounded wake per report either way)."""
        if self._room_line.leave(req_id) and wake:
            self.notify()

    def _may_go_on(self, worker: WorkerHandle, spec: RequestSpec, cause: Cause) -> bool:
        """Whether ``worker``'s report could let a request queued for ``cause`` go on: one
        waiting for the first timings (``Cause.NO_TIMINGS``) at any live worker's report, a
        prefill worker's too (its first timings, or its queue emptied); else ``_could_take``."""
        return worker.alive if cause is Cause.NO_TIMINGS else self._could_take(worker, spec)

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
        if _decode_idle(worker):
            return True   # a decision admits there whatever it predicts (``_idle``)
        ttft_t, tpot_t = self._targets(spec)
        hold = self._hold(spec)
        if not self.enabled or (ttft_t is None and tpot_t is None):
            # queued best effort: for the prompt's room alone (a reservation's; none without prefill workers)
            return not self.registry.alive("prefill") or _has_prompt_room(worker, spec, hold)
        return PairSearch(self, spec, None, 0.0, hold).decode_fits(worker, tpot_t)

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


def _corrected(current: float, predicted_s: float | None, observed_s: float, low: float, high: float) -> float:
    """``predicted_s`` already carries ``current``: move it geometrically toward the
    observed/predicted ratio (an EMA in log space), so it converges on the true bias; clamped
    so one outlier can't shut admission down or open it wide."""
    if not predicted_s or not math.isfinite(predicted_s) or observed_s <= 0:
        return current
    return min(high, max(low, current * (observed_s / predicted_s) ** 0.2))


def _target(scaled_s: float, asked_s: float, spec: RequestSpec, digits: int = 0) -> str:
    """A target as a refusal says it: the one decided by, and the one the client sent where its
    priority scaled it (the client would otherwise read a target it never asked for)."""
    said = f"{scaled_s * 1e3:.{digits}f} ms"
    if scaled_s == asked_s:
        return said
    return f"{said} ({asked_s * 1e3:.{digits}f} ms asked, scaled for priority {spec.priority})"


def _ttft_miss_message(best: Prediction, target: float, share: float, spec: RequestSpec) -> str:
    """Why a request is refused for TTFT, in the terms ``_fits_ttft`` decides by (a prediction
    under its target can still miss the safety share)."""
    msg = f"predicted TTFT {best.ttft_s * 1e3:.0f} ms"
    if best.waited_s:
        msg += f" ({best.waited_s * 1e3:.0f} ms of it queued)"
    if best.ttft_s <= target:
        left = (target - best.waited_s) * 1e3
        return msg + (f" leaves less than a {1 - share:.0%} safety margin of the {left:.0f} ms left "
                      f"of the TTFT target {_target(target, spec.slo.ttft_s, spec)}")
    return msg + f" > target {_target(target, spec.slo.ttft_s, spec)}"


def _retry_after_s(decision: Decision, target: float | None, share: float) -> float:
    """When the same request, sent again, would likely be admitted: the work queued ahead of it
    drains in real time, so once its predicted TTFT's excess over the target's safety share has
    passed (at least a second, at most ``MAX_RETRY_AFTER_S``)."""
    p = decision.prediction
    if decision.cause is not Cause.TTFT or p is None or p.ttft_s is None or not target:
        return DEFAULT_RETRY_AFTER_S
    excess = (p.ttft_s - p.waited_s) - target * share
    return min(MAX_RETRY_AFTER_S, max(DEFAULT_RETRY_AFTER_S, excess))


@dataclass(slots=True)
class _Waiting:
    """A queued request's last cause, read by its wake check (``_may_go_on``)."""

    cause: Cause


def _prefill_busy(p: Prediction) -> bool:
    """The worker that would prefill ``p``'s prompt has a prompt queued already (the router's
    count or its own report): without timings, nothing says how long this one would wait."""
    return queued_prefill_tokens(p.prefill or p.decode) > 0


def _idle(p: Prediction) -> bool:
    return _decode_idle(p.decode) and not (p.prefill and p.prefill.num_prefill_tokens)


def _decode_idle(w: WorkerHandle) -> bool:
    """Nothing in flight from the router, nothing running or waiting in its last report."""
    return not w.num_inflight and not (w.stats and (w.stats.num_running or w.stats.num_waiting))


def _kv_tokens(w: WorkerHandle) -> int:
    if w.stats is None:
        return 0
    return (w.stats.num_total_blocks - w.stats.num_free_blocks) * w.stats.block_size


def _has_prompt_room(w: WorkerHandle, spec: RequestSpec, hold: RoomHold | None = None) -> bool:
    """Room for what ``reserve`` takes now: the prompt's blocks (decoding may preempt later),
    beside the reservations already promised there and the room held (``has_room``)."""
    return has_room(w, len(spec.prompt_token_ids), hold)


def _queue_deadline_message(ttft_t: float | None, reason: str) -> str:
    if ttft_t is None:   # the client set no target: the backstop it ran into is the server's
        return f"queued longer than {QUEUE_BACKSTOP_S:g} s, the limit for a request without a TTFT target ({reason})"
    return f"queued past its TTFT deadline ({reason})"


