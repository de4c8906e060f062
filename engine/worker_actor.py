"""The methods every worker's Ray actor has, whatever its role: a standby spare's readiness and
activation, joining the KV transfer group, the lifeline and heartbeat the router watches, stats, the leak
report, fault injection for tests, and shutdown. ``PrefillActor`` and ``DecodeActor`` add their
role's calls (and ``start``) on top; each wraps its worker as ``self.worker`` (made in its
constructor, in the actor's process), which owns all state: these only forward.

Life cycle (the launcher's): construct -> ``ping`` (model loaded) -> [``activate`` for a spare
taking a dead worker's place] -> ``start`` -> [``join_kv_group``] -> serve, ``lifeline`` held
open by the router, ``heartbeat`` answered every few seconds, [``join_kv_group`` again once a
lost member of the group is replaced] -> ``shutdown``.
"""

from __future__ import annotations

import os
from typing import Any

from engine.types import WorkerStats


class WorkerActor:
    worker: Any   # the role's worker (PrefillWorker or DecodeWorker)

    async def ping(self) -> int:
        """Answers once the constructor is done (a standby spare's model is loaded): its pid."""
        return os.getpid()

    async def activate(self, worker_id: str) -> None:
        """A standby spare takes a dead worker's place (then ``start``)."""
        self.worker.activate(worker_id)

    async def kv_group_address(self) -> str:
        """A rendezvous address on this worker's node, for a KV group it is rank 0 of (its store
        listens there from now on, before any member joins)."""
        import ray

        from kvtransfer import group   # torch.distributed: in the worker's process only

        return group.host_rendezvous(ray.util.get_node_ip_address())

    async def join_kv_group(self, address: str, world_size: int, rank: int) -> None:
        """Join the KV group at ``address``, leaving the one this worker is in (if any) first."""
        from kvtransfer import group   # torch.distributed: in the worker's process only

        await group.join(address, world_size, rank, self.worker.spec.engine.device)

    async def lifeline(self) -> None:
        await self.worker.lifeline()

    async def heartbeat(self) -> float:
        return await self.worker.heartbeat()

    async def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def leak_report(self) -> dict:
        return await self.worker.leak_report()

    async def inject_fault(self, kind: str) -> None:
        await self.worker.inject_fault(kind)

    async def shutdown(self) -> None:
        from kvtransfer import group

        self.worker.shutdown()
        group.leave()
