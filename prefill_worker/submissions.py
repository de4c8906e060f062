"""A prefill worker's door for prefill calls straight from the router on its node: a unix
socket beside Ray, best effort (``engine.types.PrefillSubmission``).

Why: a Ray actor call reaching the worker is the largest piece of the first token's path left
outside the engine (~2 ms on a quiet machine, ~7 ms at load 3.6: benchmarks/results/
disagg_overhead.txt); a line on a unix socket takes ~0.4 ms. The router writes the submission
here and then makes the same call on Ray as always; the worker starts the request on
whichever arrives first and the other joins it (its calls are idempotent per request id), so
Ray's call still delivers the result and reports a dead worker exactly as before. A line lost
or refused costs only the speed-up.

Life cycle: ``start`` (a unix server in the worker's event loop, in a private directory: only
this user can connect) -> each line is decoded and handed to ``on_submit`` (a line that does
not decode is dropped) -> ``close`` (server and connections down, directory removed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import Callable

from engine.types import PrefillSubmission

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 << 20   # a 128k-token prompt as JSON is ~1 MB


class SubmissionServer:
    def __init__(self, on_submit: Callable[[PrefillSubmission], None]) -> None:
        self.on_submit = on_submit
        self.path: str | None = None
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._dir = tempfile.mkdtemp(prefix="pdserve-submit-")   # mode 0700
        self.path = os.path.join(self._dir, "prefill.sock")
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=MAX_LINE_BYTES)
        return self.path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection per router, for its life."""
        self._connections.add(writer)
        try:
            while line := await reader.readline():
                self._submit(line)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            logger.debug("submission connection dropped: %s", exc)
        finally:
            self._connections.discard(writer)
            writer.close()

    def _submit(self, line: bytes) -> None:
        if not line.endswith(b"\n"):   # cut at EOF (a partial write): never half a request
            return
        try:
            submission = PrefillSubmission.from_json(line)
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("unreadable prefill submission dropped: %s", exc)
            return
        self.on_submit(submission)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
