"""The router's event loop: uvloop's where it is installed, asyncio's own otherwise.

Why: the router's CPU at scale is mostly grpc.aio's write path and the event loop itself
(benchmarks/results/router_scale.txt); on libuv's loop a bare grpc.aio server spends ~25% less
CPU per streamed message than on asyncio's selector loop (benchmarks/results/grpc_floor.txt,
same run), as uvicorn and vLLM's API server choose it for the same reason. Everything the router
runs on its loop works on both (grpc.aio, Ray's awaitable refs, uvicorn, unix-socket servers,
signal handlers): the tests run the router on the loop this module picks.

``PDSERVE_EVENT_LOOP`` (or ``pdserve serve --event-loop``): ``auto`` (default: uvloop when
importable), ``uvloop`` (an error if it is not installed), ``asyncio``.

Life cycle: ``new_event_loop(kind)`` makes a loop for a thread of its own (the launcher's
``ClusterThread``); ``run(coro, kind)`` runs a coroutine to completion on a fresh loop and
closes it (``pdserve serve``), as ``asyncio.run`` does.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import os
from typing import Any, Coroutine

ENV_VAR = "PDSERVE_EVENT_LOOP"


class LoopKind(enum.Enum):
    AUTO = "auto"
    UVLOOP = "uvloop"
    ASYNCIO = "asyncio"


def resolve(kind: LoopKind | str | None = None) -> LoopKind:
    """The loop to make: ``kind``, else ``PDSERVE_EVENT_LOOP``, else auto; auto picks uvloop if installed."""
    if kind is None:
        kind = os.environ.get(ENV_VAR, LoopKind.AUTO.value)
    try:
        kind = LoopKind(kind)
    except ValueError:
        raise ValueError(f"{ENV_VAR} / --event-loop: {kind!r} is not one of "
                         f"{', '.join(k.value for k in LoopKind)}") from None
    if kind is LoopKind.AUTO:
        return LoopKind.UVLOOP if importlib.util.find_spec("uvloop") is not None else LoopKind.ASYNCIO
    return kind


def new_event_loop(kind: LoopKind | str | None = None) -> asyncio.AbstractEventLoop:
    if resolve(kind) is LoopKind.UVLOOP:
        import uvloop   # ModuleNotFoundError names the missing package when uvloop was asked for
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, Any], kind: LoopKind | str | None = None) -> Any:
    """``asyncio.run`` on the chosen loop."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(kind)) as runner:
        return runner.run(coro)
