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

A stall shorter than the timeout is not silent: a turn that has run ``WARN_SHARE`` of the
timeout, or a heartbeat that long unanswered, is one WARNING (per turn, per silence) and its end
one INFO line saying how long it lasted, so a slow step or a pause that recovered on its own is
in the log beside the latency it cost (found by review: a 50 s step under a 60 s timeout left no
trace but its clients' TTFTs).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import TYPE_CHECKING, Callable

from ray.exceptions import ActorUnavailableError, RayActorError

if TYPE_CHECKING:
    from router.registry import WorkerHandle

MAX_PERIOD_S = 5.0
WARN_SHARE = 0.5   # a stall this share of the timeout long is logged, whether or not it ends

logger = logging.getLogger(__name__)


class Stall(enum.Enum):
    """Why a live worker was taken as hung."""

    LONG_TURN = "its engine loop has run one turn (a step, or calls on the engine) for too long"
    NO_ANSWER = "it answered no heartbeat (a frozen process, or a blocked event loop)"


OnStalled = Callable[["WorkerHandle", int, Stall, float], None]   # worker, generation, why, seconds


async def watch_stalls(worker: WorkerHandle, generation: int, timeout_s: float, on_stalled: OnStalled) -> None:
    period_s = min(MAX_PERIOD_S, timeout_s / 4)
    slow = _SlowSpells(worker.worker_id, timeout_s)
    actor = worker.actor
    answered = time.monotonic()
    while worker.generation == generation and worker.alive:
        try:
            turn_s = await _answer(actor, answered, timeout_s, slow)
        except TimeoutError:
            if worker.generation == generation and worker.alive:
                on_stalled(worker, generation, Stall.NO_ANSWER, time.monotonic() - answered)
            return
        except ActorUnavailableError:
            await asyncio.sleep(min(period_s, max(0.0, answered + timeout_s - time.monotonic())))
            continue
        except RayActorError:
            return   # died: the lifeline reports it
        slow.answered(time.monotonic() - answered)
        answered = time.monotonic()
        worker.heard(generation)
        if turn_s >= timeout_s:
            if worker.generation == generation and worker.alive:
                on_stalled(worker, generation, Stall.LONG_TURN, turn_s)
            return
        slow.turn(turn_s)
        await asyncio.sleep(period_s)


async def _answer(actor, answered: float, timeout_s: float, slow: _SlowSpells) -> float:
    """The next heartbeat, waited for until ``timeout_s`` past the last answer (TimeoutError
    after); a wait past the warning point is said once, on the way."""
    beat = asyncio.ensure_future(_heartbeat(actor))
    try:
        warn_at = answered + WARN_SHARE * timeout_s
        if not slow.silent and warn_at > time.monotonic():
            await asyncio.wait({beat}, timeout=warn_at - time.monotonic())
        if not beat.done():
            slow.silence(time.monotonic() - answered)
        return await asyncio.wait_for(asyncio.shield(beat), timeout=max(0.0, answered + timeout_s - time.monotonic()))
    finally:
        beat.cancel()


class _SlowSpells:
    """One worker's slow turns and silences as the watch sees them: each logged once as it passes
    ``WARN_SHARE`` of the timeout, and once more as it ends."""

    def __init__(self, worker_id: str, timeout_s: float) -> None:
        self.worker_id, self.timeout_s = worker_id, timeout_s
        self.silent = False          # a heartbeat unanswered past the warning point, said
        self._slow_turn_s = 0.0      # the turn said to be slow, as long as last seen (0: none)

    def silence(self, waited_s: float) -> None:
        if not self.silent:
            self.silent = True
            logger.warning("worker %s has answered no heartbeat for %.1f s (it is replaced at %g s: "
                           "--worker-stall-timeout)", self.worker_id, waited_s, self.timeout_s)

    def answered(self, waited_s: float) -> None:
        if self.silent:
            self.silent = False
            logger.info("worker %s answered its heartbeat again after %.1f s", self.worker_id, waited_s)

    def turn(self, turn_s: float) -> None:
        if self._slow_turn_s and turn_s < self._slow_turn_s:
            logger.info("worker %s's slow engine turn ended (it ran at least %.1f s)", self.worker_id, self._slow_turn_s)
            self._slow_turn_s = 0.0
        if self._slow_turn_s:
            self._slow_turn_s = turn_s
        elif turn_s >= WARN_SHARE * self.timeout_s:
            self._slow_turn_s = turn_s
            logger.warning("worker %s's engine turn (a step, or calls on the engine) has run %.1f s (it is "
                           "replaced at %g s: --worker-stall-timeout)", self.worker_id, turn_s, self.timeout_s)


async def _heartbeat(actor) -> float:
    return await actor.heartbeat.remote()
