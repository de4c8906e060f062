"""Best-effort pushes on local unix sockets, for the direct channels between the router and the
prefill workers on its node (torch-free: the router uses it too). Never on the critical path of
correctness: every message pushed here also has a Ray path that stays the source of truth.

Users (the receiving end: ``engine.unix_listen``): a prefill worker pushes first tokens to the router's ``FirstTokenInbox``; the router
pushes prefill submissions to a worker's ``SubmissionServer`` (``prefill_worker/submissions.py``).

Life cycle: ``push(path, data)`` writes ``data`` on the connection to ``path`` (opened on first
use, one per path, kept for the pusher's life) and says whether it went out whole -> a
connection that fails (or whose write would block or went out in part) is dropped and
reopened by the next push; the caller then sends the message the Ray way -> ``close``.

Plain non-blocking sockets under a lock, not asyncio: a prefill worker's engine loop thread
pushes a first token the moment its step ends (no hop to the event loop), its event loop
pushes others. "Went out" means the bytes are in the receiver's socket buffer (a unix socket
refuses a write to a closed peer at once), so the sender may leave the message off its Ray
path only where that path carries it anyway. A push never blocks: one that would is a failed
push. A partial write is dropped with its connection: the receiver sees a cut message at EOF
and discards it.
"""

from __future__ import annotations

import logging
import socket
import threading

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 0.05   # a local unix socket: connect is immediate or the receiver is gone


class UnixPusher:
    def __init__(self) -> None:
        self._lock = threading.Lock()   # a worker's engine thread and event loop both push
        self._socks: dict[str, socket.socket] = {}

    def push(self, path: str, data: bytes) -> bool:
        """True once ``data`` is whole in the receiver's socket buffer."""
        with self._lock:
            sock = self._socks.get(path) or self._connect(path)
            if sock is None:
                return False
            try:
                if sock.send(data) == len(data):
                    return True
            except OSError as exc:   # the receiver closed it (EPIPE), or its buffer is full (EAGAIN)
                logger.debug("unix push to %s failed: %s", path, exc)
            self._drop(path)   # a cut message ends at EOF: the receiver drops it
            return False

    def _connect(self, path: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(path)
            sock.setblocking(False)
        except OSError as exc:
            logger.debug("unix socket %s unreachable: %s", path, exc)
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
