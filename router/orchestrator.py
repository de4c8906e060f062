"""Runs one request through the cluster and yields its token deltas.

Life cycle of one attempt (disaggregated):
  admission picks the (prefill, decode) pair (or refuses / queues) -> register for the decode
  worker's stream -> one streaming ``prefill`` call (the only actor call on the first token's
  path; a first attempt on a worker of the router's node is also sent straight to it just
  before, on a unix socket, and starts there on whichever comes first: the Ray call joins it
  and stays the one that reports the result or the worker's death): the prefill worker asks
  the decode worker to ``reserve`` blocks while it prefills -> it streams the first token as
  soon as the reservation holds (a worker on the router's node writes it to the
  ``FirstTokenInbox``, a unix socket, instead: its stream then carries only the result, which
  holds the token too): yielded to the client at once
  -> meanwhile it moves the KV and the decode worker ``commit``s -> the call's result (the
  hand-off's outcome) -> the rest arrive through the decode worker's batched stream -> finish.
Colocated mode, conditional disaggregation choosing it, or no prefill worker up: the decode
worker runs the whole request. The prefill worker's ``HandoffOutcome`` decides what follows: a
failed transfer is recomputed on the decode worker (never decoded from garbage; after the
first token when that went ahead: ``migration.resumed``), a reservation refused for room
raises ``ReservationRefused``: the request waits for room and tries again under a fresh id
(any other reserve failure fails the request), a dead decode
worker moves the request (the first token sent counts as sent). On cancel, deadline
or error the request is aborted on the prefill worker first (its ``abort`` returns once it can
no longer write into the reserved blocks) and then on the decode worker, which frees the
reservation at once only when the writer is known to be gone (fenced until its lease ends
otherwise), so every block on both sides is freed and none is freed under a live writer.
A worker lost mid-attempt (``WorkerLost``: from a call, the decode stream, or the prefill
worker's report that its decode peer died) is reported to the supervisor, and the request
migrates (``router.migration``): a new attempt, on whatever pair admission finds (a
replacement included), resumes from the tokens already streamed. The move counts against the
migration limit unless the attempt found that worker already lost (``_found_lost``: it streamed
nothing, and the actor answered nobody after the attempt began).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from engine import tracing
from engine.errors import CapacityError, WorkerFailedError
from engine.types import (FirstToken, HandoffOutcome, PrefillResult, PrefillSubmission, PromptLogprobs, RequestSpec,
                          TokenDelta, WorkerStats)
from engine.unix_push import UnixPusher
from router.admission import RESUME_WAIT_S, Admission
from router.convert import RequestTimings
from router.first_token_inbox import FirstTokenInbox, first_ahead
from router.loss_log import LossLog
from router.migration import DEFAULT_MIGRATION_LIMIT, RequestMigration, resumed
from router.pair_search import Prediction
from router.registry import DecodeProgress, WorkerHandle, WorkerRegistry
from router.stream_drain import StreamDrains
from router.streams import DecodeStreams
from router.worker_calls import WorkerLost, call, stream_call

logger = logging.getLogger(__name__)

MIN_TOKENS_FOR_TPOT = 8   # a shorter output's TPOT says little about the prediction
RESERVE_RETRY_S = 0.5     # a request whose reservation was refused for room retries at least this often
REFUSED_WAIT_S = 30.0     # ... for this long, when it has no TTFT target (admission's own backstop)


@dataclass(slots=True)
class FirstTokenPath:
    """Where the first token's time goes outside the engine, when a prefill worker sent it ahead
    of the hand-off (``Timings``' admission_s ... first_token_return_s; the benchmark's
    breakdown). Router-only spans on ``perf_counter``; the two that meet the prefill worker's
    stamps (``FirstToken.received_s``, ``sent_s``) on the wall clock."""

    admitted_s: float | None = None    # perf_counter: the pair was chosen
    dispatched_s: float | None = None  # perf_counter: the prefill call is made
    dispatched_wall_s: float = 0.0
    back_wall_s: float = 0.0           # the first token reached the router
    first: FirstToken | None = None

    def admitted(self, now_s: float) -> None:
        if self.first is None:   # the attempt that sends the first token is the one described
            self.admitted_s = now_s

    def dispatched(self, now_s: float, wall_s: float) -> None:
        if self.first is None:
            self.dispatched_s, self.dispatched_wall_s = now_s, wall_s

    def timings(self, start_s: float) -> dict[str, float]:
        first = self.first
        if first is None or self.admitted_s is None or self.dispatched_s is None:
            return {}
        return {"admission_s": self.admitted_s - start_s, "dispatch_s": self.dispatched_s - self.admitted_s,
                "to_prefill_worker_s": first.received_s - self.dispatched_wall_s,
                "prefill_worker_overhead_s": first.sent_s - first.received_s - first.queue_s - first.prefill_s,
                "first_token_return_s": self.back_wall_s - first.sent_s, "reservation_wait_s": first.reserve_wait_s}


@dataclass(slots=True)
class RequestTrace:
    """Per-request stamps (router clock) that become the client's timings and the metrics."""

    start_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    prefill: PrefillResult | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    transport: str = ""
    handoff: HandoffOutcome | None = None   # None: colocated (no hand-off to make)
    recomputed: bool = False                # the KV did not land: recomputed on the decode worker
    migrations: int = 0
    local_cached_tokens: int = 0            # prefilled on the decode worker: prompt tokens it found cached
    path: FirstTokenPath = field(default_factory=FirstTokenPath)

    def on_tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now
        self.token_times.extend([now] * n)
        self.last_token_s = now

    def timings(self) -> RequestTimings:
        end = self.last_token_s or time.perf_counter()
        ttft = (self.first_token_s or end) - self.start_s
        n = len(self.token_times)
        tpot = (end - self.first_token_s) / (n - 1) if n > 1 and self.first_token_s else 0.0
        p = self.prefill
        return RequestTimings(
            queue_s=p.queue_s if p else 0.0,
            prefill_s=p.prefill_s if p else 0.0,
            kv_transfer_s=p.transfer_s if p else 0.0,
            decode_s=end - (self.first_token_s or end),
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=end - self.start_s,
            kv_transfer_bytes=p.transfer_bytes if p else 0,
            prefill_worker_id=self.prefill_worker,
            decode_worker_id=self.decode_worker,
            kv_handoff=self.handoff.value if self.handoff else "",
            recomputed_on_decode=self.recomputed,
            migrations=self.migrations,
            prefill_cached_tokens=p.cached_tokens if p and not self.recomputed else self.local_cached_tokens,
            decode_cached_tokens=p.decode_cached_tokens if p else 0,
            kv_transfer_saved_bytes=p.saved_bytes if p else 0,
            **self.path.timings(self.start_s),
        )


class ReservationRefused(CapacityError):
    """The decode worker had no room for the prompt's blocks when the KV was ready."""


def _waited_for_room(spec: RequestSpec, migrating: bool, refused: ReservationRefused) -> CapacityError:
    """A request whose reservations were refused until its deadline: how long it waited, why."""
    if migrating:
        waited = f"its migration waited {RESUME_WAIT_S:g} s"
    elif spec.slo.ttft_s:
        waited = "it waited past its TTFT deadline"
    else:
        waited = f"it waited {REFUSED_WAIT_S:g} s, the limit for a request without a TTFT target"
    return CapacityError(f"no decode worker had room for the prompt's KV blocks: {waited} (the last refusal: {refused})",
                         "queue_deadline")


@dataclass(slots=True)
class _Attempt:
    """One attempt's workers, pinned to the actor generations it started on."""

    spec: RequestSpec
    decode: WorkerHandle
    decode_gen: int
    prefill: WorkerHandle | None          # None once its part is done (nothing to abort there)
    prefill_gen: int = 0
    fresh: bool = True                    # the request's first attempt (its id is new to the workers)


class Orchestrator:
    def __init__(self, registry: WorkerRegistry, streams: DecodeStreams, admission: Admission,
                 metrics: Any | None = None, on_lost: Callable[[WorkerLost], None] | None = None,
                 migration_limit: int = DEFAULT_MIGRATION_LIMIT, inbox: FirstTokenInbox | None = None,
                 node_id: str | None = None, submitter: UnixPusher | None = None,
                 on_stats: Callable[[WorkerHandle], None] | None = None) -> None:
        """``inbox``: first tokens written straight from the prefill workers on ``node_id``
        (this router's node), instead of on their Ray stream; ``submitter``: prefill calls
        written straight to those workers, ahead of the same call on Ray (with an inbox only)."""
        self.registry = registry
        self.streams = streams
        self.admission = admission
        self.metrics = metrics
        self.on_lost = on_lost
        self.migration_limit = migration_limit
        self.inbox, self.node_id, self.submitter = inbox, node_id, submitter
        self.on_stats = on_stats   # a worker's fresh stats go on to admission and metrics (the launcher's rule)
        self._cleanups: set[asyncio.Task] = set()
        self.drains = StreamDrains()   # prefill calls whose reader was cancelled, read to their end
        self.losses = LossLog()        # one line per worker loss for the requests it moved

    async def generate(self, spec: RequestSpec, trace: RequestTrace) -> AsyncIterator[TokenDelta]:
        run = RequestMigration(spec, self.migration_limit)
        resume_deadline = None
        room_deadline = time.monotonic() + (spec.slo.ttft_s or REFUSED_WAIT_S)   # see ReservationRefused below
        while True:
            attempt_spec = run.attempt_spec()
            # a retry after a refused reservation keeps the place in the room line its arrival gives it
            pair = await self._admit(attempt_spec, run.num_moves, trace.start_s if run.num_refusals else None)
            trace.path.admitted(time.perf_counter())
            if not run.num_moves:
                # Workers run requests in the order admission let them in (its predictions count
                # the queue it saw): a request that arrived earlier but was let in later does not
                # jump ahead there (found by a probe: best-effort long prompts admitted as room
                # freed went before short ones admitted with a TTFT target, which missed it 3-5x).
                # A migrating request keeps its arrival: it goes first, its client mid-stream.
                attempt_spec = dataclasses.replace(attempt_spec, arrival_s=time.monotonic())
            began_s, streamed = time.monotonic(), False
            try:
                # A resumed or retried attempt's latency is the loss's or the wait's, not admission's
                # prediction's to learn from.
                learn = run.num_moves == 0 and run.num_refusals == 0
                async for delta in self._attempt(attempt_spec, pair, trace, learn):
                    streamed = True
                    yield run.sent(delta)
                return
            except WorkerLost as lost:
                self._report_lost(lost)
                self._migrate(run, lost, trace, _found_lost(lost, began_s, streamed))
                resume_deadline = time.monotonic() + RESUME_WAIT_S
            except ReservationRefused as refused:
                # The decode side was full after all: admission saw its last report, which the
                # reservations in flight outrun in a burst. As when admission sees it full, the
                # request waits for room and tries again (a fresh one until its TTFT target, a
                # migrating one until its resume deadline); then RESOURCE_EXHAUSTED, in
                # admission's words (not the worker's block count alone).
                deadline = room_deadline if resume_deadline is None else resume_deadline
                if time.monotonic() > deadline:
                    raise _waited_for_room(spec, resume_deadline is not None, refused) from refused
                run.refused()
                await self.admission.capacity_changed(RESERVE_RETRY_S, spec.priority)

    async def _admit(self, spec: RequestSpec, num_moves: int, line_since: float | None = None) -> Prediction:
        """Admission (queueing included), as the request trace's ``admission`` span."""
        parent = tracing.context_of(spec.traceparent)
        if parent is None:   # untraced: no span at all
            return await self.admission.acquire(spec, self.metrics, num_moves > 0, line_since)
        with tracing.tracer().start_as_current_span("admission", context=parent,
                                                    attributes={"pdserve.migrations": num_moves}) as span:
            pair = await self.admission.acquire(spec, self.metrics, num_moves > 0, line_since)
            span.set_attributes({"pdserve.prefill_worker": pair.prefill.worker_id if pair.prefill else "",
                                 "pdserve.decode_worker": pair.decode.worker_id,
                                 "pdserve.predicted_ttft_s": float(pair.ttft_s or 0.0)})
            return pair

    def _migrate(self, run: RequestMigration, lost: WorkerLost, trace: RequestTrace, found_lost: bool) -> None:
        """Move ``run`` off the worker ``lost`` names (WorkerFailedError past the limit)."""
        worker_id, req_id = lost.worker.worker_id, run.spec.req_id
        try:
            counted = run.migrate(lost.cause, worker_id if found_lost else None)
        except WorkerFailedError:
            self.losses.failed(worker_id, lost.generation, req_id)
            raise
        trace.migrations = run.num_moves
        if self.metrics is not None:
            self.metrics.migration()
        # One line per loss, not per request (router.loss_log); this one for a request's story.
        self.losses.moved(worker_id, lost.generation, req_id, len(run.sent_token_ids))
        logger.debug("%s: %s; migrating (attempt %d%s) with %d token(s) already sent", req_id, lost.cause,
                     run.num_moves + 1, "" if counted else ", not counted: that worker was lost before this attempt "
                     "used it", len(run.sent_token_ids))

    def _report_lost(self, lost: WorkerLost) -> None:
        if self.on_lost is not None:
            self.on_lost(lost)

    async def _attempt(self, spec: RequestSpec, pair: Prediction, trace: RequestTrace,
                       learn: bool = True) -> AsyncIterator[TokenDelta]:
        """One attempt on ``pair``; ``learn``: its TTFT and TPOT feed admission's corrections."""
        prefill, decode = pair.prefill, pair.decode
        at = _Attempt(spec, decode, decode.generation, prefill, prefill.generation if prefill else 0, fresh=learn)
        trace.decode_worker = decode.worker_id
        trace.prefill_worker = prefill.worker_id if prefill else ""
        queue = self.streams.register(spec.req_id, decode)
        num_prompt = pair.tokens_to_prefill   # the prefix expected cached there costs nothing
        prefiller, prefiller_gen = (prefill, at.prefill_gen) if prefill else (decode, at.decode_gen)
        prefiller.begin_prefill(num_prompt)   # carried until its first token
        for worker in {prefiller, decode}:    # their caches will hold this prompt's prefix
            worker.placed_prompt(spec.prompt_token_ids)
        prefill_pending = True
        progress = DecodeProgress(spec.sampling.max_tokens, spec.slo.tpot_s, prefill_mark=decode.prefill_tokens_sent)
        decode.track(spec.req_id, progress)
        # Its reservation counts against the decode worker's room until the request decodes there
        # (admission must not send a prefill whose reservation that worker will refuse).
        promised = decode.promise(len(spec.prompt_token_ids)) if prefill is not None else 0
        finished = False
        try:
            async with contextlib.aclosing(self._start(at, trace)) as firsts:
                async for first in firsts:
                    prefiller.end_prefill(num_prompt, prefiller_gen)
                    prefill_pending = False
                    if learn:
                        self._observed_ttft(pair, trace)
                    self._decoding(decode, progress, len(first.token_ids))
                    queue.started()   # the client has its first token: the rest follow at the stream interval
                    yield first
                    finished = first.finished
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if promised:   # its worker's report that came with this item shows its blocks
                    decode.keep_promise(promised, at.decode_gen)
                    promised = 0
                    self.admission.notify(decode)   # that report woke the queue while it still counted
                if item.num_cached_tokens:
                    trace.local_cached_tokens = item.num_cached_tokens
                if prefill_pending and item.token_ids:
                    prefiller.end_prefill(num_prompt, prefiller_gen)
                    prefill_pending = False
                    if learn:
                        self._observed_ttft(pair, trace)
                self._decoding(decode, progress, len(item.token_ids))
                finished = item.finished
                yield item
        finally:
            self.streams.unregister(spec.req_id)
            decode.keep_promise(promised, at.decode_gen)
            if decode.generation == at.decode_gen:
                decode.untrack(spec.req_id)
            if prefill_pending:
                prefiller.end_prefill(num_prompt, prefiller_gen)
            if not finished:
                self._abort_later(at)
            elif learn and len(trace.token_times) >= MIN_TOKENS_FOR_TPOT:
                self._observed_tpot(pair, progress, trace.timings().tpot_s)
            # Past its first token the request held room on its decode worker alone; before it, its
            # prefill worker's queue changed too (and a replaced worker is another one).
            self._capacity_changed(decode if not prefill_pending and decode.generation == at.decode_gen else None)

    def _decoding(self, decode: WorkerHandle, progress: DecodeProgress, num_tokens: int) -> None:
        first = progress.first_token_s is None and num_tokens > 0
        progress.on_tokens(num_tokens)
        if first:
            self.admission.expect_tpot(decode, progress)

    def _observed_tpot(self, pair: Prediction, progress: DecodeProgress, observed_s: float) -> None:
        self.admission.observe_tpot(progress, observed_s)
        if self.metrics is not None:
            self.metrics.prediction("tpot", pair.tpot_s, observed_s)

    def _observed_ttft(self, pair: Prediction, trace: RequestTrace) -> None:
        observed = time.perf_counter() - trace.start_s
        self.admission.observe_ttft(pair, observed, _engine_s(trace))
        if self.metrics is not None:
            self.metrics.prediction("ttft", pair.ttft_s, observed)

    async def _start(self, at: _Attempt, trace: RequestTrace) -> AsyncIterator[TokenDelta]:
        """Get the request running on its decode worker; yield the first token if it comes
        from here (the prefill worker), as soon as it does: the hand-off goes on meanwhile."""
        spec, prefill, decode = at.spec, at.prefill, at.decode
        if prefill is None:
            await call(decode, "add_request", spec, generation=at.decode_gen)
            trace.handoff = HandoffOutcome.LOCAL if self.registry.prefill else None
            self._count_handoff(trace.handoff)
            return
        transport = trace.transport = self.registry.transport(prefill, decode)
        # The prefill worker reserves on the decode worker itself, while it prefills.
        sent: tuple[int, ...] = ()
        inbox = self.inbox if self.inbox is not None and prefill.node_id == self.node_id else None
        early = inbox.expect(spec.req_id) if inbox is not None else None   # the first token, sooner
        trace.path.dispatched(time.perf_counter(), time.time())
        if early is not None:
            self._submit_directly(at, prefill, transport)
        call_items = stream_call(prefill, "prefill", spec, transport, decode.actor, inbox.path if inbox else None,
                                 generation=at.prefill_gen, drains=self.drains)
        try:
            async with contextlib.aclosing(call_items) as items, \
                    contextlib.aclosing(first_ahead(items, early)) as items_first_ahead:
                async for item in items_first_ahead:
                    if isinstance(item, FirstToken):   # the client has it while the KV moves
                        trace.path.back_wall_s, trace.path.first = time.time(), item
                        prefill.heard(at.prefill_gen)   # one from the inbox came outside any call
                        sent = (item.token_id,)
                        yield _first_delta(spec.req_id, sent, item.logprob, item.top_logprobs,
                                           prompt_logprobs=item.prompt_logprobs)
                    else:
                        result: PrefillResult = item
        finally:
            if inbox is not None:
                inbox.forget(spec.req_id)
        at.prefill = None   # its part is done: nothing left there to abort or to wait for
        first = await self._handed_off(at, prefill, trace, result, sent)
        if first is not None:
            yield first

    def _submit_directly(self, at: _Attempt, prefill: WorkerHandle, transport: str) -> None:
        """The prefill call, on the worker's socket too: its compute starts without waiting for
        Ray's submission. A first attempt only: a later one's id may still be on that worker,
        where an abort of the attempt before could overtake it."""
        if self.submitter is not None and prefill.submit_path and at.fresh:
            decode_id = at.decode.actor._actor_id.hex()
            self.submitter.push(prefill.submit_path, PrefillSubmission(at.spec, transport, decode_id,
                                                                       self.inbox.path).to_json())

    async def _handed_off(self, at: _Attempt, prefill: WorkerHandle, trace: RequestTrace, result: PrefillResult,
                          sent: tuple[int, ...]) -> TokenDelta | None:
        """Act on the hand-off's outcome; return the first token unless it went ahead (``sent``)
        or the decode worker recomputes the request."""
        spec, decode = at.spec, at.decode
        trace.prefill, trace.handoff = result, result.outcome
        self._observe_prefill(prefill, result, at.prefill_gen)
        self._count_handoff(result.outcome)
        if result.outcome in (HandoffOutcome.OK, HandoffOutcome.TRANSFER_FAILED) and decode.alive \
                and decode.generation == at.decode_gen:
            self.registry.handoff_done(prefill, decode, result.outcome is HandoffOutcome.OK)
        match result.outcome:
            case HandoffOutcome.PEER_DEAD:
                raise WorkerLost(decode, at.decode_gen, result.error or "the decode worker died during the hand-off")
            case HandoffOutcome.RESERVE_REFUSED:
                raise ReservationRefused(result.error or f"no room on {decode.worker_id}")
            case HandoffOutcome.RESERVE_FAILED:
                raise WorkerFailedError(f"decode worker {decode.worker_id} failed the reservation: {result.error}")
            case HandoffOutcome.TRANSFER_FAILED | HandoffOutcome.GROUP_CHANGED:
                await self._recompute(at, trace, result.error or "", sent)
                return None
            case HandoffOutcome.ENDED_AT_PREFILL | HandoffOutcome.ABORTED:
                await call(decode, "abort", spec.req_id, generation=at.decode_gen)  # the unused reservation
        if sent:
            return None
        return _first_delta(spec.req_id, _first(result), result.first_logprob, result.first_top_logprobs,
                            result.finish_reason, result.error, result.prompt_logprobs, result.error_field)

    def _count_handoff(self, outcome: HandoffOutcome | None) -> None:
        if outcome is not None and self.metrics is not None:
            self.metrics.handoff(outcome.value)

    def _observe_prefill(self, prefill: WorkerHandle, result: PrefillResult, generation: int) -> None:
        prefill.observe_kv_events(result.kv_events, generation)
        self._observe_stats(prefill, result.stats, generation)

    def _observe_stats(self, worker: WorkerHandle, stats: WorkerStats | None, generation: int) -> None:
        if stats is not None and generation == worker.generation:   # never a replaced actor's
            worker.observe_stats(stats)
            if self.on_stats is not None:
                self.on_stats(worker)

    def _capacity_changed(self, worker: WorkerHandle | None) -> None:
        """A request left its workers (finished, failed or aborted): the router's own counts of
        them changed at once (their stats, e.g. freed blocks, only with their next report, and an
        idle worker sends none). ``worker``: the one worker whose room changed (the request's
        decode worker, once its prefill was over): queued requests are checked against it alone,
        as on its report (a request queues for decode room), and only those it could take decide
        again; None: any may have changed, every woken request decides again."""
        self.admission.notify(worker)

    async def _recompute(self, at: _Attempt, trace: RequestTrace, error: str, sent: tuple[int, ...]) -> None:
        """Run the request on its decode worker from its prompt, after the tokens already ``sent``."""
        logger.warning("%s: %s; recomputing on %s", at.spec.req_id, error, at.decode.worker_id)
        await call(at.decode, "abort", at.spec.req_id, generation=at.decode_gen)  # the writer is done with it
        trace.recomputed = True
        await call(at.decode, "add_request", resumed(at.spec, sent), generation=at.decode_gen)

    def _abort_later(self, at: _Attempt) -> None:
        """Runs outside the (possibly cancelled) handler so the aborts always complete."""
        task = asyncio.get_running_loop().create_task(self._abort(at))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abort(self, at: _Attempt) -> None:
        """Prefill side first: once its abort returns, nothing can still write the decode
        worker's reserved blocks, which may then be freed at once; if that cannot be known (the
        prefill worker is unreachable), the decode worker fences them until their lease ends."""
        writer_gone = True
        if at.prefill is not None:
            writer_gone = await self._abort_on(at.prefill, at.prefill_gen, at.spec.req_id)
        await self._abort_on(at.decode, at.decode_gen, at.spec.req_id, writer_gone)

    async def _abort_on(self, worker: WorkerHandle, generation: int, req_id: str, *args: Any) -> bool:
        """True once nothing of the request can run there any more (aborted, or the actor is gone)."""
        if worker.generation != generation or not worker.alive:
            return True   # that actor died (the supervisor kills what is left of it)
        try:
            answer = await call(worker, "abort", req_id, *args, generation=generation)
            # A prefill worker answers with its stats: the aborted request's result, which would
            # have carried them, never comes (its call was closed).
            if isinstance(answer, WorkerStats):
                self._observe_stats(worker, answer, generation)
            return True
        except WorkerLost as lost:
            self._report_lost(lost)
            return True
        except Exception as exc:
            logger.warning("abort of %s on %s failed: %s", req_id, worker.worker_id, exc)
            return False

    @property
    def num_cleanups(self) -> int:
        """Request cleanups (aborts, releases) still running."""
        return len(self._cleanups)

    async def drain_cleanups(self) -> None:
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)


def _found_lost(lost: WorkerLost, began_s: float, streamed: bool) -> bool:
    """The attempt found its worker already lost: it streamed nothing (any token shows both its
    workers alive after it began: a decode worker had reserved, or ran it) and that actor answered
    nobody after the attempt began (no reply, stream batch or heartbeat). Killed together with
    the worker the request moved off, it was dead before this attempt was placed; one killed under
    a live stream, or that went on answering others after the attempt reached it, was not."""
    return not streamed and not lost.worker.heard_since(lost.generation, began_s)


def _engine_s(trace: RequestTrace) -> float | None:
    """The prefill worker's own queue + compute time for the prompt (None: the decode worker
    prefilled it, and reports no such split)."""
    report = trace.path.first or trace.prefill
    return None if report is None else report.queue_s + report.prefill_s


def _first(result: PrefillResult) -> tuple[int, ...]:
    return (result.first_token_id,) if result.first_token_id is not None else ()


def _first_delta(req_id: str, token_ids: tuple[int, ...], logprob: float | None, top_logprobs,
                 finish_reason=None, error: str | None = None,
                 prompt_logprobs: PromptLogprobs | None = None, error_field: str | None = None) -> TokenDelta:
    """The prefill worker's first token as a delta, whether it went ahead or came with the result."""
    return TokenDelta(req_id, token_ids, finish_reason, None if logprob is None else (logprob,), error,
                      top_logprobs=None if top_logprobs is None else (top_logprobs,), prompt_logprobs=prompt_logprobs,
                      error_field=error_field)
