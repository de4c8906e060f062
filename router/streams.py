"""Splits each decode worker's one batched output stream into per-request queues.

Life cycle: ``start`` opens one Ray streaming call per decode worker; each batch's deltas go
to the queue of the request they belong to (deltas for requests no longer registered, e.g.
after a cancel, are dropped) and its stats update the registry. When a stream fails the
worker is marked dead and every request on it receives a WorkerFailedError.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from engine.errors import WorkerFailedError
from engine.types import StreamBatch, TokenDelta
from router.delta_queue import DeltaQueue
from router.registry import WorkerHandle, WorkerRegistry

logger = logging.getLogger(__name__)

QueueItem = TokenDelta | Exception


class DecodeStreams:
    def __init__(self, registry: WorkerRegistry, on_stats: Callable[[WorkerHandle], None] | None = None) -> None:
        self.registry = registry
        self.on_stats = on_stats
        self._queues: dict[str, asyncio.Queue[QueueItem]] = {}
        self._owner: dict[str, str] = {}     # req_id -> decode worker id
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        for worker in self.registry.decode:
            self._tasks.append(asyncio.create_task(self._consume(worker), name=f"stream-{worker.worker_id}"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def register(self, req_id: str, worker: WorkerHandle) -> asyncio.Queue[QueueItem]:
        queue = DeltaQueue()  # merges deltas for a reader that lags; bounded (router/delta_queue.py)
        self._queues[req_id] = queue
        self._owner[req_id] = worker.worker_id
        return queue

    def unregister(self, req_id: str) -> None:
        self._queues.pop(req_id, None)
        self._owner.pop(req_id, None)

    @property
    def num_registered(self) -> int:
        return len(self._queues)

    async def _consume(self, worker: WorkerHandle) -> None:
        try:
            async for ref in worker.actor.stream.remote():
                self._dispatch(worker, await ref)
            raise WorkerFailedError(f"decode worker {worker.worker_id} closed its stream")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("decode worker %s stream failed: %s", worker.worker_id, exc)
            self._fail_worker(worker, exc)

    def _dispatch(self, worker: WorkerHandle, batch: StreamBatch) -> None:
        if batch.stats is not None:
            worker.stats = batch.stats
            if self.on_stats:
                self.on_stats(worker)
        for delta in batch.deltas:
            queue = self._queues.get(delta.req_id)
            if queue is not None:
                queue.put_nowait(delta)

    def _fail_worker(self, worker: WorkerHandle, exc: Exception) -> None:
        worker.alive = False
        error = WorkerFailedError(f"decode worker {worker.worker_id} failed: {exc}")
        for req_id, owner in list(self._owner.items()):
            if owner == worker.worker_id:
                self._queues[req_id].put_nowait(error)
