"""Fault injection for tests, by design rather than by luck. Enabled per worker only with
``WorkerSpec.allow_fault_injection``; never on in a served cluster.

Kinds: ``step`` — the next forward raises (the engine fails that batch, keeps serving);
``poison`` — every forward that includes a request whose prompt starts with ``token_id``
raises (the engine retries the batch request by request and fails only that one);
``die`` — the worker process exits at once (a crashed actor).
"""

from __future__ import annotations

import os

from engine.engine import LLMEngine


class InjectedFault(RuntimeError):
    pass


def inject(engine: LLMEngine, kind: str, token_id: int | None = None) -> None:
    if kind == "step":
        execute = engine.runner.execute

        def failing_once(inputs):
            engine.runner.execute = execute
            raise InjectedFault("injected fault in the forward pass")

        engine.runner.execute = failing_once
    elif kind == "poison":
        _poison(engine, token_id)
    elif kind == "die":
        os._exit(1)
    else:
        raise ValueError(f"unknown fault kind {kind!r}")


def _poison(engine: LLMEngine, token_id: int | None) -> None:
    if token_id is None:
        raise ValueError("a poison fault needs the prompt's first token_id")
    prepare = engine.runner.prepare

    def poisoned(out):
        if any(s.request.spec.prompt_token_ids[:1] == (token_id,) for s in out.scheduled):
            raise InjectedFault(f"injected poison: a prompt starting with token {token_id}")
        return prepare(out)

    engine.runner.prepare = poisoned
