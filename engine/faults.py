"""Fault injection for tests, by design rather than by luck. Enabled per worker only with
``WorkerSpec.allow_fault_injection``; never on in a served cluster.

Kinds: ``step`` — the next forward raises (the engine fails that batch, keeps serving);
``die`` — the worker process exits at once (a crashed actor).
"""

from __future__ import annotations

import os

from engine.engine import LLMEngine


class InjectedFault(RuntimeError):
    pass


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
