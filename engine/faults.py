"""Fault injection for tests, by design rather than by luck. Enabled per worker only with
``WorkerSpec.allow_fault_injection``; never on in a served cluster.

Kinds (``FaultKind``): ``step`` — the next forward raises (the engine fails that batch, keeps serving);
``poison`` — every forward that includes a request whose prompt starts with ``token_id``
raises (the engine retries the batch request by request and fails only that one);
``die`` — the worker process exits at once (a crashed actor); ``hang_step`` — the next forward
never returns (a deadlocked step: the router's stall watch must kill the worker); ``hang_shutdown`` — the worker's
``shutdown()`` never returns and blocks its process (a wedged worker: the launcher's bounded
stop must kill it). ``hang_shutdown`` is the worker's (``WorkerBase.inject_fault``), the others
the engine's.
"""

from __future__ import annotations

import enum
import os
import threading

from engine.engine import LLMEngine


class FaultKind(enum.StrEnum):
    """What ``inject_fault`` does: the engine's, the worker's, or the prefill worker's next
    hand-off's (``KV_SEND`` fails it: the router recomputes; ``HANG_KV_SEND`` never starts the
    write: a worker that dies mid-hand-off, once killed). A StrEnum so a test's Ray call may
    name it as text; an unknown name is a ValueError."""

    STEP = "step"
    POISON = "poison"
    DIE = "die"
    HANG_STEP = "hang_step"
    HANG_SHUTDOWN = "hang_shutdown"
    KV_SEND = "kv_send"
    HANG_KV_SEND = "hang_kv_send"


ENGINE_FAULTS = (FaultKind.STEP, FaultKind.POISON, FaultKind.DIE, FaultKind.HANG_STEP)
SEND_FAULTS = (FaultKind.KV_SEND, FaultKind.HANG_KV_SEND)


class InjectedFault(RuntimeError):
    pass


def wedge() -> None:
    """Block the calling thread for good (``hang_shutdown``): only killing the process ends it."""
    threading.Event().wait()


def inject(engine: LLMEngine, kind: FaultKind | str, token_id: int | None = None) -> None:
    kind = FaultKind(kind)
    if kind is FaultKind.STEP:
        execute = engine.runner.execute

        def failing_once(inputs):
            engine.runner.execute = execute
            raise InjectedFault("injected fault in the forward pass")

        engine.runner.execute = failing_once
    elif kind is FaultKind.POISON:
        _poison(engine, token_id)
    elif kind is FaultKind.DIE:
        os._exit(1)
    elif kind is FaultKind.HANG_STEP:
        def hung(inputs):
            wedge()

        engine.runner.execute = hung
    else:
        raise ValueError(f"{kind} is not a fault of the engine")


def _poison(engine: LLMEngine, token_id: int | None) -> None:
    if token_id is None:
        raise ValueError("a poison fault needs the prompt's first token_id")
    prepare = engine.runner.prepare

    def poisoned(out):
        if any(s.request.spec.prompt_token_ids[:1] == (token_id,) for s in out.scheduled):
            raise InjectedFault(f"injected poison: a prompt starting with token {token_id}")
        return prepare(out)

    engine.runner.prepare = poisoned
