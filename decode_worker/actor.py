"""Ray actor around DecodeWorker: one process, its own engine loop, one batched output stream."""

from __future__ import annotations

from typing import AsyncIterator

import ray

from engine.config import EngineRole
from engine.types import RequestSpec, StreamBatch
from engine.worker_actor import WorkerActor
from engine.worker_spec import WorkerSpec
from kvtransfer.handle import KVBlocksHandle


@ray.remote
class DecodeActor(WorkerActor):
    def __init__(self, spec: WorkerSpec, colocated: bool = False, standby: bool = False) -> None:
        from decode_worker.worker import DecodeWorker   # here: the router imports this class, never the engine

        role = EngineRole.COLOCATED if colocated else EngineRole.DECODE
        self.worker = DecodeWorker(spec, role, standby)

    async def start(self) -> dict:
        self.worker.start()
        return self.worker.info(ray.get_runtime_context().get_node_id())

    async def reserve(self, spec: RequestSpec, transport: str) -> KVBlocksHandle:
        return await self.worker.reserve(spec, transport)

    async def commit(self, req_id: str, first_token_id: int, handle: KVBlocksHandle) -> float:
        return await self.worker.commit(req_id, first_token_id, handle)

    async def add_request(self, spec: RequestSpec) -> None:
        await self.worker.add_request(spec)

    async def abort(self, req_id: str, writer_gone: bool = True) -> None:
        await self.worker.abort(req_id, writer_gone)

    async def stream(self) -> AsyncIterator[StreamBatch]:
        async for batch in self.worker.stream():
            yield batch

