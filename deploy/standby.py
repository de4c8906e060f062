"""Warm spares: one pre-started actor per worker kind, so that a dead worker is replaced in
about a second instead of a cold start (a new process importing torch and loading the weights:
8-13 s on a loaded 2-core machine, benchmarks/results/chaos.txt).

Life cycle: once the cluster serves, ``fill`` starts one spare per kind (prefill, decode or
colocated) in the background. A spare loads the model and builds its engine and KV pool (a
decode spare's pool is its own /dev/shm file, touched once like every pool), then idles: no
engine loop, no CPU reservation. ``take(kind)`` hands one to the supervisor's spawn, which
``activate``s it under the dead worker's id (its loop starts; its engine and pool were never
used) and ``start``s it; a spare still loading is awaited (it is ahead of a cold start).
``refill`` then builds the next one. A spare that died while idle fails its activation: the
caller falls back to a cold start. The price: one more process, copy of the weights and KV
pool per kind. GPU workers get no spare (it would compete for the GPU's memory).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import ray

logger = logging.getLogger(__name__)

SHUTDOWN_S = 5.0   # a spare's shutdown (unlinking its pool) gets this long before it is killed


class StandbyPool:
    def __init__(self, make: Callable[[str], Any]) -> None:
        """``make(kind)`` creates a spare actor of that kind (its constructor loads the model)."""
        self._make = make
        self._spares: dict[str, asyncio.Task] = {}

    def fill(self, kinds: set[str]) -> None:
        for kind in kinds:
            self.refill(kind)

    def refill(self, kind: str) -> None:
        if kind not in self._spares:
            self._spares[kind] = asyncio.get_running_loop().create_task(self._build(kind), name=f"standby-{kind}")

    async def _build(self, kind: str) -> Any:
        actor = self._make(kind)
        try:
            await actor.ping.remote()   # returns once the constructor (the model load) is done
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        logger.info("standby %s worker ready", kind)
        return actor

    async def peek(self, kind: str) -> Any | None:
        """The spare of ``kind`` once it is ready, left in the pool (introspection, tests)."""
        task = self._spares.get(kind)
        return None if task is None else await asyncio.shield(task)

    async def take(self, kind: str) -> Any | None:
        """A spare of ``kind`` (None when there is none, or it failed to start)."""
        task = self._spares.pop(kind, None)
        if task is None:
            return None
        try:
            return await task
        except Exception as exc:
            logger.warning("standby %s worker failed to start: %s", kind, exc)
            return None

    async def stop(self) -> None:
        """Spares still loading are killed; ready ones shut down first (a decode spare unlinks
        its KV pool), then are killed."""
        tasks = list(self._spares.values())
        self._spares.clear()
        for task in tasks:
            if not task.done():
                task.cancel()
        spares = [r for r in await asyncio.gather(*tasks, return_exceptions=True) if not isinstance(r, BaseException)]
        await asyncio.gather(*(asyncio.wait_for(s.shutdown.remote(), SHUTDOWN_S) for s in spares),
                             return_exceptions=True)
        for spare in spares:
            ray.kill(spare, no_restart=True)
