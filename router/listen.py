"""The router's three doors (gRPC, the OpenAI-compatible HTTP API, metrics) and how a door that
cannot listen is said: one message naming the door's flag, whether ``probe`` finds it before the
cluster starts (a port in use, a host that is not this machine's: said in under a second, not
after Ray and the workers' 10-20 s start) or the door's own bind does after (a port taken
meanwhile, or one gRPC refuses for its own reasons). Torch-free.
"""

from __future__ import annotations

import errno
import socket

# A door's config field (ClusterConfig's) -> what the message calls it and the flag that sets it.
DOORS = {"port": ("gRPC", "--port"), "http_port": ("the HTTP API", "--http-port"),
         "metrics_port": ("metrics", "--metrics-port")}


def cannot_listen(door: str, host: str, port: int, reason: str, errno: int | None = None) -> OSError:
    """The error of ``door`` (a DOORS key) failing to listen on ``host:port``, for ``reason``."""
    what, flag = DOORS[door]
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host   # an IPv6 literal
    message = f"{what} cannot listen on {shown}:{port} ({flag}): {reason}"
    return OSError(errno, message) if errno is not None else OSError(message)


def addresses(host: str, port: int) -> list[tuple[int, tuple]]:
    """Every (family, socket address) a bind to ``host:port`` takes, as the doors' servers resolve
    it (gRPC and asyncio bind each result of a name such as ``localhost``: 127.0.0.1 and ::1).
    Raises OSError for a name that does not resolve."""
    found = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return list(dict.fromkeys((family, address[:2]) for family, _, _, _, address in found))


def probe(door: str, host: str, port: int) -> None:
    """Bind sockets where ``door`` will listen, on every address ``host`` resolves to, and release
    them; raises ``cannot_listen`` where the door's own bind would fail: a port in use on any of
    them (the server would take the others and refuse), or no address this machine can bind (port
    0 too: any free port, on a host that may not be this machine's). An address of one family the
    machine lacks (``localhost``'s ::1 without IPv6) is left, as gRPC leaves it. SO_REUSEADDR as the
    doors' own servers set it: a port a stopped run left in TIME_WAIT is free to them, so it is to
    the probe; IPV6_V6ONLY where the host resolves to both families, as asyncio sets it (``::``
alone stays dual-stack, as gRPC binds it: an IPv4 holder of the port is found)."""
    try:
        targets = addresses(host, port)
    except OSError as exc:   # a name that does not resolve
        raise cannot_listen(door, host, port, exc.strerror or str(exc), exc.errno) from None
    held, failures = [], []
    v6_only = len({family for family, _ in targets}) > 1   # else ``::`` is dual-stack, as gRPC binds it
    try:
        for family, address in targets:
            try:
                held.append(_bind(family, address, v6_only))
            except OSError as exc:
                failures.append(exc)
    finally:
        for sock in held:
            sock.close()
    in_use = [exc for exc in failures if exc.errno == errno.EADDRINUSE]
    if in_use or not held:
        exc = (in_use or failures)[0]
        raise cannot_listen(door, host, port, exc.strerror or str(exc), exc.errno)


def _bind(family: int, address: tuple, v6_only: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and v6_only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
