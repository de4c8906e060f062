"""A port that cannot be had is said naming its option, on each of the three doors (gRPC,
the OpenAI HTTP API, metrics), as the OSError the CLI prints in one line (``pdserve serve:
error: ...``, exit 2): before, gRPC's was a RuntimeError traceback naming neither the cause nor
the flag, and the others a bare "[Errno 98] Address already in use"."""

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
