"""Keeps every worker slot served: notices a dead actor at once and replaces it.

Life cycle of a slot here: ``watch`` awaits the actor's ``lifeline`` call, which returns only
at shutdown, so a crash (kill -9, OOM, a node lost) fails it within Ray's death notice, with
no polling. Any report of a loss (the lifeline, a decode stream, a failed request call) goes
through ``worker_lost``; the first one for a generation marks the slot RESTARTING (the router
routes around it at once), reports it (``on_down``: health, metrics), and starts ``_restart``:
kill what is left of the old actor, unlink its /dev/shm KV pool, wait the backoff, start a
fresh actor (fresh engine, fresh pool, via ``spawn``), install it as the next generation and
report it (``on_ready``: its stream, health, queued requests). Repeated crashes back off
exponentially, so a worker that crashes on start cannot cause a restart storm; a slot whose
lost generation served (ran engine steps: its model loads and runs) or stayed up ``STABLE_S``
after it was ready starts over at no delay; ``max_restarts`` (None: no limit) gives up on a
slot, which then stays DEAD. Once ``stop`` began, a lost slot goes DEAD at once (no restart).
A worker alive but hung (``router.stall_watch``: a step that never ends, a frozen process) is
``worker_stalled``: killed at once (SIGKILL where its process is on this node: Ray's own kill
waits out a grace period a frozen process never uses) and then lost like a crashed one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Awaitable, Callable

import ray

from router.registry import WorkerHandle, WorkerRegistry
from router.stall_watch import Stall, watch_stalls
from router.task_ending import cancel_and_wait
from router.worker_calls import WorkerLost, await_ref

logger = logging.getLogger(__name__)

FIRST_RETRY_S = 1.0     # the second crash in a row waits this long, then doubling
MAX_BACKOFF_S = 30.0
# Up this long since it was ready, or served at all: the next crash restarts at once. A crash
# loop (a worker dying at start, or at its first forward, before any step) backs off; one that
# served and was then killed (OOM, a node's preemption, kill -9) is not a loop, however soon:
# with the time rule alone, at 60 s a kill every 17 s grew the delay to 16 s
# (benchmarks/results/chaos-every-17s.txt), and at 10 s a decode worker killed every 10 s waited
# 1, 2, 4 ... 30 s while every request failed (benchmarks/results/chaos-every-5s.txt). A request
# that kills every worker it runs on is ended by the orchestrator's migration limit.
STABLE_S = 10.0
STOP_S = 5.0            # for its tasks to end at a stop

Spawn = Callable[[WorkerHandle], Awaitable[tuple[object, dict]]]


class Supervisor:
    def __init__(self, registry: WorkerRegistry, spawn: Spawn, *, on_down: Callable[[WorkerHandle], None],
                 on_ready: Callable[[WorkerHandle], None], max_restarts: int | None = None,
                 stall_timeout_s: float | None = None, local_node_id: str | None = None,
                 on_stalled: Callable[[WorkerHandle], None] | None = None) -> None:
        self.registry = registry
        self._spawn = spawn
        self._on_down = on_down
        self._on_ready = on_ready
        self._on_stalled = on_stalled
        self.max_restarts = max_restarts
        self.stall_timeout_s = stall_timeout_s   # None: hung workers are not looked for
        self._local_node_id = local_node_id     # the router's node: its workers' pids are ours to kill
        self._tasks: set[asyncio.Task] = set()
        self._backoff: dict[str, float] = {}        # worker id -> the delay its next restart waits
        self._up_since: dict[str, float] = {}
        self._stopping = False

    def start(self) -> None:
        for worker in self.registry.all:
            self.watch(worker)

    def watch(self, worker: WorkerHandle) -> None:
        self._up_since[worker.worker_id] = time.monotonic()
        self._spawn_task(self._lifeline(worker, worker.generation), f"lifeline-{worker.worker_id}")
        if self.stall_timeout_s:
            self._spawn_task(watch_stalls(worker, worker.generation, self.stall_timeout_s, self.worker_stalled),
                             f"stalls-{worker.worker_id}")

    async def _lifeline(self, worker: WorkerHandle, generation: int) -> None:
        actor = worker.actor
        try:
            await await_ref(worker, generation, lambda: actor.lifeline.remote(), give_up_s=float("inf"))
        except WorkerLost as lost:
            self.worker_lost(lost)

    def worker_lost(self, lost: WorkerLost) -> None:
        """Any component that saw ``lost.worker``'s actor fail reports it here."""
        worker = lost.worker
        if self._stopping:
            self._lost_while_stopping(lost)
            return
        if not worker.mark_down(lost.generation):
            return
        logger.error("worker %s (generation %d, %s) lost: %s", worker.worker_id, lost.generation,
                     _pid(worker.pid), lost.cause)
        if worker.role != "colocated" and self.registry.dist_ready:
            self.registry.lose_kv_group()
        self._on_down(worker)
        self._spawn_task(self._restart(worker, worker.actor, worker.shm_path, worker.served),
                         f"restart-{worker.worker_id}")

    def worker_stalled(self, worker: WorkerHandle, generation: int, stall: Stall, seconds: float) -> None:
        """``worker``'s actor of ``generation`` is alive but hung: kill it, then replace it as lost."""
        if generation != worker.generation or not worker.alive:
            return
        cause = f"worker {worker.worker_id} hung ({seconds:.1f} s): {stall.value}"
        logger.error("%s; killing it", cause)
        if worker.pid and self._local_node_id is not None and worker.node_id == self._local_node_id:
            _kill_pid(worker.pid)   # alive (it is hung, not dead), so the pid is still its own
        if self._on_stalled is not None:
            self._on_stalled(worker)
        self.worker_lost(WorkerLost(worker, generation, cause))

    def _lost_while_stopping(self, lost: WorkerLost) -> None:
        """No replacement comes, but the slot must not read as serving: requests in flight would
        migrate onto the dead actor again and again, and fail naming the migration limit, not
        the stop."""
        worker = lost.worker
        if lost.generation == worker.generation and worker.alive:
            logger.info("worker %s lost while the cluster stops: %s", worker.worker_id, lost.cause)
            worker.mark_dead()
            self._on_down(worker)

    async def _restart(self, worker: WorkerHandle, old_actor, old_shm: str | None, served: bool) -> None:
        _kill(old_actor)
        _unlink(old_shm)
        if self.max_restarts is not None and worker.restarts >= self.max_restarts:
            logger.error("worker %s: restart limit (%d) reached; it stays down", worker.worker_id, self.max_restarts)
            worker.mark_dead()
            self._on_down(worker)
            return
        await asyncio.sleep(self._next_delay(worker.worker_id, served))
        while not self._stopping:
            started = time.monotonic()
            try:
                actor, info = await self._spawn(worker)
                break
            except Exception as exc:
                logger.error("worker %s failed to start: %s", worker.worker_id, exc)
                await asyncio.sleep(self._next_delay(worker.worker_id))
        else:
            return
        worker.replace(actor, info)
        self.registry.forget_pairs(worker)
        logger.warning("worker %s replaced (generation %d, restart %d) in %.1f s by %s", worker.worker_id,
                       worker.generation, worker.restarts, time.monotonic() - started, replacement(info))
        self.watch(worker)
        self._on_ready(worker)

    def _next_delay(self, worker_id: str, served: bool = False) -> float:
        """0 after a generation that served or ran ``STABLE_S``; then 1 s, 2 s, 4 s ... up to ``MAX_BACKOFF_S``."""
        if served or time.monotonic() - self._up_since.get(worker_id, 0.0) >= STABLE_S:
            self._backoff.pop(worker_id, None)
        delay = self._backoff.get(worker_id, 0.0)
        self._backoff[worker_id] = min(MAX_BACKOFF_S, max(FIRST_RETRY_S, 2 * delay))
        self._up_since[worker_id] = time.monotonic()   # a failed start is not a stable run either
        return delay

    def _spawn_task(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Ends every watch and restart (bounded: a task that swallowed its cancel is cancelled
        again, ``router.task_ending``; one still running after ``STOP_S`` is left, named)."""
        self._stopping = True
        pending = await cancel_and_wait(self._tasks, STOP_S)
        if pending:
            logger.warning("supervisor: %d task(s) did not end: %s", len(pending),
                           ", ".join(sorted(t.get_name() for t in pending)))


def _pid(pid: int | None) -> str:
    return f"pid {pid}" if pid else "pid unknown"


def replacement(info: dict) -> str:
    """What took a slot, for the log: a warm spare's start-up phases ran long before the loss
    (printing them as the replacement's own read as a 20 s restart that took 0.0 s)."""
    if info.get("standby"):
        return f"a warm spare ({_pid(info.get('pid'))})"
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in info.get("startup_s", {}).items())
    return f"a cold start ({_pid(info.get('pid'))}{': ' + phases if phases else ''})"


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already gone
        logger.debug("kill of a dead actor: %s", exc)


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError) as exc:
        logger.warning("kill of hung worker process %d: %s", pid, exc)


def _unlink(path: str | None) -> None:
    """The dead worker never unlinked its KV pool; a replacement gets a file of its own."""
    if path:
        try:
            os.unlink(path)
            logger.info("unlinked %s", path)
        except FileNotFoundError:
            pass
