"""Runs an LLMEngine in its own thread: the worker's continuous-batching loop.

Life cycle: ``start`` spawns the loop thread; callers (Ray actor methods on an event loop)
``call`` a function on the engine, which runs on the loop thread at the next step boundary —
so the engine is only ever touched by one thread — and get a concurrent future back. The
thread steps while the engine has work and otherwise blocks on a condition (no sleep
polling); a step that could schedule nothing (every waiting request's grammar still compiling,
or its blocks held by parked requests) also blocks, until a call or a finished compile
(``Grammars.on_compiled``) wakes it, or ``STALLED_WAIT_S`` passes. Every step's result goes to ``on_step`` (the worker's batched output stream); calls
that leave the engine idle send an empty ``StepResult(between_steps=True)`` so the fresh stats
(blocks released between steps) are published too. ``latest_stats`` is refreshed before a
call's future resolves.
``turn_s`` says how long the loop's current turn (a batch of calls and a step) has run, 0
while it waits for work: the router's stall watchdog reads it through the worker's
``heartbeat`` to tell a hung step (a deadlock, a collective waiting on a lost peer) from a
busy one. ``stop`` ends the thread after the current step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, TypeVar

from engine.engine import LLMEngine, StepResult
from engine.types import WorkerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")
STALLED_WAIT_S = 0.05   # a stalled engine's longest wait without a wake-up (none should be missed)


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepResult], None], name: str = "engine-loop") -> None:
        self.engine = engine
        self._on_step = on_step
        self._calls: deque[tuple[Callable[[LLMEngine], object], Future]] = deque()
        self._wake = threading.Condition()
        self._stopped = False
        self._nudged = False   # a grammar compiled since the loop last looked
        self._turn_started: float | None = None   # monotonic; None while waiting (the loop thread writes it)
        engine.grammars.on_compiled = self._nudge
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # Published after every step and batch of calls: other threads read it without locks
        # (one reference assignment), at most one step stale.
        self.latest_stats: WorkerStats = engine.stats(name)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread before the next step."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopped:
                future.set_exception(RuntimeError("engine loop stopped"))
                return future
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def turn_s(self) -> float:
        """Seconds the current turn has run; 0 while the loop waits for work. Any thread may read it."""
        started = self._turn_started
        return 0.0 if started is None else time.monotonic() - started

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._stopped and not self._calls and not self.engine.has_work():
                    self._turn_started = None
                    while not self._stopped and not self._calls and not self.engine.has_work():
                        self._wake.wait()
                if self._stopped:
                    break
                calls, self._calls = self._calls, deque()
            self._turn_started = time.monotonic()
            self._apply(calls)
            if self.engine.has_work():
                if self._step().stalled:
                    self._wait_while_stalled()
            elif calls:
                self._report_between_steps()
        self._fail_pending()

    def _nudge(self) -> None:
        with self._wake:
            self._nudged = True
            self._wake.notify()

    def _wait_while_stalled(self) -> None:
        with self._wake:
            if not (self._stopped or self._calls or self._nudged):
                self._wake.wait(STALLED_WAIT_S)
            self._nudged = False

    def _apply(self, calls) -> None:
        if not calls:   # nothing changed: the last step's stats stand (computed once per turn)
            return
        outcomes = []
        for fn, future in calls:
            try:
                outcomes.append((future, fn(self.engine), None))
            except BaseException as exc:  # the caller gets the error; the loop keeps going
                outcomes.append((future, None, exc))
        # Stats first: a caller that reads them once its call returns (a prefill worker after
        # releasing blocks) must see the blocks released.
        self.latest_stats = self.engine.stats(self._thread.name)
        for future, result, exc in outcomes:
            if exc is None:
                future.set_result(result)
            else:
                future.set_exception(exc)

    def _report_between_steps(self) -> None:
        """Calls changed the engine (blocks released, a parked request aborted) and no step
        follows to report it: an empty result tells ``on_step`` to publish the fresh stats."""
        try:
            self._on_step(StepResult(between_steps=True, kv_events=self.engine.take_kv_events()))
        except Exception:
            logger.exception("on_step callback failed")

    def _step(self) -> StepResult:
        result = self.engine.step()
        self.latest_stats = self.engine.stats(self._thread.name)  # before on_step: batches carry fresh stats
        try:
            self._on_step(result)
        except Exception:
            logger.exception("on_step callback failed")
        return result

    def _fail_pending(self) -> None:
        with self._wake:
            calls, self._calls = self._calls, deque()
        for _, future in calls:
            future.set_exception(RuntimeError("engine loop stopped"))
