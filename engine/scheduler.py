"""Iteration-level scheduler (vLLM v1 style): which requests run this step, and how many tokens each.

Queues: ``waiting`` (new or preempted, ordered by priority then arrival), ``running``
(ordered by admission), ``parked`` (decode role: blocks reserved, KV still in flight).

One step: ``schedule()`` spends a token budget on running requests first (decode tokens and
the next chunk of unfinished prompts), then admits waiting ones, chunking any prompt that
does not fit. When blocks run out the lowest-priority, latest running request is preempted
by recompute: its blocks are freed and it re-queues with ``num_computed_tokens = 0``; it is
re-admitted only with room for all it recomputes, and while that room is not there the waiting
requests behind it may go first (a preempted request re-admitted chunk by chunk was preempted
again by its own next chunk, forever, holding up the whole line).
``update_from_output()`` advances computed tokens, appends sampled tokens, applies stop
conditions and frees finished requests' blocks (a prefill worker holds them for export).
Aborts are applied at the next step boundary.
Prefix caching: a request admitted from ``waiting`` (new, or preempted) starts after the
longest cached prefix of its tokens (``num_computed_tokens`` = the cached length, never all of
them); blocks its computed tokens fill are filed in the cache after each step
(``KVCacheManager.cache_computed``), so the next request with that prefix skips them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from engine import prompt_logprobs
from engine.config import EngineConfig, EngineRole
from engine.kv_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.stop import StopChecker
from engine.types import FinishReason, TopLogprobs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int     # tokens computed this step, starting at request.num_computed_tokens
    sample: bool            # True when this chunk reaches the last known token: sample the next one
    # The request's block table after this step's allocation: the KV manager's own list, read
    # by the model runner (which never touches the manager, as in vLLM: block ids ride on the plan).
    block_ids: list[int]
    # Positions whose logits this step keeps for the request's prompt logprobs (most: none).
    prompt_positions: range = range(0)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, stop: StopChecker) -> None:
        self.config = config
        self.kv = kv
        self.stop = stop
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}
        self.held: dict[str, Request] = {}       # prefill role: finished, blocks kept for KV export
        self.requests: dict[str, Request] = {}
        self._pending_aborts: set[str] = set()
        self.num_preemptions = 0

    # ---- queue entry points -------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Something to schedule, or an abort to apply at the next step boundary."""
        return bool(self.waiting or self.running or self._pending_aborts)

    def add(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self._enqueue_waiting(request)

    def park(self, request: Request, cached: list[int] | tuple[int, ...] = ()) -> list[int]:
        """Decode role: reserve blocks for the prompt's KV, sharing the ``cached`` prefix blocks
        (from ``kv.find_cached``: their KV is here already); the request waits for the rest."""
        self.kv.admit(request.req_id, request.all_token_ids, cached, request.num_prompt_tokens)
        request.forgo_prompt_logprobs()   # the prefill worker computes the prompt (and sends them)
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.req_id] = request
        self.parked[request.req_id] = request
        return list(self.kv.block_tables[request.req_id])

    @property
    def num_parked_blocks(self) -> int:
        """Blocks held by reservations whose KV has not landed yet (a router counts these as its
        own promises until the request decodes: see ``WorkerStats.num_parked_blocks``)."""
        return sum(len(self.kv.block_tables.get(req_id, ())) for req_id in self.parked)

    def unpark(self, req_id: str, first_token_id: int) -> Request:
        """KV landed: the request joins the running batch with its prompt computed."""
        request = self.parked.pop(req_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_computed(req_id, request.all_token_ids, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        # The prefill worker already delivered the first token and its logprobs; placeholders
        # keep output_logprobs / output_top_logprobs aligned with output_token_ids (deltas slice
        # them alike).
        self._append_token(request, first_token_id, math.nan if request.sampling.logprobs else None,
                           () if request.sampling.logprobs and request.sampling.top_logprobs else None)
        request.num_reported_tokens = 1  # the prefill worker already delivered the first token
        return request

    def abort(self, req_id: str) -> bool:
        """True when the request is gone now: a parked one (KV not landed) or a held one (prefill
        done, KV not exported) frees its blocks at once; a queued or running one at the next step
        boundary (``schedule`` returns it among the aborted)."""
        if req_id in self.parked:
            self.finish(self.parked[req_id], FinishReason.ABORT)
            return True
        if req_id in self.held:
            self.release_held(req_id)
            return True
        if req_id in self.requests:
            self._pending_aborts.add(req_id)
        return False

    def is_held(self, req_id: str) -> bool:
        return req_id in self.held

    def knows(self, req_id: str) -> bool:
        """In flight here: queued, running, parked or held (a request id may not be reused)."""
        return req_id in self.requests or req_id in self.held

    def release_held(self, req_id: str) -> None:
        """Prefill role: the KV has been exported; give its blocks back."""
        if self.held.pop(req_id, None) is not None:
            self.kv.free(req_id)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> tuple[SchedulerOutput, list[Request]]:
        """Return this step's plan and the requests aborted since the last step."""
        aborted = self._apply_aborts()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out, aborted

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: dict[str, ScheduledRequest] = {}
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_uncomputed_tokens, budget, _before_sampling(request, request.num_computed_tokens))
            if n == 0:
                continue
            if not self._make_room(request, n, scheduled, out):
                continue  # request itself was preempted
            budget -= n
            scheduled[request.req_id] = self._plan(request, n)
        # Reclaimed budget from victims preempted after being planned is returned here.
        out.scheduled.extend(scheduled.values())
        return self.config.max_num_batched_tokens - sum(s.num_new_tokens for s in out.scheduled)

    def _make_room(self, request: Request, n: int, scheduled: dict, out: SchedulerOutput) -> bool:
        total = request.num_computed_tokens + n
        if self.kv.covers(request.req_id, total):
            return True   # most decode steps: the last block still has room
        while not self.kv.can_allocate(request.req_id, total):
            victim = max(self.running, key=Request.sort_key)
            self._preempt(victim)
            scheduled.pop(victim.req_id, None)
            out.preempted_req_ids.append(victim.req_id)
            if victim is request:
                return False
        self.kv.allocate_slots(request.req_id, total)
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        i = 0   # past the requests whose grammar still compiles: they hold no one up
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            # Prompt logprobs need every prompt position computed: nothing read from the cache.
            cached = ([] if prompt_logprobs.owed(request)
                      else self.kv.find_cached(request.req_id, request.all_token_ids))
            start = len(cached) * self.kv.block_size
            n = min(request.num_tokens - start, budget, _before_sampling(request, start))
            if n == 0:
                i += 1
                continue
            room = self._room_to_admit(request, start + n)
            if not self.kv.can_admit(request.req_id, cached, room):
                if request.num_preemptions:
                    i += 1    # it waits for room for all it recomputes; smaller ones behind it go on
                    continue
                break  # FCFS/priority: don't let a later request jump a blocked one
            self.waiting.pop(i)
            request.num_computed_tokens = self.kv.admit(request.req_id, request.all_token_ids, cached, room)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_s is None:
                request.first_scheduled_s = time.perf_counter()
                request.num_cached_tokens = request.num_computed_tokens
            self.running.append(request)
            out.scheduled.append(self._plan(request, n))
            budget -= n

    def _room_to_admit(self, request: Request, first_chunk_end: int) -> int:
        """Tokens of room a waiting request is admitted with: its first chunk; a preempted one,
        everything it recomputes (its prompt and its output so far). Admitted with its first
        chunk alone, a preempted request was the newest running one again and so the next
        victim as its next chunk needed blocks: recomputed, freed, re-admitted at the head of
        the line, forever, while every request queued behind it waited (a probe: 5 long
        requests outgrowing a 1200-block pool, 1345 preemptions, 3.4 M tokens recomputed, 3
        short requests stalled ~8600 steps). Capped at the pool: a request larger than the
        whole pool is admitted chunk by chunk, as before."""
        if not request.num_preemptions:
            return first_chunk_end
        return max(first_chunk_end, min(request.num_tokens, self.kv.num_total_blocks * self.kv.block_size))

    def _plan(self, request: Request, n: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        plan = ScheduledRequest(request, n, sample=start + n == request.num_tokens,
                                block_ids=self.kv.block_tables[request.req_id])
        if request.prompt_logprobs is not None:
            plan.prompt_positions = prompt_logprobs.positions(request, start, n)
        return plan

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s (recompute)", request.req_id)
        self.running.remove(request)
        self.kv.free(request.req_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.waiting.sort(key=Request.sort_key)

    # ---- after the forward ------------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, tuple]
    ) -> list[Request]:
        """Advance every scheduled request; return those that finished this step. ``sampled``:
        req id -> (token id, logprob or None[, top logprobs or None])."""
        finished = []
        for s in out.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed(request.req_id, request.all_token_ids, request.num_computed_tokens)
            if s.sample:
                token_id, logprob, *top = sampled[request.req_id]
                if self._append_token(request, token_id, logprob, top[0] if top else None):
                    finished.append(request)
        return finished

    def _append_token(self, request: Request, token_id: int, logprob: float | None,
                      top: TopLogprobs | None = None) -> bool:
        request.append_output(token_id, logprob, top)
        reason = self.stop.check(request)
        if reason is None and self.config.role is EngineRole.PREFILL:
            self._hold(request)
            return True
        if reason is not None:
            self.finish(request, reason)
            return True
        return False

    def _hold(self, request: Request) -> None:
        """Prefill role: first token sampled; keep the blocks until the KV is exported."""
        request.status = RequestStatus.FINISHED
        self.running.remove(request)
        del self.requests[request.req_id]
        self.held[request.req_id] = request

    def finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.parked.pop(request.req_id, None)
        self.requests.pop(request.req_id, None)
        self.kv.free(request.req_id)

    def _apply_aborts(self) -> list[Request]:
        aborted = []
        for req_id in self._pending_aborts:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                self.finish(request, FinishReason.ABORT)
                aborted.append(request)
        self._pending_aborts.clear()
        return aborted

    # ---- introspection ------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.parked)

    @property
    def num_waiting_tokens(self) -> int:
        return sum(r.num_uncomputed_tokens for r in self.waiting)


_UNCAPPED = 1 << 62


def _before_sampling(request: Request, start: int) -> int:
    """How many of its tokens from ``start`` a request may compute now: all of them, but for a
    guided request whose grammar still compiles, all but its last (whose logits are sampled:
    they wait for the matcher, the prompt's KV need not)."""
    if request.grammar is None or request.grammar.ready:
        return _UNCAPPED
    return max(0, request.num_tokens - 1 - start)
