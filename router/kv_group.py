"""The torch.distributed KV group as the router keeps it: formed at the cluster's start over every
KV-moving worker (when some pair will move KV over it), lost when a member dies (a collective
world cannot take a new rank: the registry routes pairs around it), formed again once every
member is up, the lost one's replacement included.

Life cycle: ``form_if_needed`` at start -> up -> a member is lost (the supervisor calls
``registry.lose_kv_group``) -> down -> ``member_ready`` of the replacement -> ``_reform``: rank 0
names a fresh rendezvous address on its own node (where its store listens), every member joins
at once (each leaves the old group first, once its transfers in flight have ended) -> up again
(``registry.kv_group_up``). A forming that fails (a member lost meanwhile, a rendezvous that timed
out) leaves the group down: tried again after a back-off while every member is up, else at the
next replacement. ``stop`` ends a re-forming at the cluster's stop.
"""

from __future__ import annotations

import asyncio
import logging

from kvtransfer.select import choose_transport
from router.registry import WorkerHandle, WorkerRegistry
from router.worker_calls import call

logger = logging.getLogger(__name__)

FIRST_REFORM_BACKOFF_S = 5.0
MAX_REFORM_BACKOFF_S = 60.0


class KVGroup:
    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.wanted = False        # formed at start: some pair moves KV over it
        self.num_formed = 0
        self._reforming: asyncio.Task | None = None

    async def form_if_needed(self) -> None:
        """At the cluster's start: form the group when some (prefill, decode) pair will move KV
        over it (forced, or chosen for its placement)."""
        reg = self.registry
        if not reg.prefill:
            return
        self.wanted = reg.forced_transport == "torch_dist" or (reg.forced_transport is None and any(
            choose_transport(p.node_id, d.node_id, p.device, decode_device=d.device) == "torch_dist"
            for p in reg.prefill for d in reg.decode))
        if self.wanted:
            await self._form()

    def member_ready(self, worker: WorkerHandle) -> None:
        """``worker`` is up again (a replacement): form the group again if it is down."""
        if not self.wanted or self.registry.dist_ready:
            return
        if self._reforming is None or self._reforming.done():
            self._reforming = asyncio.get_running_loop().create_task(self._reform(), name="kv-group-reform")

    def stop(self) -> None:
        if self._reforming is not None:
            self._reforming.cancel()

    async def _reform(self) -> None:
        delay = FIRST_REFORM_BACKOFF_S
        while not self.registry.dist_ready and all(w.alive for w in self.registry.all):
            try:
                await self._form()
                return
            except Exception as exc:   # noqa: BLE001 - any failure leaves the group down: said, then retried
                logger.warning("the torch.distributed KV group was not formed again (%s); next try in %.0f s",
                               exc, delay)
            await asyncio.sleep(delay)
            delay = min(MAX_REFORM_BACKOFF_S, 2 * delay)

    async def _form(self) -> None:
        """Every member joins a fresh group at once; up only if none was lost meanwhile (its loss
        found the group down, so nothing else would take it down again)."""
        members = self.registry.all
        generations = [w.generation for w in members]
        address = await call(members[0], "kv_group_address", generation=generations[0])
        # Every join is awaited to its end, failed or not: a member still waiting out a rendezvous
        # that another never reached takes the next forming's join only after it (found by a
        # probe: joins left running piled up behind each other, and no forming met again).
        joined = await asyncio.gather(*(call(w, "join_kv_group", address, len(members), rank, generation=gen)
                                        for rank, (w, gen) in enumerate(zip(members, generations))),
                                      return_exceptions=True)
        failed = next((result for result in joined if isinstance(result, BaseException)), None)
        if failed is not None:
            raise failed
        if any(not w.alive or w.generation != gen for w, gen in zip(members, generations)):
            raise RuntimeError("a member was lost while the group formed")
        self.num_formed += 1
        self.registry.kv_group_up()
        logger.info("torch.distributed KV group up: %d workers at %s%s", len(members), address,
                    "" if self.num_formed == 1 else f" (formed again, {self.num_formed - 1} time(s))")
