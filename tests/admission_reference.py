"""The admission decision as main e219ab3 made it, frozen: a test oracle, not code to serve with.

``tests/test_admission_same_decisions.py`` runs random clusters and requests through this and
through ``router.admission`` and asserts the same ``Decision`` (action, cause, detail and every
field of the prediction, floats bit for bit). The serving search was made cheaper (each decode
worker's terms computed once per decision, not once per rule; sides not frozen) without
changing what it decides; this copy is what "what it decided" means. Its helpers that were not
changed (step-time predictions, slack and fit rules, ``Prediction`` and ``Decision``) are
imported from ``router.admission`` and ``router.pair_search``: the oracle pins the search, not
the models. Delete it when the rules themselves change on purpose (or mirror a small change:
session 14's best-effort room rule is).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from engine.errors import WorkerFailedError
from engine.types import RequestSpec
from router.admission import Action, Admission, Cause, Decision, _has_prompt_room, _idle, _target, _ttft_miss_message
from router.pair_search import (LOCAL_PREFILL_TOKENS, TPOT_SAFETY, Prediction, _decode_load, _slack, fits_ttft,
                                fits_tpot, has_kv_room, queued_prefill_tokens, running_tpot_ratio)
from router.registry import WorkerHandle


def reference_decide(self: Admission, spec: RequestSpec, now: float | None = None, waited_s: float = 0.0,
                     best_effort: bool = False) -> Decision:
    """``Admission.decide`` as of e219ab3 (``self``: the admission whose state it reads).
    ``best_effort``: no SLO check, the least loaded pair (a migrating request was
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
        # Best effort, or no timings yet: least loaded where the prompt fits (the rule changed on
        # purpose in session 14, mirrored here: a prefill whose reservation would be refused waits).
        # (A decode worker prefilling takes no reservation: its engine queues what does not fit.)
        room = (lambda d: _has_prompt_room(d.worker, spec)) if search.prefills else None
        best = search.least_loaded(room)
        if best is None:   # the room it waits for, mirrored (session 29: first come, first served for room)
            return Decision(Action.QUEUE, Cause.KV_FULL, "decode KV cache full", search.least_loaded(),
                            len(spec.prompt_token_ids))
        if self.enabled and (ttft_t is not None or tpot_t is not None) and queued_prefill_tokens(best.prefill or best.decode):
            # mirrored on purpose (session 17's admission probe): no timings, one prompt at a time per prefill worker
            return Decision(Action.QUEUE, Cause.NO_TIMINGS, "no step timings yet: one prompt at a time per "
                            "prefill worker until they report", best)
        return Decision(Action.ADMIT, Cause.BEST_EFFORT if self.enabled else Cause.ADMISSION_OFF, prediction=best)
    best = search.choose(ttft_t, tpot_t)
    if _idle(best):  # refusing an idle pair helps no one; its timings also refresh the models
        return Decision(Action.ADMIT, Cause.IDLE, prediction=best)
    share = self.ttft_margin.share
    if not best.fits_ttft(ttft_t, share):
        return Decision(Action.REJECT, Cause.TTFT, _ttft_miss_message(best, ttft_t, share, spec), best)
    if tpot_t and best.tpot_s is not None and best.tpot_s > tpot_t * TPOT_SAFETY:
        floor = self.tpot_floor(spec)   # mirrored on purpose (session 17's admission probe): refused at once
        if floor is not None and floor > tpot_t * TPOT_SAFETY:
            return Decision(Action.REJECT, Cause.TPOT_FLOOR, f"TPOT target {_target(tpot_t, spec.slo.tpot_s, spec, 1)} is below "
                            f"{floor * 1e3:.1f} ms, the predicted step of this request alone on the fastest "
                            f"decode worker", best)
        return Decision(Action.QUEUE, Cause.TPOT, f"predicted TPOT {best.tpot_s * 1e3:.1f} ms > target {tpot_t * 1e3:.1f} ms", best)
    if not best.spares_running:
        return Decision(Action.QUEUE, Cause.RUNNING_TPOT, f"a running request's TPOT would reach {best.running_tpot_ratio:.0%} of its target", best)
    if not has_kv_room(best.decode, spec):
        return Decision(Action.QUEUE, Cause.KV_FULL, "decode KV cache full", best,
                        len(spec.prompt_token_ids) + spec.sampling.max_tokens)
    return Decision(Action.ADMIT, Cause.WITHIN_SLO, prediction=best)


def _prefill_seconds_per_token(self: Admission, prefill: WorkerHandle | None) -> float | None:
    """Measured on prefill workers (a decode worker prefilling runs the same model on the
    same kind of core); in colocated mode, on the workers themselves."""
    workers = [prefill] if prefill else (self.registry.alive("prefill") or self.registry.alive("decode"))
    rates = [r for r in (self.model(w.worker_id).seconds_per_prefill_token() for w in workers) if r is not None]
    return min(rates) if rates else None


@dataclass(frozen=True, slots=True)
class _PrefillSide:
    """A prefill worker's part of every pair it is in: the TTFT depends on it alone."""

    worker: WorkerHandle
    cached: int                # prompt tokens expected in its prefix cache
    ttft_s: float | None       # including the time already queued


@dataclass(frozen=True, slots=True)
class _DecodeSide:
    """A decode worker's part of every pair it is in: the TPOT depends on it alone."""

    worker: WorkerHandle
    cached: int
    tpot_s: float | None


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
        return _prefill_seconds_per_token(self.admission, None)

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
        per_token = _prefill_seconds_per_token(self.admission, p)
        return _PrefillSide(p, cached, self._ttft(p, self.prompt - cached, per_token))

    def decode_side(self, d: WorkerHandle) -> _DecodeSide:
        step = self.admission.decode_step(d, self.prompt, self.now, fallback_stall=self.local_rate or 0.0)
        return _DecodeSide(d, d.prefix.expected_hit(self.spec.prompt_token_ids), step)

    def _ttft(self, worker: WorkerHandle, tokens: int, per_token: float | None) -> float | None:
        """No hand-off term: the first token leaves the prefill worker before its KV moves."""
        if per_token is None:
            return None
        queued = queued_prefill_tokens(worker)
        return self.waited_s + self.admission.ttft_overhead_s + (queued + tokens) * per_token * self.admission.ttft_correction

    def _local_ttft(self, d: _DecodeSide) -> float | None:
        return self._ttft(d.worker, self.prompt - d.cached, self.local_rate)

    def pair(self, p: _PrefillSide, d: _DecodeSide) -> Prediction:
        return Prediction(p.worker, d.worker, p.ttft_s, d.tpot_s, None, self.waited_s, self.prompt, p.cached, d.cached,
                          self.admission.ttft_overhead_s)

    def local(self, d: _DecodeSide) -> Prediction:
        """The decode worker prefills the prompt itself (what is not in its cache)."""
        own = self.prompt - d.cached
        running = None
        if d.tpot_s is not None:
            stall = self.admission.stall_per_token(d.worker, self.local_rate or 0.0)
            running = running_tpot_ratio(d.worker, d.tpot_s, own, self.now, stall)
        return Prediction(None, d.worker, self._local_ttft(d), d.tpot_s, running, self.waited_s, self.prompt,
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
        return self.local(min(decodes, key=lambda d: (d.worker.num_prefill_tokens - d.cached, *_decode_load(d))))

    def choose(self, ttft_t: float | None, tpot_t: float | None) -> Prediction:
        """Among the pairs predicted to meet both targets (with KV room): disaggregated ones
        first (a decode worker takes a prompt only when no prefill worker can meet its TTFT),
        then the lowest TTFT (it balances prefill queues; TPOT already fits), then the most
        headroom. When none meets both: the most headroom among those meeting TTFT (the
        request may queue for decode capacity), else among all (it will be rejected)."""
        fit_p = [p for p in self.prefills if fits_ttft(p.ttft_s, self.waited_s, ttft_t, self.ttft_share)]
        fit_d = [d for d in self.decodes if fits_tpot(d.tpot_s, tpot_t) and has_kv_room(d.worker, self.spec)]
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
            ttft = self._local_ttft(d)
            if fits_ttft(ttft, self.waited_s, ttft_t, self.ttft_share) and fits_tpot(d.tpot_s, tpot_t) \
                    and has_kv_room(d.worker, self.spec):
                cands.append((ttft, i, d))
        return self._most_headroom_local(cands, ttft_t, tpot_t, must_spare_running=True)

    def _most_headroom(self, ttft_t: float | None, tpot_t: float | None, fit_p: list[_PrefillSide]) -> Prediction:
        """The most headroom among the candidates meeting TTFT, else among all. A
        disaggregated pair's headroom is the smaller of its two parts' slacks: the best is
        min(best prefill slack, best decode slack), reached first by the first prefill and
        then the first decode worker reaching it."""
        local = [(0.0, i, d, self._local_ttft(d)) for i, d in enumerate(self.decodes)] if self.with_local else []
        locals_fit = [c for c in local if fits_ttft(c[3], self.waited_s, ttft_t, self.ttft_share)]
        any_fit = bool(fit_p or locals_fit)
        prefills = fit_p if any_fit else self.prefills
        best = None
        if prefills:
            a = [_slack(p.ttft_s, ttft_t) for p in prefills]
            h = [_slack(d.tpot_s, tpot_t) for d in self.decodes]
            value = min(max(a), max(h))
            p = next(p for p, ap in zip(prefills, a) if ap >= value)
            best = self.pair(p, next(d for d, hd in zip(self.decodes, h) if hd >= value))
        cands = [c[:3] for c in (locals_fit if any_fit else local)]
        return self._most_headroom_local(cands, ttft_t, tpot_t, must_spare_running=False, best=best)

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
            return min(_slack(self._local_ttft(c[2]), ttft_t), _slack(c[2].tpot_s, tpot_t))

        for key, i, d, upper in sorted(((c[0], c[1], c[2], bound(c)) for c in cands), key=lambda c: (c[0], -c[3], c[1])):
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
