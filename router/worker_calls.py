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
Each answer (a reply, a streamed item) tells the slot its actor was alive then (``heard``).
``stream_call`` is ``call`` for a streaming method (an async generator on the actor): a call
re-issued after ``ActorUnavailableError`` skips the items already yielded (the worker replays
them: its streaming methods are idempotent per request id too).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator

from ray.exceptions import ActorUnavailableError, RayActorError

if TYPE_CHECKING:
    from router.registry import WorkerHandle
    from router.stream_drain import StreamDrains

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
    generation = _expected(worker, generation)
    actor = worker.actor
    return await await_ref(worker, generation, lambda: getattr(actor, method).remote(*args), give_up_s)


async def stream_call(worker: WorkerHandle, method: str, *args: Any, generation: int | None = None,
                      give_up_s: float = UNAVAILABLE_GIVE_UP_S, drains: StreamDrains | None = None
                      ) -> AsyncIterator[Any]:
    """The items of the streaming call ``worker.actor.<method>.remote(*args)``, with ``call``'s
    rules. Cancelled while it waits for an item, the call goes to ``drains`` (read to its end
    there: Ray would otherwise keep that wait's callback for ever, router/stream_drain.py)."""
    generation = _expected(worker, generation)
    actor = worker.actor
    num_yielded = 0
    backoff = _Backoff(worker, generation, give_up_s)
    while True:
        stream = getattr(actor, method).remote(*args)
        try:
            num_items = 0
            async for ref in stream:
                item = await ref
                num_items += 1
                worker.heard(generation)
                if num_items > num_yielded:   # a re-issued call replays what was yielded already
                    num_yielded = num_items
                    yield item
            return
        except asyncio.CancelledError:
            if drains is not None:
                drains.take(stream)
            raise
        except ActorUnavailableError as exc:
            await backoff.wait(exc)
        except RayActorError as exc:
            raise _died(worker, generation, exc) from exc


def _expected(worker: WorkerHandle, generation: int | None) -> int:
    """The generation a call is bound to; a worker down or replaced since is a loss already."""
    expected = worker.generation if generation is None else generation
    if not worker.alive or worker.generation != expected:
        raise WorkerLost(worker, expected, f"worker {worker.worker_id} is {worker.state.value} "
                                           f"(generation {worker.generation}, the request was on {expected})")
    return expected


async def await_ref(worker: WorkerHandle, generation: int, make_ref, give_up_s: float = UNAVAILABLE_GIVE_UP_S) -> Any:
    """Await ``make_ref()``; re-issue it while the actor is only unavailable."""
    backoff = _Backoff(worker, generation, give_up_s)
    while True:
        try:
            answer = await make_ref()
            worker.heard(generation)
            return answer
        except ActorUnavailableError as exc:
            await backoff.wait(exc)
        except RayActorError as exc:
            raise _died(worker, generation, exc) from exc


class _Backoff:
    """Waits between re-issues of a call to an unavailable actor; past ``give_up_s`` the
    worker is lost."""

    def __init__(self, worker: WorkerHandle, generation: int, give_up_s: float) -> None:
        self.worker, self.generation, self.give_up_s = worker, generation, give_up_s
        self.deadline = asyncio.get_running_loop().time() + give_up_s
        self.delay = FIRST_BACKOFF_S

    async def wait(self, exc: ActorUnavailableError) -> None:
        if asyncio.get_running_loop().time() + self.delay > self.deadline:
            raise WorkerLost(self.worker, self.generation, f"worker {self.worker.worker_id} unreachable for "
                                                           f"{self.give_up_s:.0f} s: {exc}") from exc
        logger.warning("worker %s temporarily unavailable, retrying in %.2f s", self.worker.worker_id, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(MAX_BACKOFF_S, self.delay * 2)


def _died(worker: WorkerHandle, generation: int, exc: RayActorError) -> WorkerLost:
    return WorkerLost(worker, generation, f"worker {worker.worker_id} died: {short_cause(exc)}")


def short_cause(exc: BaseException) -> str:
    """Ray's death messages carry pages of context; the first line says what happened."""
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
