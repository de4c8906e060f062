"""The prefill worker's side of the router's first-token inbox (``router/first_token_inbox.py``):
best effort, never on the critical path of correctness.

Life cycle: ``push(path, first)`` writes one JSON line on the connection to that inbox (opened
on first use, one per router, kept for the worker's life) and says whether it went out whole ->
a connection that fails (or whose write would block or went out in part) is dropped and
reopened by the next push; the caller then sends the token the other way (the Ray stream) ->
``close``.

Plain non-blocking sockets under a lock, not asyncio: the engine loop thread pushes a first
token the moment its step ends (no hop to the event loop on the first token's path), the
event loop pushes one whose reservation held only later. "Went out" means it is in the
router's receive buffer (a unix socket refuses a write to a closed peer at once), so the
worker may leave the token off its Ray stream: the result carries it anyway, so a line that
is lost after all costs latency, never correctness. A write never blocks the engine thread:
one that would is a failed push.
"""

from __future__ import annotations

import logging
import socket
import threading

from engine.types import FirstToken

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 0.05   # a local unix socket: connect is immediate or the inbox is gone


class FirstTokenPusher:
    def __init__(self) -> None:
        self._lock = threading.Lock()   # the engine thread and the event loop both push
        self._socks: dict[str, socket.socket] = {}

    def push(self, path: str, first: FirstToken) -> bool:
        """True once ``first`` is whole in the inbox's receive buffer."""
        line = first.to_json()
        with self._lock:
            sock = self._socks.get(path) or self._connect(path)
            if sock is None:
                return False
            try:
                if sock.send(line) == len(line):
                    return True
            except OSError as exc:   # the router closed it (EPIPE), or its buffer is full (EAGAIN)
                logger.debug("first-token inbox %s: write failed: %s", path, exc)
            self._drop(path)   # a partial line ends at EOF: the inbox drops it unread
            return False

    def _connect(self, path: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(path)
            sock.setblocking(False)
        except OSError as exc:
            logger.debug("first-token inbox %s unreachable: %s", path, exc)
            sock.close()
            return None
        self._socks[path] = sock
        return sock

    def _drop(self, path: str) -> None:
        sock = self._socks.pop(path, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        with self._lock:
            for path in list(self._socks):
                self._drop(path)
