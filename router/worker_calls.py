"""Calls from the router to a worker's actor, with Ray's failure modes told apart.

A call names its worker slot and is bound to the actor generation it started on:
  - ``ActorUnavailableError`` (the actor may come back: a network blip, a paused process) is
    retried with backoff, up to ``UNAVAILABLE_GIVE_UP_S``; only then is the worker taken as lost.
    Worker methods are idempotent per request id, so a retried call that had already run does
    no harm;
  - ``ActorDiedError`` / any other ``RayActorError``: the actor is gone; the call raises
    ``WorkerLost`` naming the slot and generation, which the orchestrator turns into a request
    migration and the supervisor into a replacement.
Errors the worker raised on purpose (Ray re-raises them as their own type) pass through.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ray.exceptions import ActorUnavailableError, RayActorError

if TYPE_CHECKING:
    from router.registry import WorkerHandle

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
UNAVAILABLE_GIVE_UP_S = 30.0


class WorkerLost(Exception):
    """The actor of ``worker`` at ``generation`` died (or stayed unreachable too long)."""

    def __init__(self, worker: WorkerHandle, generation: int, cause: str) -> None:
        super().__init__(cause)
        self.worker = worker
        self.generation = generation
        self.cause = cause


async def call(worker: WorkerHandle, method: str, *args: Any, generation: int | None = None,
               give_up_s: float = UNAVAILABLE_GIVE_UP_S) -> Any:
    """``worker.actor.<method>.remote(*args)``, awaited, with the rules above. ``generation``:
    the actor the caller's request lives on; if it was replaced meanwhile, that is a loss too."""
    expected = worker.generation if generation is None else generation
    if not worker.alive or worker.generation != expected:
        raise WorkerLost(worker, expected, f"worker {worker.worker_id} is {worker.state.value} "
                                           f"(generation {worker.generation}, the request was on {expected})")
    actor = worker.actor
    generation = expected
    return await await_ref(worker, generation, lambda: getattr(actor, method).remote(*args), give_up_s)


async def await_ref(worker: WorkerHandle, generation: int, make_ref, give_up_s: float = UNAVAILABLE_GIVE_UP_S) -> Any:
    """Await ``make_ref()``; re-issue it while the actor is only unavailable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + give_up_s
    backoff = FIRST_BACKOFF_S
    while True:
        try:
            return await make_ref()
        except ActorUnavailableError as exc:
            if loop.time() + backoff > deadline:
                raise WorkerLost(worker, generation, f"worker {worker.worker_id} unreachable for "
                                                     f"{give_up_s:.0f} s: {exc}") from exc
            logger.warning("worker %s temporarily unavailable, retrying in %.2f s", worker.worker_id, backoff)
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)
        except RayActorError as exc:
            raise WorkerLost(worker, generation, f"worker {worker.worker_id} died: {short_cause(exc)}") from exc


def short_cause(exc: BaseException) -> str:
    """Ray's death messages carry pages of context; the first line says what happened."""
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
