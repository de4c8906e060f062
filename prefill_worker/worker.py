"""The prefill worker: batches prompts in its own engine loop and hands each request's KV to
its decode worker.

Life cycle of one request here:
  prefill(spec, transport, decode) -> queued in the engine (chunked prefill under the token
  budget, many prompts per step) and, at the same time, this worker asks the decode worker to
  ``reserve`` the prompt's blocks (its round trip overlaps the prefill; the router makes no
  call of its own for it) -> first token sampled, blocks *held* -> the reservation holds: the
  first token goes to the router at once (``stream``: a ``FirstToken`` ahead of the result) ->
  KV sent through the handle's transport -> decode worker's ``commit`` (it admits the request)
  -> blocks released -> PrefillResult (outcome + timings) back to the router. The first token
  leaves before the KV has landed because that is safe: a hand-off that then fails is
  recomputed (or migrated) with that token in the prompt.
Prefix caching on both sides: the engine starts the prefill after this worker's cached prefix,
and only the blocks the decode worker does not hold already move (the handle names them).
Every result also carries this worker's prefix-cache events not yet reported (blocks stored,
removed), which keep the router's prefix index true.
A request that ends at its first token (EOS, max_tokens=1), is aborted, or fails returns a
PrefillResult with its finish reason and no hand-off; the router frees the unused reservation,
which this worker waits for (up to ``RESERVE_SETTLE_S``) before it answers, so that free never
overtakes the reserve. Every result carries a ``HandoffOutcome`` (ok, ended at prefill,
aborted, reserve refused for room, reserve failed, transfer failed, peer dead): the router
acts on that value, never on error text. ``abort`` returns only once this worker will no
longer write into the decode worker's reserved blocks, and its reserve call has settled, so
the decode side may free them; and no write starts after the reservation's lease has run out
(the decode side may have freed the blocks by then: a late writer is refused, never corrupts
another request's KV).
``prefill`` and ``stream`` are idempotent per request id: a call retried by the router after
a transient failure joins the one already running (``stream`` replays the first token).
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
from engine.engine import PrefillDone, StepResult
from engine.errors import CapacityError, KVTransferError, PeerLostError
from engine.types import FinishReason, FirstToken, HandoffOutcome, PrefillResult, RequestSpec, TokenDelta
from engine.worker_base import WorkerBase, WorkerSpec
from kvtransfer.handle import KVBlocksHandle
from kvtransfer.select import make_sender

logger = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0
# A write must start this long before the reservation's lease ends: the whole transfer, and a
# margin for clocks (the lease is wall-clock time) and scheduling, fit before the decode worker
# may free the blocks.
LEASE_MARGIN_S = TRANSFER_TIMEOUT_S + 5.0
# Fault injection (tests) on the next hand-off: "kv_send" fails it (the router recomputes);
# "hang_kv_send" never starts the write (a worker that dies mid-hand-off, once killed).
SEND_FAULTS = ("kv_send", "hang_kv_send")
# A request that ends without a hand-off waits this long at most for its reserve call to settle
# (so the router's free of the unused reservation cannot overtake it); a reservation that lands
# later still is freed when its lease ends.
RESERVE_SETTLE_S = 5.0


@dataclass(slots=True)
class _Running:
    """One request's prefill here: its early first token (None once it is known there is none:
    the request ended at prefill, failed or was aborted before its hand-off) and its result."""

    first: asyncio.Future
    result: asyncio.Task | None = None
    received_s: float = field(default_factory=time.time)   # wall clock: the router's path breakdown


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
        self._next_send_fault: str | None = None   # fault injection (tests): see SEND_FAULTS

    async def prefill(self, spec: RequestSpec, transport: str | None, decode: Any) -> PrefillResult:
        """Prefill ``spec``; with a ``transport``, reserve its blocks on ``decode`` (a
        ``DecodePeer``) while the prompt is prefilled and move its KV there. Without one, no
        hand-off (tests of the prefill path alone). A second call for a request already here
        (a retry) waits for the first one's result."""
        return await asyncio.shield(self._start(spec, transport, decode).result)

    async def stream(self, spec: RequestSpec, transport: str | None,
                     decode: Any) -> AsyncIterator[FirstToken | PrefillResult]:
        """``prefill``, with the first token yielded as soon as it may go to the client (the
        reservation holds, the KV starts moving), then the result."""
        run = self._start(spec, transport, decode)
        first = await asyncio.shield(run.first)
        if first is not None:
            yield first
        yield await asyncio.shield(run.result)

    def _start(self, spec: RequestSpec, transport: str | None, decode: Any) -> _Running:
        run = self._running.get(spec.req_id)
        if run is None:
            run = self._running[spec.req_id] = _Running(self.aio.create_future())
            run.result = asyncio.ensure_future(self._prefill(spec, transport, decode))
            run.result.add_done_callback(lambda _: self._running.pop(spec.req_id, None))
        return run

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
        self._done[req_id] = asyncio.Event()
        added = self.loop.call(lambda e: e.add_request(spec))   # the compute first: it is the path
        # Resolved while the prompt is prefilled: the KV (and the first token) need not wait for it.
        reservation = _resolving(decode.reserve(spec, transport)) if transport is not None else None
        try:
            await asyncio.wrap_future(added)
            outcome = await waiter
            if isinstance(outcome, TokenDelta):
                result = _ended_at_prefill(outcome)
            else:
                _phase_spans(outcome)
                with tracing.current_child("kv_handoff") as span:   # None: untraced
                    result = await self._hand_off(outcome, reservation, decode)
                    if span is not None:
                        span.set_attributes({"pdserve.kv.bytes": result.transfer_bytes, "pdserve.kv.transport":
                                             result.transport, "pdserve.kv.outcome": result.outcome.value})
            return dataclasses.replace(result, stats=self.stats(), kv_events=self.take_kv_events())
        finally:
            self._first_token(req_id, None)   # none went ahead: the result carries it
            if reservation is not None:   # the router frees what it reserved: after it landed
                await asyncio.wait([reservation], timeout=RESERVE_SETTLE_S)
            self._waiters.pop(req_id, None)
            self._aborted.discard(req_id)
            self._done.pop(req_id).set()

    def _first_token_of(self, done: PrefillDone, reserve_wait_s: float) -> FirstToken:
        run = self._running.get(done.req_id)
        return FirstToken(done.req_id, done.first_token_id, done.first_logprob, done.first_top_logprobs,
                          received_s=run.received_s if run else 0.0, sent_s=time.time(),
                          queue_s=done.queue_s, prefill_s=done.prefill_s, reserve_wait_s=reserve_wait_s)

    def _first_token(self, req_id: str, first: FirstToken | None) -> None:
        run = self._running.get(req_id)
        if run is not None and not run.first.done():
            run.first.set_result(first)

    async def abort(self, req_id: str) -> None:
        """Stop the request; returns once no write into its decode blocks can still happen."""
        done = self._done.get(req_id)
        if done is None:
            return
        self._aborted.add(req_id)
        await self.call(lambda e: e.abort(req_id))
        await done.wait()

    # ---- loop thread results, on the event loop --------------------------------------------------
    def on_step(self, result: StepResult) -> None:
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
        except Exception as exc:   # KVTransferError, or anything else a send raised: recompute
            logger.warning("KV hand-off of %s failed: %s", req_id, exc)
            return _result(done, FinishReason.ERROR, error=f"KV transfer failed: {exc}",
                           outcome=HandoffOutcome.TRANSFER_FAILED)
        finally:
            # Not awaited: the blocks go back at the next step boundary, the answer goes now.
            self.loop.call(lambda e: e.release(req_id))

    async def _send(self, done: PrefillDone, handle: KVBlocksHandle, decode: Any) -> int:
        fault, self._next_send_fault = self._next_send_fault, None
        if fault == "kv_send":
            raise KVTransferError("injected KV send failure")
        if fault == "hang_kv_send":
            await asyncio.Event().wait()   # only the process's death ends this hand-off
        sender = self._sender(handle.transport)
        bound = sender.bind(handle, handle.source_blocks(done.block_ids))
        if sender.rendezvous:  # the receiver must be inside receive() while we send
            async with self._transfer_locks.setdefault(decode.peer_id, asyncio.Lock()):  # FIFO per pair
                _check_lease(handle)   # after the wait for the lock: the write starts now
                commit = asyncio.ensure_future(decode.commit(done.req_id, done.first_token_id, bound))
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
        if kind in SEND_FAULTS and self.spec.allow_fault_injection:
            self._next_send_fault = kind
            return
        await super().inject_fault(kind)

    def shutdown(self) -> None:
        super().shutdown()
        for sender in self._senders.values():
            sender.close()


def _phase_spans(done: PrefillDone) -> None:
    """The engine's queue and compute times of a finished prefill as spans under the current one
    (their ends are known now; the engine loop thread is not traced)."""
    span = tracing.trace.get_current_span()
    if not span.is_recording():
        return
    now = time.time_ns()
    compute_start = now - int(done.prefill_s * 1e9)
    queue_start = compute_start - int(done.queue_s * 1e9)
    for name, start, end in (("prefill.queue", queue_start, compute_start), ("prefill.compute", compute_start, now)):
        tracing.tracer().start_span(name, start_time=start, attributes={"pdserve.tokens": done.num_tokens}).end(end)


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
    return PrefillResult(delta.req_id, first, delta.finish_reason, logprob, delta.error, outcome=outcome,
                         first_top_logprobs=top)


def _result(done: PrefillDone, reason: FinishReason | None, transfer_s: float = 0.0, num_bytes: int = 0,
            transport: str = "", error: str | None = None,
            outcome: HandoffOutcome = HandoffOutcome.OK) -> PrefillResult:
    return PrefillResult(
        req_id=done.req_id,
        first_token_id=done.first_token_id,
        finish_reason=reason,
        first_logprob=done.first_logprob,
        first_top_logprobs=done.first_top_logprobs,
        error=error,
        queue_s=done.queue_s,
        prefill_s=done.prefill_s,
        transfer_s=transfer_s,
        transfer_bytes=num_bytes,
        transport=transport,
        outcome=outcome,
        cached_tokens=done.num_cached_tokens,
    )
