"""The router's three doors (gRPC, the OpenAI-compatible HTTP API, metrics) and how a door that
cannot listen is said: one message naming the door's flag, whether ``probe`` finds it before the
cluster starts (a port in use, a host that is not this machine's: said in under a second, not
after Ray and the workers' 10-20 s start) or the door's own bind does after (a port taken
meanwhile, or one gRPC refuses for its own reasons). Torch-free.
"""

from __future__ import annotations

import socket

# A door's config field (ClusterConfig's) -> what the message calls it and the flag that sets it.
DOORS = {"port": ("gRPC", "--port"), "http_port": ("the HTTP API", "--http-port"),
         "metrics_port": ("metrics", "--metrics-port")}


def cannot_listen(door: str, host: str, port: int, reason: str, errno: int | None = None) -> OSError:
    """The error of ``door`` (a DOORS key) failing to listen on ``host:port``, for ``reason``."""
    what, flag = DOORS[door]
    message = f"{what} cannot listen on {host}:{port} ({flag}): {reason}"
    return OSError(errno, message) if errno is not None else OSError(message)


def probe(door: str, host: str, port: int) -> None:
    """Bind a socket where ``door`` will listen and release it; raises ``cannot_listen`` if the bind
    fails (port 0 too: any free port, on a host that may not be this machine's). SO_REUSEADDR as
    the doors' own servers set it: a port a stopped run left in TIME_WAIT is free to them, so it is
    to the probe."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:   # in use, not this machine's address, or a name that does not resolve
        raise cannot_listen(door, host, port, exc.strerror or str(exc), exc.errno) from None
