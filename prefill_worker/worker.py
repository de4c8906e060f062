"""The prefill worker: batches prompts in its own engine loop and hands each request's KV to
its decode worker.

Life cycle of one request here:
  prefill(spec, transport, decode) -> queued in the engine (chunked prefill under the token
  budget, many prompts per step) and, at the same time, this worker asks the decode worker to
  ``reserve`` the prompt's blocks (its round trip overlaps the prefill; the router makes no
  call of its own for it) -> first token sampled, blocks *held* -> the reservation holds: the
  first token goes to the router at once: written to the router's first-token inbox when it
  named one (``engine.unix_push``; by the engine loop thread as the step ends when the
  reservation already holds, the usual case), else a ``FirstToken`` on the ``stream`` ahead of
  the result (one channel: never both, the result carries the token anyway) ->
  KV sent through the handle's transport -> decode worker's ``commit`` (it admits the request)
  -> blocks released -> PrefillResult (outcome + timings) back to the router. The first token
  leaves before the KV has landed because that is safe: a hand-off that then fails is
  recomputed (or migrated) with that token in the prompt.
Prefix caching on both sides: the engine starts the prefill after this worker's cached prefix,
and only the blocks the decode worker does not hold already move (the handle names them).
Every result also carries this worker's prefix-cache events not yet reported (blocks stored,
removed), which keep the router's prefix index true.
A request that ends at its first token (EOS, max_tokens=1), is aborted, or fails returns a
PrefillResult with its finish reason and no hand-off, at once; the router frees the unused
reservation (a free that overtakes the reserve makes the decode worker refuse that reserve when
it arrives: nothing stays held). Every result carries a ``HandoffOutcome`` (ok, ended at prefill,
aborted, reserve refused for room, reserve failed, transfer failed, peer dead): the router
acts on that value, never on error text. ``abort`` returns only once this worker will no
longer write into the decode worker's reserved blocks, so the decode side may free them; and no write starts after the reservation's lease has run out
(the decode side may have freed the blocks by then: a late writer is refused, never corrupts
another request's KV).
``prefill`` and ``stream`` are idempotent per request id: a call retried by the router after
a transient failure joins the one already running (``stream`` replays the first token).
A router on this node also sends the call straight here first (``submissions``: a unix socket,
~0.4 ms where Ray's call takes ~2-7 ms): the request starts on it, and the Ray call joins it
(even after it ended: a run started that way stays until its Ray call has come). So Ray's call
still delivers the result and a dead worker's error, as without it. An abort for a request not
here yet leaves a tombstone that refuses its direct submission (it may still be in the socket).
The decode worker is reached through a ``DecodePeer`` (the actor module wraps the Ray handle)
whose calls raise ``PeerLostError`` when that worker died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine import tracing
from engine.config import EngineRole
from engine.ended_requests import EndedRequests
from engine.engine import PrefillDone, StepResult
from engine.errors import CapacityError, KVTransferError, PeerLostError
from engine.faults import SEND_FAULTS, FaultKind
from engine.types import (FinishReason, FirstToken, HandoffOutcome, PrefillResult, PrefillSubmission, RequestSpec,
                          TokenDelta, WorkerStats)
from engine.unix_push import UnixPusher
from engine.worker_base import WorkerBase, WorkerSpec
from kvtransfer.handle import KVBlocksHandle, KVGroupChangedError
from kvtransfer.select import make_sender
from prefill_worker.submissions import SubmissionServer

logger = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0
# A write must start this long before the reservation's lease ends: the whole transfer, and a
# margin for clocks (the lease is wall-clock time) and scheduling, fit before the decode worker
# may free the blocks.
LEASE_MARGIN_S = TRANSFER_TIMEOUT_S + 5.0
# A request started by the router's direct submission (``submissions``) waits this long at most
# for its Ray call to join it once it is done (its router then gave up without one); an abort
# for a request not here refuses a direct submission of it for this long (it may still be in
# the socket: the abort went by Ray, after it).
UNJOINED_S = 60.0


@dataclass(slots=True)
class _Running:
    """One request's prefill here: its early first token (None once it is known there is none:
    the request ended at prefill, failed or was aborted before its hand-off) and its result."""

    first: asyncio.Future
    result: asyncio.Task | None = None
    received_s: float = field(default_factory=time.time)   # wall clock: the router's path breakdown
    inbox: str | None = None   # the router's first-token inbox (same node), if it named one
    joined: bool = True   # a Ray call has it (False: started by a direct submission, Ray's call not here yet)
    # Set on the event loop once the decode reservation holds; read by the engine loop thread,
    # which then pushes the first token to the inbox itself as its step ends (``pushed``).
    reserved: bool = False
    pushed: bool | None = None   # None: not tried (each request tries the inbox once)


class PrefillWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec, standby: bool = False) -> None:
        super().__init__(spec, EngineRole.PREFILL, standby)
        self._waiters: dict[str, asyncio.Future] = {}
        self._done: dict[str, asyncio.Event] = {}
        self._running: dict[str, _Running] = {}
        self._aborted: set[str] = set()
        self._senders: dict[str, Any] = {}
        # Rendezvous transports (torch_dist) pair FIFO per peer: a stuck peer stalls only its own.
        self._transfer_locks: dict[str, asyncio.Lock] = {}
        self._next_send_fault: FaultKind | None = None   # fault injection (tests): see engine/faults.py
        self._pusher = UnixPusher()
        self.submissions = SubmissionServer(self._on_submission)
        self._peers: dict[str, Any] = {}   # decode peers by id, from Ray calls: direct submissions name them
        self._tombstones = EndedRequests(UNJOINED_S)   # aborted before they were here: no direct submission starts them

    async def prefill(self, spec: RequestSpec, transport: str | None, decode: Any) -> PrefillResult:
        """Prefill ``spec``; with a ``transport``, reserve its blocks on ``decode`` (a
        ``DecodePeer``) while the prompt is prefilled and move its KV there. Without one, no
        hand-off (tests of the prefill path alone). A second call for a request already here
        (a retry) waits for the first one's result."""
        return await asyncio.shield(self._start(spec, transport, decode).result)

    async def stream(self, spec: RequestSpec, transport: str | None, decode: Any,
                     inbox: str | None = None) -> AsyncIterator[FirstToken | PrefillResult]:
        """``prefill``, with the first token yielded as soon as it may go to the client (the
        reservation holds, the KV starts moving), then the result. ``inbox``: the router's
        first-token inbox, which gets the first token instead, sooner (when the push went
        out, the stream yields only the result, which carries the token too)."""
        run = self._start(spec, transport, decode, inbox)
        first = await asyncio.shield(run.first)
        if first is not None:
            yield first
        yield await asyncio.shield(run.result)

    def _start(self, spec: RequestSpec, transport: str | None, decode: Any, inbox: str | None = None,
               joined: bool = True) -> _Running:
        """The request's run, started here unless it runs already (a retried call, or the Ray
        call after the direct submission: ``joined``)."""
        run = self._running.get(spec.req_id)
        if run is None:
            run = self._running[spec.req_id] = _Running(self.aio.create_future(), inbox=inbox, joined=joined)
            self._done[spec.req_id] = asyncio.Event()   # now: an abort from here on waits for it
            run.result = asyncio.ensure_future(self._prefill(spec, transport, decode))
            run.result.add_done_callback(lambda _: self._retire(spec.req_id, run))
        elif joined and not run.joined:
            run.joined = True
            if run.result.done():
                self._retire(spec.req_id, run)
        return run

    def _retire(self, req_id: str, run: _Running) -> None:
        """A finished run leaves once a Ray call has it (so a Ray call that comes after a direct
        submission's run ended joins it, never starts it again); an unjoined one after a while."""
        if run.joined:
            self._forget(req_id, run)
        else:
            self.aio.call_later(UNJOINED_S, self._forget, req_id, run)

    def _forget(self, req_id: str, run: _Running) -> None:
        if self._running.get(req_id) is run:
            del self._running[req_id]

    # ---- direct submissions (the router on this node) ---------------------------------------------
    async def open_submissions(self) -> None:
        await self.submissions.start()

    def known_peer(self, peer: Any) -> Any:
        """The decode peer a Ray call named, remembered by id for direct submissions."""
        return self._peers.setdefault(peer.peer_id, peer)

    def _on_submission(self, sub: PrefillSubmission) -> None:
        """Start the request now; its Ray call joins it. Ignored when the decode peer is not known
        yet (that Ray call starts it), when it runs already, or was aborted before it came."""
        peer = self._peers.get(sub.decode_id)
        req_id = sub.spec.req_id
        if peer is None or req_id in self._running or req_id in self._tombstones:
            return
        self._start(sub.spec, sub.transport, peer, sub.inbox, joined=False)

    def info(self, node_id: str) -> dict:
        return {**super().info(node_id), "submit_path": self.submissions.path}

    async def _prefill(self, spec: RequestSpec, transport: str | None, decode: Any) -> PrefillResult:
        parent = tracing.context_of(spec.traceparent)
        if parent is None:   # untraced: no span, no cost
            return await self._run_prefill(spec, transport, decode)
        with tracing.tracer().start_as_current_span("prefill", context=parent, kind=tracing.trace.SpanKind.SERVER,
                                                    attributes={"pdserve.worker": self.worker_id,
                                                                "pdserve.prompt_tokens": len(spec.prompt_token_ids)}):
            return await self._run_prefill(spec, transport, decode)

    async def _run_prefill(self, spec: RequestSpec, transport: str | None, decode: Any) -> PrefillResult:
        req_id = spec.req_id
        waiter = self.aio.create_future()
        self._waiters[req_id] = waiter
        added = self.loop.call(lambda e: e.add_request(spec))   # the compute first: it is the path
        # Resolved while the prompt is prefilled: the KV (and the first token) need not wait for it.
        reservation = _resolving(decode.reserve(spec, transport)) if transport is not None else None
        if reservation is not None:
            reservation.add_done_callback(lambda task: self._reserved(req_id, task))
        try:
            await asyncio.wrap_future(added)
            outcome = await waiter
            if isinstance(outcome, TokenDelta):
                _phase_spans(*(outcome.phase_s or (0.0, 0.0)), len(spec.prompt_token_ids))
                result = _ended_at_prefill(outcome)
            else:
                _phase_spans(outcome.queue_s, outcome.prefill_s, outcome.num_tokens)
                with tracing.current_child("kv_handoff") as span:   # None: untraced
                    result = await self._hand_off(outcome, reservation, decode)
                    if span is not None:
                        span.set_attributes({"pdserve.kv.bytes": result.transfer_bytes, "pdserve.kv.transport":
                                             result.transport, "pdserve.kv.outcome": result.outcome.value})
            self._waiters.pop(req_id, None)   # over here: the report below may find the worker idle
            return dataclasses.replace(result, stats=await self._report(), kv_events=self.take_kv_events())
        finally:
            self._first_token(req_id, None)   # none went ahead: the result carries it
            self._waiters.pop(req_id, None)
            self._aborted.discard(req_id)
            self._done.pop(req_id).set()

    def _first_token_of(self, done: PrefillDone, reserve_wait_s: float) -> FirstToken:
        run = self._running.get(done.req_id)
        return FirstToken(done.req_id, done.first_token_id, done.first_logprob, done.first_top_logprobs,
                          prompt_logprobs=done.prompt_logprobs, received_s=run.received_s if run else 0.0,
                          sent_s=time.time(), queue_s=done.queue_s, prefill_s=done.prefill_s,
                          reserve_wait_s=reserve_wait_s)

    def _reserved(self, req_id: str, reservation: asyncio.Task) -> None:
        run = self._running.get(req_id)
        if run is not None and not reservation.cancelled() and reservation.exception() is None:
            run.reserved = True

    def _first_token(self, req_id: str, first: FirstToken | None) -> None:
        """The first token may go to the client now (``None``: none goes ahead). One channel:
        the Ray stream carries it only if the inbox did not take it (a copy the router would
        drop still costs its loop the item's delivery, as it writes the first token out)."""
        run = self._running.get(req_id)
        if run is None or run.first.done():
            return
        if first is not None and run.inbox is not None:
            if run.pushed is None:
                run.pushed = self._pusher.push(run.inbox, first.to_json())
            if run.pushed:
                first = None
        run.first.set_result(first)

    def _push_from_loop_thread(self, done: PrefillDone) -> None:
        """Engine loop thread, as the prefill step ends: if the reservation already holds (its
        round trip overlapped the compute, the usual case), the first token goes to the inbox
        from here, without waiting for the hop to the event loop. Otherwise ``_hand_off`` sends
        it once the reservation holds, as without an inbox."""
        run = self._running.get(done.req_id)
        if run is not None and run.inbox is not None and run.reserved and done.req_id not in self._aborted:
            run.pushed = self._pusher.push(run.inbox, self._first_token_of(done, 0.0).to_json())

    async def abort(self, req_id: str) -> WorkerStats:
        """Stop the request; returns once no write into its decode blocks can still happen, with
        this worker's stats (its result, which carries them otherwise, never reaches a router
        that aborts: it reports only with results)."""
        done = self._done.get(req_id)
        if done is None:
            if req_id not in self._running:   # a direct submission of it may still be on its way
                self._tombstones.add(req_id)
            return await self._report()
        self._aborted.add(req_id)
        await self.call(lambda e: e.abort(req_id))
        await done.wait()
        run = self._running.get(req_id)
        if run is not None and not run.joined:   # its router gave up before its Ray call
            self._forget(req_id, run)
        return await self._report()

    async def _report(self) -> WorkerStats:
        """The stats a result or an abort carries to the router. With nothing left in flight
        here, once the engine has run the calls queued so far (blocks released after hand-offs;
        at once: the loop is idle): this worker reports only with results and aborts, so its
        last report must show it idle, however long until its next request."""
        if self._waiters:
            return self.stats()
        try:
            return await self.settled_stats()
        except RuntimeError:   # the engine loop stopped (shutdown): its last stats
            return self.stats()

    # ---- loop thread results ------------------------------------------------------------------
    def _on_step_thread(self, result: StepResult) -> None:
        for done in result.prefilled:   # before the hop: ``pushed`` is set when the event loop sees it
            self._push_from_loop_thread(done)
        super()._on_step_thread(result)

    def on_step(self, result: StepResult) -> None:
        """On the event loop."""
        for done in result.prefilled:
            self._resolve(done.req_id, done)
        for delta in result.deltas:
            if delta.finished:
                self._resolve(delta.req_id, delta)

    def _resolve(self, req_id: str, outcome: PrefillDone | TokenDelta) -> None:
        waiter = self._waiters.get(req_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)
        elif isinstance(outcome, PrefillDone):  # nobody waits any more: give the blocks back
            self.loop.call(lambda e: e.release(req_id))

    # ---- the hand-off -------------------------------------------------------------------------
    async def _hand_off(self, done: PrefillDone, reservation: asyncio.Future | None, decode: Any) -> PrefillResult:
        req_id = done.req_id
        start = time.perf_counter()
        try:
            if req_id in self._aborted:
                return _result(done, FinishReason.ABORT, outcome=HandoffOutcome.ABORTED)
            if reservation is None:  # no decode side (tests of the prefill path alone)
                return _result(done, None)
            try:
                handle = await reservation
                reserve_wait_s = time.perf_counter() - start
            except PeerLostError as exc:
                return _result(done, FinishReason.ERROR, error=str(exc), outcome=HandoffOutcome.PEER_DEAD)
            except CapacityError as exc:   # no room there now: the router queues or refuses
                return _result(done, FinishReason.ERROR, error=str(exc), outcome=HandoffOutcome.RESERVE_REFUSED)
            except Exception as exc:
                return _result(done, FinishReason.ERROR, error=str(exc), outcome=HandoffOutcome.RESERVE_FAILED)
            # From here every outcome (ok, transfer failed: recomputed, peer dead: migrated)
            # continues after this token: the client may have it now.
            self._first_token(req_id, self._first_token_of(done, reserve_wait_s))
            num_bytes = await self._send(done, handle, decode)
            result = _result(done, None, time.perf_counter() - start, num_bytes, handle.transport)
            saved = handle.num_cached_tokens // handle.layout.block_size * handle.layout.bytes_per_block
            return dataclasses.replace(result, decode_cached_tokens=handle.num_cached_tokens, saved_bytes=saved)
        except PeerLostError as exc:
            logger.warning("KV hand-off of %s: the decode worker died: %s", req_id, exc)
            return _result(done, FinishReason.ERROR, error=str(exc), outcome=HandoffOutcome.PEER_DEAD)
        except KVGroupChangedError as exc:   # nothing was sent: recomputed, not held against the pair's link
            logger.info("KV hand-off of %s not sent: %s", req_id, exc)
            return _result(done, FinishReason.ERROR, error=f"KV transfer not sent: {exc}",
                           outcome=HandoffOutcome.GROUP_CHANGED)
        except Exception as exc:   # KVTransferError, or anything else a send raised: recompute
            logger.warning("KV hand-off of %s failed: %s", req_id, exc)
            return _result(done, FinishReason.ERROR, error=f"KV transfer failed: {exc}",
                           outcome=HandoffOutcome.TRANSFER_FAILED)
        finally:
            # Not awaited: the blocks go back at the next step boundary, the answer goes now.
            self.loop.call(lambda e: e.release(req_id))

    async def _send(self, done: PrefillDone, handle: KVBlocksHandle, decode: Any) -> int:
        fault, self._next_send_fault = self._next_send_fault, None
        if fault is FaultKind.KV_SEND:
            raise KVTransferError("injected KV send failure")
        if fault is FaultKind.HANG_KV_SEND:
            await asyncio.Event().wait()   # only the process's death ends this hand-off
        sender = self._sender(handle.transport)
        bound = sender.bind(handle, handle.source_blocks(done.block_ids))
        if sender.rendezvous:  # the receiver must be inside receive() while we send
            async with self._transfer_locks.setdefault(decode.peer_id, asyncio.Lock()):  # FIFO per pair
                _check_lease(handle)   # after the wait for the lock: the write starts now
                # Read even when the send fails (the receive then fails for the same reason, and the
                # send's error is the one told): asyncio must not log it as never retrieved.
                commit = _resolving(decode.commit(done.req_id, done.first_token_id, bound))
                sent = await asyncio.to_thread(sender.send, self.engine.cache, bound, timeout_s=TRANSFER_TIMEOUT_S)
            await commit
        else:
            _check_lease(handle)
            sent = await asyncio.to_thread(sender.send, self.engine.cache, bound, timeout_s=TRANSFER_TIMEOUT_S)
            await decode.commit(done.req_id, done.first_token_id, sent.handle)
        return sent.num_bytes

    def _sender(self, transport: str):
        if transport not in self._senders:
            self._senders[transport] = make_sender(transport)
        return self._senders[transport]

    async def inject_fault(self, kind: str) -> None:
        if FaultKind(kind) in SEND_FAULTS and self.spec.allow_fault_injection:
            self._next_send_fault = FaultKind(kind)
            return
        await super().inject_fault(kind)

    def shutdown(self) -> None:
        super().shutdown()
        self._pusher.close()
        self.submissions.close()
        for sender in self._senders.values():
            sender.close()


def _phase_spans(queue_s: float, prefill_s: float, num_tokens: int) -> None:
    """The engine's queue and compute times of a finished prefill as spans under the current one
    (their ends are known now; the engine loop thread is not traced)."""
    span = tracing.trace.get_current_span()
    if not span.is_recording():
        return
    now = time.time_ns()
    compute_start = now - int(prefill_s * 1e9)
    queue_start = compute_start - int(queue_s * 1e9)
    for name, start, end in (("prefill.queue", queue_start, compute_start), ("prefill.compute", compute_start, now)):
        tracing.tracer().start_span(name, start_time=start, attributes={"pdserve.tokens": num_tokens}).end(end)


def _resolving(awaitable) -> asyncio.Task:
    """A task for ``awaitable`` whose error is read by whoever awaits it, or by nobody (a
    request that ends at prefill never needs its reservation; asyncio must not log that)."""
    task = asyncio.ensure_future(awaitable)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _check_lease(handle: KVBlocksHandle) -> None:
    if handle.lease_deadline_s and time.time() > handle.lease_deadline_s - LEASE_MARGIN_S:
        raise KVTransferError("the decode reservation's lease ends before a transfer could finish")


def _ended_at_prefill(delta: TokenDelta) -> PrefillResult:
    first = delta.token_ids[0] if delta.token_ids else None
    logprob = delta.logprobs[0] if delta.logprobs else None
    top = delta.top_logprobs[0] if delta.top_logprobs else None
    outcome = HandoffOutcome.ABORTED if delta.finish_reason is FinishReason.ABORT else HandoffOutcome.ENDED_AT_PREFILL
    queue_s, prefill_s = delta.phase_s or (0.0, 0.0)   # none: it ended before its first token (an abort)
    return PrefillResult(delta.req_id, first, delta.finish_reason, logprob, delta.error, outcome=outcome,
                         first_top_logprobs=top, prompt_logprobs=delta.prompt_logprobs, error_field=delta.error_field,
                         queue_s=queue_s, prefill_s=prefill_s, cached_tokens=delta.num_cached_tokens)


def _result(done: PrefillDone, reason: FinishReason | None, transfer_s: float = 0.0, num_bytes: int = 0,
            transport: str = "", error: str | None = None,
            outcome: HandoffOutcome = HandoffOutcome.OK) -> PrefillResult:
    return PrefillResult(
        req_id=done.req_id,
        first_token_id=done.first_token_id,
        finish_reason=reason,
        first_logprob=done.first_logprob,
        first_top_logprobs=done.first_top_logprobs,
        prompt_logprobs=done.prompt_logprobs,
        error=error,
        queue_s=done.queue_s,
        prefill_s=done.prefill_s,
        transfer_s=transfer_s,
        transfer_bytes=num_bytes,
        transport=transport,
        outcome=outcome,
        cached_tokens=done.num_cached_tokens,
    )
