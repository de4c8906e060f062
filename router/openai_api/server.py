"""uvicorn inside the router's own event loop: the HTTP API shares the orchestrator, admission
and metrics with gRPC because it runs in the same loop, not beside it.

Life cycle: ``HttpServer.start`` builds the TLS context from the router's ``ServerSecurity``
when it has a certificate (the same certificate, client CA for mTLS, and bearer token as the
gRPC port; a bad one fails here, before any socket exists), binds the socket itself (so port 0
gives a free port known at once, without waiting for uvicorn to report), and runs
``uvicorn.Server.serve`` as a task, which owns the socket from then on (closed when the task
ends, however it ends), on h11 with a deadline on each request head (``_HeadDeadlineProtocol``);
``stop`` asks it to exit (open streams get ``GRACE_S`` to finish, then
are cancelled, which aborts their requests) and waits for the task. uvicorn's own signal handling is turned off: pdserve
serve owns SIGINT / SIGTERM. uvicorn wakes every 0.1 s to check for exit (its design, not ours).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.listen import cannot_listen
from router.security import ServerSecurity

logger = logging.getLogger(__name__)

GRACE_S = 2.0


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield   # the process's signals are pdserve's (deploy/cli.py), not uvicorn's


class _HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head. uvicorn closes an idle
    connection only after a response (its keep-alive timeout, disarmed by any byte): one that
    never completes a request head (opened and left, or a head begun and stopped: slowloris)
    stays open for good, each holding a file descriptor of the router's process, which its gRPC
    port and Ray share. Here a head must be complete within ``head_timeout_s`` of the connection
    or of the last response, else the connection is closed (there is no request to answer)."""

    def __init__(self, *args, head_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_late)

    def _head_late(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():   # no request begun
            self.transport.close()


def openai_server(core, health, model: str, max_model_len: int, host: str, port: int,
                  security: ServerSecurity | None = None, tool_call_parser: str | None = None) -> HttpServer:
    """The OpenAI-compatible API over ``core`` (the gRPC servicer's own request path: limits,
    identity, admission, metrics) under the router's ``security``: its certificate (TLS), client
    CA (mTLS) and bearer token, all as on the gRPC port; ``tool_call_parser``: the model's call
    syntax, for chat's tool_choice "auto". Start it with ``start()``."""
    from router.openai_api.app import ApiConfig, build_app

    security = security or ServerSecurity()
    app = build_app(core, health, ApiConfig(model, max_model_len, security.auth_token, tool_call_parser))
    return HttpServer(app, host, port, security, head_timeout_s=core.limits.http_receive_timeout_s)


class HttpServer:
    def __init__(self, app, host: str, port: int, security: ServerSecurity | None = None,
                 head_timeout_s: float = 60.0) -> None:
        self.app, self.host, self.requested_port = app, host, port
        self.head_timeout_s = head_timeout_s
        self.security = security or ServerSecurity()
        self.port: int | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        ssl_context = self.security.ssl_context()   # first: a bad certificate fails before a socket exists
        sock = _bind(self.host, self.requested_port)
        try:
            self.port = sock.getsockname()[1]
            protocol = functools.partial(_HeadDeadlineProtocol, head_timeout_s=self.head_timeout_s)
            config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off", http=protocol,
                                    timeout_graceful_shutdown=GRACE_S, server_header=False)
            config.load()
            config.ssl = ssl_context
            self._server = _EmbeddedServer(config)
            self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="pdserve-http")
        except BaseException:
            sock.close()
            raise
        self._task.add_done_callback(lambda task: _on_exit(task, sock))
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d (%s)", "https" if ssl_context else "http",
                    self.host, self.port, self.security.describe())
        return self.port

    async def stop(self) -> None:
        """Returns once the server task has ended; a cancel of the caller propagates (the server
        task goes on to its end regardless)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await asyncio.wait([self._task])


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:   # said with the flag: a bare "[Errno 98] Address already in use" names no door
        sock.close()
        raise cannot_listen("http_port", host, port, exc.strerror, exc.errno) from None
    sock.set_inheritable(True)
    return sock


def _on_exit(task: asyncio.Task, sock: socket.socket) -> None:
    sock.close()   # uvicorn closes the servers it made on it; the socket itself is ours
    if not task.cancelled() and task.exception() is not None:
        logger.error("HTTP server failed: %s", task.exception(), exc_info=task.exception())
