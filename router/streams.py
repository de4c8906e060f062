"""Splits each decode worker's one batched output stream into per-request queues.

Life cycle: ``watch(worker)`` opens one Ray streaming call to the worker's current actor
(again for every replacement); each batch's deltas go to the queue of the request they belong
to (deltas for requests no longer registered, e.g. after a cancel, are dropped) and its stats
update the registry. When a stream fails, every request registered on that actor receives a
``WorkerLost`` (the orchestrator migrates it) and ``on_lost`` reports the worker (the
supervisor replaces it). A stream of an actor that was already replaced ends quietly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from engine.types import StreamBatch, TokenDelta
from router.delta_queue import DeltaQueue
from router.registry import WorkerHandle, WorkerRegistry
from router.worker_calls import WorkerLost, short_cause

logger = logging.getLogger(__name__)

QueueItem = TokenDelta | Exception


class DecodeStreams:
    def __init__(self, registry: WorkerRegistry, on_stats: Callable[[WorkerHandle], None] | None = None,
                 on_lost: Callable[[WorkerLost], None] | None = None) -> None:
        self.registry = registry
        self.on_stats = on_stats
        self.on_lost = on_lost
        self._queues: dict[str, asyncio.Queue[QueueItem]] = {}
        self._owner: dict[str, tuple[str, int]] = {}     # req_id -> (decode worker id, generation)
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self) -> None:
        for worker in self.registry.decode:
            self.watch(worker)

    def watch(self, worker: WorkerHandle) -> None:
        """Consume the stream of ``worker``'s current actor (a replacement gets a new one)."""
        old = self._tasks.get(worker.worker_id)
        if old is not None:
            old.cancel()
        self._tasks[worker.worker_id] = asyncio.create_task(
            self._consume(worker, worker.generation), name=f"stream-{worker.worker_id}-{worker.generation}")

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def register(self, req_id: str, worker: WorkerHandle) -> DeltaQueue:
        queue = DeltaQueue()  # merges deltas for a reader that lags; bounded (router/delta_queue.py)
        self._queues[req_id] = queue
        self._owner[req_id] = (worker.worker_id, worker.generation)
        return queue

    def unregister(self, req_id: str) -> None:
        self._queues.pop(req_id, None)
        self._owner.pop(req_id, None)

    @property
    def num_registered(self) -> int:
        return len(self._queues)

    async def _consume(self, worker: WorkerHandle, generation: int) -> None:
        actor = worker.actor
        try:
            async for ref in actor.stream.remote():
                self._dispatch(worker, generation, await ref)
            raise RuntimeError("the stream closed")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            cause = f"decode worker {worker.worker_id} stream failed: {short_cause(exc)}"
            if generation == worker.generation and worker.alive:
                logger.error("%s", cause)
            self._lose(WorkerLost(worker, generation, cause))

    def _dispatch(self, worker: WorkerHandle, generation: int, batch: StreamBatch) -> None:
        if generation != worker.generation:
            return
        worker.heard(generation)
        worker.observe_kv_events(batch.kv_events, generation)
        if batch.stats is not None:
            worker.observe_stats(batch.stats)
            if self.on_stats:
                self.on_stats(worker)
        for delta in batch.deltas:
            queue = self._queues.get(delta.req_id)
            if queue is not None:
                queue.put_nowait(delta)

    def _lose(self, lost: WorkerLost) -> None:
        owner = (lost.worker.worker_id, lost.generation)
        for req_id, where in list(self._owner.items()):
            if where == owner:
                # Its own exception each: every request re-raises it, and one shared instance
                # grew a traceback frame per raise (a probe: the 8th request's ERROR log carried
                # 8 copies of the same frames; 256 streams would log ~33,000 frames).
                self._queues[req_id].put_nowait(WorkerLost(lost.worker, lost.generation, lost.cause))
        if self.on_lost:
            self.on_lost(lost)
