"""Ray actor around PrefillWorker: one process, its own engine loop, thin async methods."""

from __future__ import annotations

from typing import Any

import ray

from engine.types import PrefillResult, RequestSpec, WorkerStats
from engine.worker_base import WorkerSpec
from kvtransfer import group
from kvtransfer.handle import KVBlocksHandle
from prefill_worker.worker import PrefillWorker


@ray.remote
class PrefillActor:
    def __init__(self, spec: WorkerSpec) -> None:
        self.worker = PrefillWorker(spec)

    async def start(self) -> dict:
        self.worker.start()
        return self.worker.info(ray.get_runtime_context().get_node_id())

    async def join_kv_group(self, address: str, world_size: int, rank: int) -> None:
        await group.join(address, world_size, rank, self.worker.spec.engine.device)

    async def prefill(self, spec: RequestSpec, handle: KVBlocksHandle | None, decode: Any) -> PrefillResult:
        return await self.worker.prefill(spec, handle, decode)

    async def abort(self, req_id: str) -> None:
        await self.worker.abort(req_id)

    async def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def leak_report(self) -> dict:
        return await self.worker.leak_report()

    async def inject_fault(self, kind: str) -> None:
        await self.worker.inject_fault(kind)

    async def shutdown(self) -> None:
        self.worker.shutdown()
        group.leave()
