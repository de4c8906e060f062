"""The receiving end of ``engine.unix_push``: a unix-socket server in a private directory that
hands each whole line it receives to a callback (torch-free: the router uses it too).

Users: the router's ``FirstTokenInbox`` (first tokens from the prefill workers on its node) and
a prefill worker's ``SubmissionServer`` (prefill calls straight from the router). Both channels
are best effort beside Ray, so a connection that fails is only logged.

Life cycle: ``start`` (in the owner's event loop: a fresh directory of mode 0700, so only this
user can connect, and the server in it; returns the socket's path) -> each line that ends in a
newline goes to ``on_line`` (a line cut at EOF, a partial write of a pusher that gave up, is
dropped: never half a message) -> ``close`` (server and connections down, directory removed;
``wait_closed`` then waits for the server, bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from typing import Callable

logger = logging.getLogger(__name__)

WAIT_CLOSED_S = 2.0


class UnixLineServer:
    def __init__(self, dir_prefix: str, socket_name: str, on_line: Callable[[bytes], None],
                 max_line_bytes: int) -> None:
        self.path: str | None = None
        self._dir_prefix = dir_prefix
        self._socket_name = socket_name
        self._on_line = on_line
        self._max_line_bytes = max_line_bytes
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._dir = tempfile.mkdtemp(prefix=self._dir_prefix)   # mode 0700: only this user connects
        self.path = os.path.join(self._dir, self._socket_name)
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=self._max_line_bytes)
        return self.path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection per pusher, for its life."""
        self._connections.add(writer)
        try:
            while line := await reader.readline():
                if line.endswith(b"\n"):
                    self._on_line(line)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as exc:
            logger.debug("%s: connection dropped: %s", self._socket_name, exc)
        except asyncio.CancelledError:
            # Cancelled at a stop whose peers died without closing (a group SIGTERM): end quietly.
            # Python 3.11's stream server reads a cancelled handler's exception in its done
            # callback and logs an ERROR with a traceback for it.
            pass
        finally:
            self._connections.discard(writer)
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):   # before 3.12 the server's close leaves them open
            writer.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def wait_closed(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), WAIT_CLOSED_S)
