"""Requests still live when the server stops (its drain ran out, a second signal, or no drain)
are answered as cut by the shutdown, through both doors, before the servers go down:
gRPC UNAVAILABLE naming it; HTTP 503 with OpenAI's error body, or, once a stream has begun,
an error event and ``data: [DONE]``; each generation ends (on a cluster: aborted, KV freed) and
no identity stays. Before, the servers' own stop tore them down: a bare ``500 Internal Server
Error`` in text/plain, a stream cut without an event, gRPC's "Cancelling all calls".
The real router (its servicer, uvicorn app, ``LiveRequests.cut``) over an endless fake
orchestrator (``tests/test_isolation.py``) whose requests stay live after their first token (the
client never signals ``first_read``)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from router.convert import ServerDefaults
from router.generation import GenerationCore
from router.health import ServingHealth
from router.limits import ServerLimits
from router.openai_api.server import openai_server
from router.client import PdserveClient
from tests.conftest import router_on_a_thread
from tests.test_http_body_bound import HEAD, _listening
from tests.test_isolation import EndlessOrchestrator
from tests.test_openai_api import ExactTokenizer


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_grpc_stream_live_at_the_stop_ends_unavailable_naming_the_shutdown():
    orchestrator = EndlessOrchestrator()
    with router_on_a_thread(orchestrator, ServerLimits(), max_model_len=10**9) as router:
        live = router.servicer.core.live
        with PdserveClient(f"127.0.0.1:{router.port}", timeout_s=60) as client:
            stream = client.generate(token_ids=[5], max_tokens=10**8)
            assert list(next(stream).token_ids) == [5]
            cut = asyncio.run_coroutine_threadsafe(_cut(live), router.loop).result(10)
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
        assert cut == 1
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE, info.value
        assert "shutting down" in info.value.details() and "cut" in info.value.details()
        assert _wait(lambda: orchestrator.num_ended == 1 and len(live) == 0), (orchestrator.num_ended, len(live))
        with PdserveClient(f"127.0.0.1:{router.port}", timeout_s=60) as client:   # refused from now on
            with pytest.raises(grpc.RpcError) as refused:
                client.generate_text(token_ids=[5], max_tokens=2)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()


async def _cut(live) -> int:
    return live.cut()


@pytest.mark.parametrize("stream,n", [(False, 1), (False, 3), (True, 1), (True, 3)],
                         ids=["whole", "whole-n3", "sse", "sse-n3"])
def test_an_http_request_live_at_the_stop_is_answered_naming_the_shutdown(stream, n):
    status, body, orchestrator, live = asyncio.run(_cut_over_http(stream, n))
    assert orchestrator.num_ended == n and live == 0, (orchestrator.num_ended, live)
    if stream:   # the stream had begun: an error event, then the end of the stream
        assert status == 200
        events = [e.removeprefix("data: ") for e in body.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
    else:
        assert status == 503, body
        error = json.loads(body)["error"]
    assert "shutting down" in error["message"] and "cut" in error["message"], error


async def _cut_over_http(stream: bool, n: int) -> tuple[int, str, EndlessOrchestrator, int]:
    orchestrator = EndlessOrchestrator()
    core = GenerationCore(orchestrator, ExactTokenizer(), ServerDefaults(max_model_len=10**9, vocab_size=300))
    server = openai_server(core, ServingHealth(), "m", 10**9, "127.0.0.1", 0)
    port = await server.start()
    await _listening(port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": [5], "max_tokens": 10**8, "n": n, "stream": stream}).encode()
        writer.write(HEAD.format(length=len(body)).encode() + body)
        await writer.drain()
        if stream:   # the stream has begun
            raw = await asyncio.wait_for(reader.readuntil(b"data: "), 10)
        else:        # every choice is live, and generating
            raw = b""
            while len(core.live) < n:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
        assert core.live.cut() == n
        raw += await asyncio.wait_for(reader.read(), 10)   # to the end (Connection: close)
        writer.close()
        for _ in range(100):
            if orchestrator.num_ended == n and len(core.live) == 0:
                break
            await asyncio.sleep(0.05)
        head, _, payload = raw.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            payload = _dechunked(payload)
        return int(head.split()[1]), payload.decode(), orchestrator, len(core.live)
    finally:
        await server.stop()
        core.close()


def _dechunked(payload: bytes) -> bytes:
    out = b""
    while payload:
        size_line, _, payload = payload.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, payload = out + payload[:size], payload[size + 2:]
    return out
