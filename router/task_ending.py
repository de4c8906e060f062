"""Ending asyncio tasks for good: cancel, wait, and cancel again what swallowed the cancel.

Why: on Python 3.11 ``asyncio.wait_for`` returns its inner result when that completes in the
same loop turn as a cancel of the waiting task, and the cancel is lost (fixed in 3.12). A task
that loops on such waits (a heartbeat, a stream read) then runs on after ``cancel()``, and a
plain ``gather`` of it never returns: a failed start once hung its stop forever in the
supervisor's stall watch. Every component that owns tasks ends them here, bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_S = 0.2   # how long a cancelled task may take before it is cancelled again


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout_s: float) -> set[asyncio.Task]:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end, cancelling again those that
    went on; returns the ones still running then (empty: all ended)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    while pending and (left := deadline - loop.time()) > 0:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(left, RECANCEL_S))
    return pending
