"""A port that cannot be had is said naming its option, on each of the three doors (gRPC,
the OpenAI HTTP API, metrics), as the OSError the CLI prints in one line (``pdserve serve:
error: ...``, exit 2): before, gRPC's was a RuntimeError traceback naming neither the cause nor
the flag, and the others a bare "[Errno 98] Address already in use". `pdserve serve` finds a port
in use, or a host not this machine's, before Ray starts (it said so only after the cluster's
9-20 s start), with the same words."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from router.metrics import RouterMetrics
from router.openai_api.server import _bind
from router.server import _listen


@pytest.fixture
def taken():
    holder = socket.create_server(("127.0.0.1", 0))
    yield holder.getsockname()[1]
    holder.close()


def test_each_door_names_its_option_when_its_port_is_taken(taken):
    server = grpc.server(ThreadPoolExecutor(1))
    try:
        with pytest.raises(OSError, match=rf"gRPC cannot listen on 127.0.0.1:{taken} \(--port\)"):
            _listen(server.add_insecure_port, "127.0.0.1", taken)
    finally:
        server.stop(None)
    with pytest.raises(OSError, match=rf"HTTP API cannot listen on 127.0.0.1:{taken} \(--http-port\)"):
        _bind("127.0.0.1", taken)
    metrics = RouterMetrics()
    with pytest.raises(OSError, match=rf"metrics cannot listen on 127.0.0.1:{taken} \(--metrics-port\)"):
        metrics.start_http_server(taken)
    metrics.close()


@pytest.mark.parametrize("flag,door", [("--port", "gRPC"), ("--http-port", "the HTTP API"),
                                       ("--metrics-port", "metrics")])
def test_serve_says_a_port_in_use_before_ray_starts(taken, flag, door, capsys, monkeypatch):
    import ray

    from deploy.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray must not start for a port in use"))
    doors = {"--port": "0", "--http-port": "0", "--metrics-port": "0", flag: str(taken)}
    assert main(["serve", "--random-model", *(x for pair in doors.items() for x in pair)]) == 2
    assert (f"pdserve serve: error: {door} cannot listen on 127.0.0.1:{taken} ({flag}): Address already in use"
            in capsys.readouterr().err)


def test_serve_says_a_host_that_is_not_this_machines_before_ray_starts(capsys, monkeypatch):
    import ray

    from deploy.cli import main

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray must not start for a host it cannot bind"))
    assert main(["serve", "--random-model", "--host", "203.0.113.1", "--port", "0"]) == 2   # TEST-NET-3: no one's (this VM is on TEST-NET-1)
    assert "gRPC cannot listen on 203.0.113.1:0 (--port): Cannot assign requested address" in capsys.readouterr().err


def _resolving(monkeypatch, host: str, *ips: str) -> None:
    """``host`` resolves to ``ips`` (as a name with several addresses does), every other name as before."""
    real = socket.getaddrinfo

    def fake(name, port, *args, **kwargs):
        if name != host:
            return real(name, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips]
    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_the_probe_binds_every_address_a_host_resolves_to(taken, monkeypatch):
    """Found by review: only the first address was probed, so a port in use on a host's second
    address was found by the door's own bind after the cluster's start."""
    from router import listen

    _resolving(monkeypatch, "twohomed", "127.0.0.2", "127.0.0.1")   # the port is taken on the second
    with pytest.raises(OSError, match=rf"gRPC cannot listen on twohomed:{taken} \(--port\): Address already in use"):
        listen.probe("port", "twohomed", taken)
    _resolving(monkeypatch, "partly", "198.51.100.1", "127.0.0.2")     # one address not this machine's
    listen.probe("port", "partly", taken)                           # the door takes the other, as gRPC does
    _resolving(monkeypatch, "elsewhere", "198.51.100.1", "203.0.113.1")   # TEST-NET-2, -3
    with pytest.raises(OSError, match="Cannot assign requested address"):
        listen.probe("port", "elsewhere", 0)


def test_an_ipv6_literal_is_said_in_brackets():
    from router import listen

    assert "cannot listen on [::1]:7 (--port)" in str(listen.cannot_listen("port", "::1", 7, "why"))
