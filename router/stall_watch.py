"""Notices a worker that is alive but no longer serving: a hung engine step (a deadlock, a
collective waiting on a lost peer, a wedged device) or a frozen process (stopped, or its event
loop blocked). The lifeline never reports these, as nothing died, and without this check every
request on such a worker would wait for its client's deadline while new ones kept coming.

Life cycle: the supervisor starts ``watch_stalls`` for every actor generation it watches. Every
``period`` (a quarter of the timeout, at most ``MAX_PERIOD_S``) it asks the actor for its
``heartbeat``: how long its engine loop's current turn has run (0 while it waits for work). A
worker whose turn has run ``timeout_s``, or that answered no heartbeat for ``timeout_s``, is
reported once through ``on_stalled`` (the supervisor kills it and replaces it; its requests
migrate, as after a crash). A worker only unreachable for a moment (``ActorUnavailableError``) is
asked again until its time is up; one that died is the lifeline's to report. The watch ends
when its generation is replaced or goes down.
"""

from __future__ import annotations

import asyncio
import enum
import time
from typing import TYPE_CHECKING, Callable

from ray.exceptions import ActorUnavailableError, RayActorError

if TYPE_CHECKING:
    from router.registry import WorkerHandle

MAX_PERIOD_S = 5.0


class Stall(enum.Enum):
    """Why a live worker was taken as hung."""

    LONG_TURN = "its engine loop has run one turn (a step, or calls on the engine) for too long"
    NO_ANSWER = "it answered no heartbeat (a frozen process, or a blocked event loop)"


OnStalled = Callable[["WorkerHandle", int, Stall, float], None]   # worker, generation, why, seconds


async def watch_stalls(worker: WorkerHandle, generation: int, timeout_s: float, on_stalled: OnStalled) -> None:
    period_s = min(MAX_PERIOD_S, timeout_s / 4)
    actor = worker.actor
    answered = time.monotonic()
    while worker.generation == generation and worker.alive:
        left_s = answered + timeout_s - time.monotonic()
        try:
            turn_s = await asyncio.wait_for(_heartbeat(actor), timeout=max(0.0, left_s))
        except TimeoutError:
            if worker.generation == generation and worker.alive:
                on_stalled(worker, generation, Stall.NO_ANSWER, time.monotonic() - answered)
            return
        except ActorUnavailableError:
            await asyncio.sleep(min(period_s, max(0.0, left_s)))
            continue
        except RayActorError:
            return   # died: the lifeline reports it
        answered = time.monotonic()
        worker.heard(generation)
        if turn_s >= timeout_s:
            if worker.generation == generation and worker.alive:
                on_stalled(worker, generation, Stall.LONG_TURN, turn_s)
            return
        await asyncio.sleep(period_s)


async def _heartbeat(actor) -> float:
    return await actor.heartbeat.remote()
