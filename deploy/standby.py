"""Warm spares: one pre-started actor per worker kind, so that a dead worker is replaced in
about a second instead of a cold start (a new process importing torch and loading the weights:
8-13 s on a loaded 2-core machine, benchmarks/results/chaos.txt).

Life cycle: once the cluster serves, ``fill`` starts one spare per kind (prefill, decode or
colocated) in the background. A spare loads the model and builds its engine and KV pool (a
decode spare's pool is its own /dev/shm file, touched once like every pool), then idles: no
engine loop, no CPU reservation. ``take(kind)`` hands one to the supervisor's spawn, which
``activate``s it under the dead worker's id (its loop starts; its engine and pool were never
used) and ``start``s it; a spare still loading is awaited (it is ahead of a cold start).
``refill`` then builds the next one. A spare is watched while it is the pool's: one that dies
while loading or while idle (the OOM killer, a stray kill) is dropped and built again at once,
so the next loss still gets a warm spare, and the new spare's pool creation reclaims the dead
one's /dev/shm file (``kvtransfer.shm_reclaim``) rather than leaving it for the next worker loss.
Spares that keep dying (each within ``STABLE_S`` of the last death) are rebuilt after a doubling
pause (up to ``DEATH_PAUSE_MAX_S``); a loss during such a pause does not wait for it (``take``
answers None: a cold start is sooner). A spare that dies between that watch and its activation
fails the activation: the caller falls back to a cold start. The price: one more process, copy
of the weights and KV pool per kind. GPU workers get no spare (it would compete for the GPU's
memory).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import ray

from deploy.start_failure import first_line

logger = logging.getLogger(__name__)

SHUTDOWN_S = 5.0   # a spare's shutdown (unlinking its pool) gets this long before it is killed
DEATH_PAUSE_MAX_S = 60.0   # the longest pause before rebuilding a kind whose spares keep dying
STABLE_S = 300.0           # a spare death this long after the last one starts the pauses over


class StandbyPool:
    def __init__(self, make: Callable[[str], Any]) -> None:
        """``make(kind)`` creates a spare actor of that kind (its constructor loads the model)."""
        self._make = make
        self._spares: dict[str, asyncio.Task] = {}
        self._watches: dict[str, asyncio.Task] = {}          # kind -> the ready spare's lifeline watch
        self._deaths: dict[str, tuple[int, float]] = {}      # kind -> (spares lost in a row, when the last was)
        self._pausing: set[str] = set()                      # kinds whose build waits out a pause

    def fill(self, kinds: set[str]) -> None:
        for kind in kinds:
            self.refill(kind)

    def refill(self, kind: str, pause_s: float = 0.0) -> None:
        if kind not in self._spares:
            self._spares[kind] = asyncio.get_running_loop().create_task(self._build(kind, pause_s), name=f"standby-{kind}")

    async def _build(self, kind: str, pause_s: float = 0.0) -> Any:
        if pause_s:
            self._pausing.add(kind)
            try:
                await asyncio.sleep(pause_s)
            finally:
                self._pausing.discard(kind)
        build = asyncio.current_task()
        actor = self._make(kind)
        try:
            await actor.ping.remote()   # returns once the constructor (the model load) is done
        except BaseException as exc:
            ray.kill(actor, no_restart=True)
            if isinstance(exc, Exception) and self._lost(kind, build, "while loading", exc):
                return None   # dropped and being built again: nobody awaits this one
            raise
        logger.info("standby %s worker ready", kind)
        if self._spares.get(kind) is build:   # still the pool's (not taken while it loaded)
            self._watches[kind] = asyncio.get_running_loop().create_task(
                self._watch(kind, actor, build), name=f"standby-{kind}-lifeline")
        return actor

    async def _watch(self, kind: str, actor: Any, build: asyncio.Task) -> None:
        """Drops and rebuilds the ready spare of ``kind`` if it dies while still in the pool."""
        try:
            await actor.lifeline.remote()
            return   # it shut down: the pool is stopping
        except ray.exceptions.RayError as exc:
            self._watches.pop(kind, None)
            self._lost(kind, build, "while idle", exc)

    def _lost(self, kind: str, build: asyncio.Task, when: str, cause: BaseException) -> bool:
        """The spare of ``build`` died: if it is still the pool's, drop it and build another (True)."""
        if self._spares.get(kind) is not build:
            return False   # taken since (its death is the supervisor's) or the pool stopped
        del self._spares[kind]
        now = time.monotonic()
        lost, last = self._deaths.get(kind, (0, now))
        lost = 1 if now - last > STABLE_S else lost + 1
        self._deaths[kind] = (lost, now)
        pause_s = 0.0 if lost == 1 else min(DEATH_PAUSE_MAX_S, 2.0 ** (lost - 1))
        logger.warning("standby %s worker died %s (%s); building another%s", kind, when, first_line(cause),
                       f" in {pause_s:.0f} s" if pause_s else "")
        self.refill(kind, pause_s)
        return True

    async def peek(self, kind: str) -> Any | None:
        """The spare of ``kind`` once it is ready, left in the pool (introspection, tests)."""
        task = self._spares.get(kind)
        return None if task is None else await asyncio.shield(task)

    async def take(self, kind: str) -> Any | None:
        """A spare of ``kind`` (None when there is none, or it failed to start)."""
        task = self._spares.pop(kind, None)
        if task is None:
            return None
        self._stop_watch(kind)
        self._deaths.pop(kind, None)
        if kind in self._pausing:   # its spares kept dying: a cold start is sooner than this pause
            task.cancel()
            return None
        try:
            return await task
        except Exception as exc:
            logger.warning("standby %s worker failed to start: %s", kind, first_line(exc))
            return None

    async def stop(self) -> None:
        """Spares still loading are killed; ready ones shut down first (a decode spare unlinks
        its KV pool), then are killed."""
        tasks = list(self._spares.values())
        self._spares.clear()
        for kind in list(self._watches):
            self._stop_watch(kind)
        for task in tasks:
            if not task.done():
                task.cancel()
        spares = [r for r in await asyncio.gather(*tasks, return_exceptions=True) if not isinstance(r, BaseException)]
        await asyncio.gather(*(asyncio.wait_for(s.shutdown.remote(), SHUTDOWN_S) for s in spares),
                             return_exceptions=True)
        for spare in spares:
            ray.kill(spare, no_restart=True)

    def _stop_watch(self, kind: str) -> None:
        watch = self._watches.pop(kind, None)
        if watch is not None:
            watch.cancel()   # the spare's own lifeline call stays pending in it, harmlessly

