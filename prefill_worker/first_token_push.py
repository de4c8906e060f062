"""The prefill worker's side of the router's first-token inbox (``router/first_token_inbox.py``):
best effort, never on the critical path of correctness.

Life cycle: ``push(path, first)`` writes one JSON line on the connection to that inbox (opened
on first use, one per router, kept for the worker's life; a write on an open connection goes
out at once, without an event-loop hop) -> a connection that fails is dropped and reopened by
the next push; the token it carried still reaches the router on the Ray stream -> ``close``.
"""

from __future__ import annotations

import asyncio
import logging

from engine.types import FirstToken

logger = logging.getLogger(__name__)


class FirstTokenPusher:
    def __init__(self) -> None:
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()

    def push(self, path: str, first: FirstToken) -> None:
        writer = self._writers.get(path)
        if writer is not None and not writer.is_closing():
            self._write(path, writer, first)
            return
        task = asyncio.ensure_future(self._open_and_push(path, first))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_and_push(self, path: str, first: FirstToken) -> None:
        async with self._opening.setdefault(path, asyncio.Lock()):   # one connection per inbox
            writer = self._writers.get(path)
            if writer is None or writer.is_closing():
                try:
                    _, writer = await asyncio.open_unix_connection(path)
                except OSError as exc:
                    logger.debug("first-token inbox %s unreachable: %s", path, exc)
                    return
                self._writers[path] = writer
        self._write(path, writer, first)

    def _write(self, path: str, writer: asyncio.StreamWriter, first: FirstToken) -> None:
        try:
            writer.write(first.to_json())
        except (OSError, RuntimeError) as exc:
            logger.debug("first-token inbox %s: write failed: %s", path, exc)
            self._writers.pop(path, None)
            writer.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
