"""The decode worker: receives KV into reserved blocks and runs its continuous-batching loop.

Life cycle of one request here:
  reserve(spec) -> blocks reserved, request parked; the handle says where its KV must land
  (only the part after the prefix this worker's cache holds already: those blocks are shared)
  -> commit(req_id, first_token, handle): the transport's receive side runs (a no-op for
  shared memory, where the prefill worker already wrote the blocks), the request joins the
  running batch at the next step -> one token per step -> finished or aborted; blocks are
  freed at that step boundary. A failed receive frees the reservation and raises
  KVTransferError: the request is never decoded from those blocks.
  ``add_request`` runs a whole request here (colocated mode, conditional disaggregation,
  and recompute after preemption all use the same engine).
Fencing: each reservation carries a lease (``RESERVATION_LEASE_S``). ``abort`` frees it at once
when the router knows no writer can still touch it (the prefill worker confirmed its abort, or
died); otherwise the blocks stay fenced until the lease ends (a prefill worker never starts a
write that late, and a fenced reservation refuses its commit), so a late writer can never land
in blocks another request already owns. ``reserve``, ``add_request``, ``abort`` are idempotent
per request id (the router retries them after a transient failure). A request the router has
ended here refuses a ``reserve`` that arrives later (``EndedRequests``): the prefill worker
submits the reserve and the router the free, so the free may overtake it.
Output: one batched stream per worker. ``stream()`` yields a StreamBatch per step holding
the token deltas of every request that advanced, plus the worker's stats and its prefix-cache
events (``KVEvent``: blocks stored, removed) since the previous batch, for the router to split
per request and to keep its prefix index true.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from engine.config import EngineRole
from engine.ended_requests import EndedRequests
from engine.tracing import RequestSpans
from engine.engine import StepResult
from engine.errors import KVTransferError
from engine.types import KVLayout, RequestSpec, StreamBatch
from engine.worker_base import WorkerBase, WorkerSpec
from kvtransfer.cache_alloc import allocate_kv_cache, release_kv_cache
from kvtransfer.handle import KVBlocksHandle
from kvtransfer.select import make_receiver
from kvtransfer.shm_reclaim import reclaim_stale_segments

logger = logging.getLogger(__name__)

RECEIVE_TIMEOUT_S = 30.0
RESERVATION_LEASE_S = 120.0   # a prefill must hand its KV over within this (else: recomputed here)


def shm_path_for(worker_id: str) -> str:
    return f"/dev/shm/pdserve-{os.getpid()}-{worker_id}-{uuid.uuid4().hex[:8]}.kv"


class DecodeWorker(WorkerBase):
    def __init__(self, spec: WorkerSpec, role: EngineRole = EngineRole.DECODE, standby: bool = False) -> None:
        super().__init__(spec, role, standby)
        self._receivers: dict[str, Any] = {}
        self._stream: asyncio.Queue[StreamBatch] | None = None
        # live reservations, by request id: each handle and its lease timer
        self._handles: dict[str, tuple[KVBlocksHandle, asyncio.TimerHandle]] = {}
        self._spans = RequestSpans()   # each traced request's ``decode`` span (engine/tracing.py)
        self._ended = EndedRequests(RESERVATION_LEASE_S)   # a reserve of these arrives too late

    def allocate_cache(self, layout: KVLayout, num_blocks: int):
        self.shm_path = shm_path_for(self.worker_id) if self.spec.engine.device == "cpu" else None
        # The pool lives in /dev/shm so a prefill worker on this node can write straight into it.
        if self.shm_path:  # this node's pools that crashed workers left, before adding ours
            reclaim_stale_segments()
        return allocate_kv_cache(layout, num_blocks, shm_path=self.shm_path, device=self.spec.engine.device)

    def start(self) -> None:
        super().start()
        self._stream = asyncio.Queue()

    # ---- requests ---------------------------------------------------------------------------
    async def reserve(self, spec: RequestSpec, transport: str) -> KVBlocksHandle:
        if spec.req_id in self._handles:   # a retried call: the reservation it made stands
            return self._handles[spec.req_id][0]
        self._refuse_if_ended(spec.req_id)
        # Before any block is reserved: a transport that cannot take KV now (not in a KV group,
        # say) refuses with nothing to free.
        locator = self._receiver(transport).locator(self.engine.cache)
        block_ids, num_cached = await self.call(lambda e: e.reserve_prefix(spec))
        # An abort that ran meanwhile found no reservation; its engine abort, queued after
        # reserve_prefix on the loop, frees these blocks.
        self._refuse_if_ended(spec.req_id)
        self._spans.remember(spec.req_id, spec.traceparent)
        handle = KVBlocksHandle(
            req_id=spec.req_id,
            src_block_ids=(),
            dst_block_ids=tuple(block_ids[num_cached // self.engine.config.block_size :]),
            num_tokens=len(spec.prompt_token_ids) - num_cached,
            layout=self.engine.layout,
            transport=transport,
            locator=locator,
            lease_deadline_s=time.time() + RESERVATION_LEASE_S,
            num_cached_tokens=num_cached,
        )
        # No commit or abort by the end of the lease (the router died, an abort was lost): free it.
        # Cancelled when the reservation ends (``_take``): a timer left to run held the request's
        # spec and handle for the whole lease, one per request (found by benchmarks/probe_soak.py).
        self._handles[spec.req_id] = handle, self.aio.call_later(RESERVATION_LEASE_S, self._lease_ended,
                                                                  spec.req_id, handle)
        return handle

    def _lease_ended(self, req_id: str, handle: KVBlocksHandle) -> None:
        if self._handles.get(req_id, (None,))[0] is handle:
            asyncio.ensure_future(self.abort(req_id))

    def _take(self, req_id: str) -> KVBlocksHandle | None:
        """End ``req_id``'s reservation (committed or aborted): its handle, None if none is live."""
        handle, lease = self._handles.pop(req_id, (None, None))
        if lease is not None:
            lease.cancel()
        return handle

    async def leak_report(self) -> dict:
        """The engine's holdings, and the reservations still live here (each with its lease timer)."""
        return {**await super().leak_report(), "reservations": len(self._handles)}

    def _refuse_if_ended(self, req_id: str) -> None:
        if req_id in self._ended:
            raise KVTransferError(f"{req_id}: the router ended this request here before its reservation arrived")

    async def commit(self, req_id: str, first_token_id: int, handle: KVBlocksHandle) -> float:
        """Receive the KV (per transport) and admit the request; returns the receive seconds."""
        start = time.perf_counter()
        if self._take(req_id) is None:   # aborted (perhaps fenced), or its lease ran out
            raise KVTransferError(f"{req_id}: no live reservation here (aborted, or its lease ran out)")
        receiver = self._receiver(handle.transport)
        try:
            if handle.transport == "shm":  # the bytes are already here: receive only checks
                receiver.receive(self.engine.cache, handle)
            else:
                await asyncio.to_thread(receiver.receive, self.engine.cache, handle, timeout_s=RECEIVE_TIMEOUT_S)
        except Exception as exc:
            # The sender may still be writing (a receive that timed out): fence, never free now.
            await self._free(req_id, handle, writer_gone=False)
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"{req_id}: receive failed: {exc}") from exc
        # Not awaited: the request joins the batch at the next step boundary either way, and the
        # prefill worker (and the client's first token) should not wait for a decode step.
        self.loop.call(lambda e: e.commit_kv(req_id, first_token_id)).add_done_callback(self._committed)
        receive_s = time.perf_counter() - start
        self._spans.open(req_id, "decode", worker=self.worker_id, kv_receive_s=receive_s, transport=handle.transport)
        return receive_s

    def _committed(self, future) -> None:
        """Loop thread: a request that finished with its first token (e.g. the model length)
        still reports its end on the stream; a commit of an already aborted one is dropped."""
        if future.exception() is not None:
            logger.info("commit dropped: %s", future.exception())
        elif future.result() is not None:
            self.aio.call_soon_threadsafe(self._publish, (future.result(),))

    async def add_request(self, spec: RequestSpec) -> None:
        self._spans.open(spec.req_id, "decode", spec.traceparent, worker=self.worker_id, prefilled_here=True)
        await self.call(lambda e: None if spec.req_id in e.scheduler.requests else e.add_request(spec))

    async def abort(self, req_id: str, writer_gone: bool = True) -> None:
        """Free the request. ``writer_gone=False``: a prefill worker may still write into its
        reservation, so the blocks stay fenced until the lease ends."""
        self._spans.close(req_id, aborted=True)
        self._ended.add(req_id)
        await self._free(req_id, self._take(req_id), writer_gone)

    async def _free(self, req_id: str, handle: KVBlocksHandle | None, writer_gone: bool) -> None:
        """Free at once, or (a writer may still be busy) once the lease plus the longest
        transfer have passed: no write can land after that (the prefill worker starts none
        later than a transfer's length before the lease ends)."""
        remaining = handle.lease_deadline_s - time.time() if handle is not None else 0.0
        if writer_gone or remaining <= 0:
            await self.call(lambda e: e.abort(req_id))
            return
        logger.warning("%s: freed while a writer may be alive; blocks fenced for %.0f s", req_id, remaining)
        self.aio.call_later(remaining, lambda: asyncio.ensure_future(self.call(lambda e: e.abort(req_id))))

    # ---- the batched output stream ----------------------------------------------------------
    def on_step(self, result: StepResult) -> None:
        if result.deltas or result.between_steps or result.kv_events:   # fresh stats, cache changes
            self._publish(tuple(result.deltas))

    def _publish(self, deltas: tuple) -> None:
        if self._spans:
            for delta in deltas:
                if delta.finished:
                    self._spans.close(delta.req_id, finish_reason=delta.finish_reason.value)
        self._stream.put_nowait(StreamBatch(self.worker_id, deltas, self.stats(), self.take_kv_events()))

    async def stream(self) -> AsyncIterator[StreamBatch]:
        """One consumer (the router). Batches that queued up meanwhile are merged into one."""
        while True:
            batch = await self._stream.get()
            deltas, events = list(batch.deltas), list(batch.kv_events)
            while not self._stream.empty():
                batch = self._stream.get_nowait()
                deltas.extend(batch.deltas)
                events.extend(batch.kv_events)
            yield StreamBatch(self.worker_id, tuple(deltas), batch.stats, tuple(events))

    def _receiver(self, transport: str):
        if transport not in self._receivers:
            kwargs = {"shm_path": self.shm_path} if transport == "shm" else {}
            self._receivers[transport] = make_receiver(transport, **kwargs)
        return self._receivers[transport]

    def shutdown(self) -> None:
        super().shutdown()
        for receiver in self._receivers.values():
            receiver.close()
        self.release_cache()

    def release_cache(self) -> None:
        if self.shm_path:
            release_kv_cache(self.shm_path)
