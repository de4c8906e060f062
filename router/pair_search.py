"""The pair search: predict each candidate (prefill, decode) pair and choose one.

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
         either way), so its check is met without looking.
The per-worker rates behind these (seconds per prefill token, per decode step, per prompt token
stalling a decode worker) are ``Admission``'s: it owns the step-time models and their online
corrections; the search reads them and writes nothing outside itself.
Pair choice: among the pairs predicted to meet both targets, disaggregated pairs first, then
the lowest TTFT (balances prefill queues, and weighs a cached prefix against a longer queue: both
are prompt tokens to compute), then the most headroom. Without targets or timings: the least
queued work (prefill tokens queued there minus the prefix expected cached there), then the
fewest requests decoding, then the decode worker holding most of the prompt already (fewer
bytes to move). The search takes each worker's part once (``PairSearch``: a pair's TTFT is its
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

Life cycle: one ``PairSearch`` per decision (``Admission.decide``, ``Admission.predict``,
``Admission._could_take``): made with the request, the time and the time it already queued, it
builds each worker's part on first use, at most once, and is dropped with the decision.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable

from engine.errors import WorkerFailedError
from engine.types import RequestSpec
from router.registry import WorkerHandle

if TYPE_CHECKING:
    from router.admission import Admission

# Predictions must fit a share of their target: the models are fitted, not exact. TTFT is a hard
# per-request deadline predicted from a queue (errors add up): its share follows how far recent
# predictions were off (``router.ttft_margin``); TPOT is an average over a lifetime.
TPOT_SAFETY = 0.9
LOCAL_PREFILL_TOKENS = 16  # a decode worker prefilling this few is cheaper than a hand-off (~one decode step's cost)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate pair and what is predicted for the request on it: what admission decides
    by, the orchestrator runs the request on, and the TTFT correction learns from."""

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
        return self.prefill is None and _holds_all_but_a_block(self.cached_tokens, self.num_prompt_tokens)

    def headroom(self, ttft_target: float | None, tpot_target: float | None) -> float:
        """Smallest relative slack against the targets (higher is better; < 0 misses one)."""
        running = 1.0 - self.running_tpot_ratio if self.running_tpot_ratio is not None else math.inf
        return min(_slack(self.ttft_s, ttft_target), _slack(self.tpot_s, tpot_target), running)

    @property
    def spares_running(self) -> bool:
        """No request decoding there would be pushed past the safety share of its TPOT target."""
        return self.running_tpot_ratio is None or self.running_tpot_ratio <= TPOT_SAFETY

    def fits_tpot(self, target: float | None) -> bool:
        return self.spares_running and fits_tpot(self.tpot_s, target)

    def fits_ttft(self, target: float | None, share: float) -> bool:
        return fits_ttft(self.ttft_s, self.waited_s, target, share)


# The sides are built for every worker in every decision and never change once built (but for
# the lazily computed ``local_ttft_s``); not frozen: a frozen dataclass's __init__
# (object.__setattr__ per field) costs four times as much.
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
    cached: int                         # prompt tokens expected in its cache: a hand-off moves the rest
    tpot_s: float | None
    kv_room: bool                       # room for the prompt and every token it may generate
    local_cached: int = 0               # of those, what it skips when it prefills the prompt itself
    local_ttft_s: float | None = math.nan   # ``PairSearch.local_ttft``'s (nan: not asked for yet)

    def fits(self, tpot_target: float | None) -> bool:
        """Its TPOT with the request joining within target, and KV room: what every candidate on
        this worker must pass, disaggregated or prefilling itself."""
        return fits_tpot(self.tpot_s, tpot_target) and self.kv_room


class PairSearch:
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

    def __init__(self, admission: Admission, spec: RequestSpec, now: float | None, waited_s: float,
                 hold: RoomHold | None = None) -> None:
        self.admission = admission
        self.spec = spec
        self.prompt = len(spec.prompt_token_ids)
        self.now = time.perf_counter() if now is None else now
        self.waited_s = waited_s
        self.hold = hold   # room kept for an earlier request waiting for it (``has_room``)

    @cached_property
    def ttft_share(self) -> float:
        return self.admission.ttft_margin.share

    @cached_property
    def local_rate(self) -> float | None:
        """Seconds per prompt token where the decode worker prefills (the prefill workers' rate)."""
        return self.admission.prefill_seconds_per_token(None)

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
    @cached_property
    def reads_cache(self) -> bool:
        """Its prefill skips a cached prefix: not so where it owes prompt logprobs (the engine
        computes every prompt position then). A decode worker's blocks still spare a hand-off."""
        return not self.spec.owes_prompt_logprobs

    def prefill_side(self, p: WorkerHandle) -> _PrefillSide:
        cached = p.prefix.expected_hit(self.spec.prompt_token_ids) if self.reads_cache else 0
        per_token = self.admission.prefill_seconds_per_token(p)
        return _PrefillSide(p, cached, self._ttft(p, self.prompt - cached, per_token))

    def decode_side(self, d: WorkerHandle) -> _DecodeSide:
        step = self.admission.decode_step(d, self.prompt, self.now, fallback_stall=self.local_rate or 0.0)
        cached = d.prefix.expected_hit(self.spec.prompt_token_ids)
        return _DecodeSide(d, cached, step, has_kv_room(d, self.spec, self.hold), cached if self.reads_cache else 0)

    def _ttft(self, worker: WorkerHandle, tokens: int, per_token: float | None) -> float | None:
        """No hand-off term: the first token leaves the prefill worker before its KV moves."""
        if per_token is None:
            return None
        queued = queued_prefill_tokens(worker)
        return self.waited_s + self.admission.ttft_overhead_s + (queued + tokens) * per_token * self.admission.ttft_correction

    def local_ttft(self, d: _DecodeSide) -> float | None:
        """The TTFT when ``d``'s worker prefills the prompt itself. Computed on first use: most
        decisions ask it of the few decode workers holding the prompt, a queued request's of
        every one, by three rules."""
        ttft = d.local_ttft_s
        if ttft != ttft:   # nan: not computed yet (a computed TTFT is never nan)
            ttft = d.local_ttft_s = self._ttft(d.worker, self.prompt - d.local_cached, self.local_rate)
        return ttft

    def pair(self, p: _PrefillSide, d: _DecodeSide) -> Prediction:
        return Prediction(p.worker, d.worker, p.ttft_s, d.tpot_s, None, self.waited_s, self.prompt, p.cached, d.cached,
                          self.admission.ttft_overhead_s)

    def local(self, d: _DecodeSide) -> Prediction:
        """The decode worker prefills the prompt itself (what is not in its cache)."""
        own = self.prompt - d.local_cached
        running = None
        if d.tpot_s is not None:
            stall = self.admission.stall_per_token(d.worker, self.local_rate or 0.0)
            running = running_tpot_ratio(d.worker, d.tpot_s, own, self.now, stall)
        return Prediction(None, d.worker, self.local_ttft(d), d.tpot_s, running, self.waited_s, self.prompt,
                          d.local_cached, d.local_cached, self.admission.ttft_overhead_s)

    def decode_fits(self, d: WorkerHandle, tpot_target: float | None) -> bool:
        """Whether ``d`` could take the request as far as its own part goes (``_DecodeSide.fits``)."""
        return self.decode_side(d).fits(tpot_target)

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
        return self.local(min(decodes, key=lambda d: (d.worker.num_prefill_tokens - d.local_cached, *_decode_load(d))))

    def choose(self, ttft_t: float | None, tpot_t: float | None) -> Prediction:
        """Among the pairs predicted to meet both targets (with KV room): disaggregated ones
        first (a decode worker takes a prompt only when no prefill worker can meet its TTFT),
        then the lowest TTFT (it balances prefill queues; TPOT already fits), then the most
        headroom. When none meets both: the most headroom among those meeting TTFT (the
        request may queue for decode capacity), else among all (it will be rejected)."""
        fit_p = [p for p in self.prefills if fits_ttft(p.ttft_s, self.waited_s, ttft_t, self.ttft_share)]
        fit_d = [d for d in self.decodes if d.fits(tpot_t)]
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
            if cheap_only and not _holds_all_but_a_block(d.local_cached, self.prompt):
                continue
            ttft = self.local_ttft(d)
            if fits_ttft(ttft, self.waited_s, ttft_t, self.ttft_share) and d.fits(tpot_t):
                cands.append((ttft, i, d))
        return self._most_headroom_local(cands, ttft_t, tpot_t, must_spare_running=True)

    def _most_headroom(self, ttft_t: float | None, tpot_t: float | None, fit_p: list[_PrefillSide]) -> Prediction:
        """The most headroom among the candidates meeting TTFT, else among all. A
        disaggregated pair's headroom is the smaller of its two parts' slacks: the best is
        min(best prefill slack, best decode slack), reached first by the first prefill and
        then the first decode worker reaching it."""
        local = [(0.0, i, d) for i, d in enumerate(self.decodes)] if self.with_local else []
        locals_fit = [c for c in local if fits_ttft(self.local_ttft(c[2]), self.waited_s, ttft_t, self.ttft_share)]
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


def running_tpot_ratio(decode: WorkerHandle, step_s: float, own_prompt: int, now: float,
                       per_token: float) -> float | None:
    """Worst projected / target TPOT among the requests admitted to ``decode`` if this one
    prefills there (``own_prompt`` tokens): each stalls, after its first token, for the
    prefill queued behind it there plus ``own_prompt``, then steps at ``step_s`` (a request
    still awaiting its first token counts too: the prompts queued behind it are prefilled
    after it starts decoding). Requests already past the safety line without this prompt
    are left out: one such request would otherwise block the worker until it finishes (a
    request's worth of goodput kept, several lost), or it is lost either way. O(requests
    there): asked only of the decode workers a decision considers prefilling on."""
    queued = queued_prefill_tokens(decode)
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


def fits_tpot(tpot_s: float | None, target: float | None) -> bool:
    """A TPOT prediction must fit the safety share of its target (an average over a lifetime:
    a fixed share, unlike TTFT's)."""
    return not target or tpot_s is None or tpot_s <= target * TPOT_SAFETY


def _holds_all_but_a_block(cached: int, prompt: int) -> bool:
    """A decode worker holding this much of a prompt prefills the rest as cheaply as a hand-off."""
    return cached > 0 and prompt - cached <= LOCAL_PREFILL_TOKENS


def _decode_load(d: _DecodeSide) -> tuple[int, int, int]:
    free = d.worker.stats.num_free_blocks if d.worker.stats else 0
    return (d.worker.num_inflight, -d.cached, -free)


def _slack(predicted: float | None, target: float | None) -> float:
    """Relative slack of a prediction against its target (inf when either is unset)."""
    return 1.0 - predicted / target if predicted is not None and target else math.inf


def fits_ttft(ttft_s: float | None, waited_s: float, target: float | None, share: float) -> bool:
    """The predicted part, not the time already queued (known exactly), must fit the safety
    ``share`` of what is left (``router.ttft_margin``): a request that waited for decode
    capacity is not rejected for a margin on time that is no longer uncertain."""
    if not target or ttft_s is None:
        return True
    return ttft_s - waited_s <= (target - waited_s) * share


def queued_prefill_tokens(w: WorkerHandle) -> int:
    """The router's count is fresh; the worker's own adds prompts it must recompute."""
    return max(w.num_prefill_tokens, w.stats.num_waiting_tokens if w.stats else 0)


def kv_tokens_of(spec: RequestSpec) -> int:
    """The KV a request may come to hold: its prompt and every token it may generate."""
    return len(spec.prompt_token_ids) + spec.sampling.max_tokens


@dataclass(frozen=True, slots=True)
class RoomHold:
    """KV room on one decode worker kept for the first request waiting for room there
    (``Admission``'s room line): later requests may take only what is left beside it."""

    worker_id: str
    tokens: int
    since: float = 0.0   # when the request began to wait for room (perf_counter)


def has_kv_room(w: WorkerHandle, spec: RequestSpec, hold: RoomHold | None = None) -> bool:
    """Room for the prompt and every token it may generate."""
    return has_room(w, kv_tokens_of(spec), hold)


def has_room(w: WorkerHandle, num_tokens: int, hold: RoomHold | None = None) -> bool:
    """Room for ``num_tokens``' blocks beside the reservations already promised there
    (``WorkerHandle.free_blocks``) and the room ``hold`` keeps there (first come, first served;
    none where it could never fit); a worker that has not reported yet is taken to have it."""
    if w.stats is None:
        return True
    held = w.blocks_for(hold.tokens) if hold is not None and hold.worker_id == w.worker_id else 0
    if held > w.stats.num_total_blocks:
        held = 0
    return w.blocks_for(num_tokens) + held <= w.free_blocks
