"""Ray streaming calls whose reader was cancelled while it waited for the next item, read to
their end in the background.

Why: Ray's ``ObjectRefGenerator`` waits for its next item by awaiting that item's ObjectRef,
which registers a completion callback in the core worker (holding the ref, a
``concurrent.futures.Future`` with its lock and condition, the asyncio future). Cancel the
reader there and drop the generator, and the core worker deletes the stream: the item is never
reported, the callback never runs, and all of it stays for the life of the process (found by
``benchmarks/probe_soak.py``: ~0.2 leaked refs and ~14 objects per request under a mix with
cancels, drops and deadlines; a client that cancels after its first token leaked the prefill
call's second item every time). Kept alive until the worker ends the stream (at once, for a
request the router aborts; with an error, for a dead worker), the item arrives, the callback
runs, and everything is freed.

Life cycle (one ``StreamDrains`` per router, the orchestrator's): ``take(stream)`` (the reader's
``except CancelledError``) -> a task iterates the
stream to its end, its items unread, bounded by ``DRAIN_BOUND_S`` (a worker that never ends it:
a hung process, until the stall watch replaces it) -> the task leaves ``num_draining``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

DRAIN_BOUND_S = 120.0


class StreamDrains:
    """The router's drains, one owner: the tasks reading abandoned streams to their end."""

    def __init__(self, bound_s: float = DRAIN_BOUND_S) -> None:
        self.bound_s = bound_s
        self._tasks: set[asyncio.Task] = set()

    def take(self, stream: Any) -> None:
        """Read ``stream`` (a Ray ``ObjectRefGenerator``) to its end in the background."""
        task = asyncio.get_running_loop().create_task(self._drain(stream), name="stream-drain")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def num_draining(self) -> int:
        return len(self._tasks)

    async def _drain(self, stream: Any) -> None:
        try:
            async with asyncio.timeout(self.bound_s):
                async for _ in stream:   # each item's ref awaited by Ray itself: its callback runs
                    pass
        except TimeoutError:
            logger.warning("a streaming call abandoned by its reader did not end in %.0f s", self.bound_s)
        except Exception:   # noqa: BLE001 - the worker's failure: its reader is gone, the stream is over
            pass

