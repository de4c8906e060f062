"""Fault injection for tests, by design rather than by luck. Enabled per worker only with
``WorkerSpec.allow_fault_injection``; never on in a served cluster.

Kinds: ``step`` — the next forward raises (the engine fails that batch, keeps serving);
``die`` — the worker process exits at once (a crashed actor); ``hang_shutdown`` — the worker's
``shutdown()`` never returns and blocks its process (a wedged worker: the launcher's bounded
stop must kill it). ``hang_shutdown`` is the worker's (``WorkerBase.inject_fault``), the others
the engine's.
"""

from __future__ import annotations

import os
import threading

from engine.engine import LLMEngine


HANG_SHUTDOWN = "hang_shutdown"


class InjectedFault(RuntimeError):
    pass


def wedge() -> None:
    """Block the calling thread for good (``hang_shutdown``): only killing the process ends it."""
    threading.Event().wait()


def inject(engine: LLMEngine, kind: str) -> None:
    if kind == "step":
        execute = engine.runner.execute

        def failing_once(inputs):
            engine.runner.execute = execute
            raise InjectedFault("injected fault in the forward pass")

        engine.runner.execute = failing_once
    elif kind == "die":
        os._exit(1)
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
