"""uvicorn inside the router's own event loop: the HTTP API shares the orchestrator, admission
and metrics with gRPC because it runs in the same loop, not beside it.

Life cycle: ``HttpServer.start`` binds the socket itself (so port 0 gives a free port known at
once, without waiting for uvicorn to report), builds the TLS context from the router's
``ServerSecurity`` when it has a certificate, and runs ``uvicorn.Server.serve`` as a task;
``stop`` asks it to exit (open streams get ``GRACE_S`` to finish, then are cancelled, which
aborts their requests) and awaits the task. uvicorn's own signal handling is turned off: pdserve
serve owns SIGINT / SIGTERM. uvicorn wakes every 0.1 s to check for exit (its design, not ours).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from router.security import ServerSecurity

logger = logging.getLogger(__name__)

GRACE_S = 2.0


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield   # the process's signals are pdserve's (deploy/cli.py), not uvicorn's


class HttpServer:
    def __init__(self, app, host: str, port: int, security: ServerSecurity | None = None) -> None:
        self.app, self.host, self.requested_port = app, host, port
        self.security = security or ServerSecurity()
        self.port: int | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        sock = _bind(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=GRACE_S, server_header=False)
        config.load()
        config.ssl = self.security.ssl_context()
        self._server = _EmbeddedServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="pdserve-http")
        self._task.add_done_callback(_log_exit)
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d (%s)", "https" if config.ssl else "http",
                    self.host, self.port, self.security.describe())
        return self.port

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _log_exit(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("HTTP server failed: %s", task.exception(), exc_info=task.exception())
