"""The HTTP door bounds the request bodies it receives at once (router/openai_api/app.py): each
may hold up to max_receive_message_bytes until complete, so clients that upload slowly, or never
finish, would otherwise grow the router's memory without bound. With max_concurrent_streams
bodies arriving, one more request gets 429 in OpenAI's shape at once; once the slow uploads go,
bodies are read again. An upload that does not finish within ``http_receive_timeout_s`` is answered
408 and gives its place up (stalled uploads would otherwise hold the door shut for good); a
connection whose request head does not arrive within it is closed (each would hold one of the
router's file descriptors for good); a client that leaves mid-body is no error of ours (nothing
logged as one). Real uvicorn on a port;
the slow clients are raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from router.convert import ServerDefaults
from router.generation import GenerationCore
from router.health import ServingHealth
from router.limits import ServerLimits
from router.openai_api.server import openai_server

CAP = 2
HEAD = ("POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        "Content-Length: {length}\r\nConnection: close\r\n\r\n")


async def _request(port: int, body: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HEAD.format(length=len(body)).encode() + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split()[1]), json.loads(payload or b"{}")
    except json.JSONDecodeError:   # not one JSON body (e.g. chunked): shown as it came
        return int(head.split()[1]), {"raw": payload[:200].decode(errors="replace")}


async def _listening(port: int) -> None:
    for _ in range(100):   # uvicorn's task takes the socket over a moment after start()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise AssertionError("the HTTP server never listened")


@contextlib.asynccontextmanager
async def _door(**limits):
    """A real uvicorn HTTP door over a core with no cluster behind it; yields its port."""
    core = GenerationCore(None, None, ServerDefaults(max_model_len=64, vocab_size=100,
                                                     limits=ServerLimits(max_concurrent_streams=CAP, **limits)))
    server = openai_server(core, ServingHealth(), "m", 64, "127.0.0.1", 0)
    port = await server.start()
    await _listening(port)
    try:
        yield port
    finally:
        await server.stop()
        core.close()


async def _stalled_uploads(port: int) -> list:
    """CAP uploads that announce 1,000 bytes, send one, and stall: (reader, writer) each."""
    slow = []
    for _ in range(CAP):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD.format(length=1000).encode() + b"{")
        await writer.drain()
        slow.append((reader, writer))
    return slow


async def _scenario() -> None:
    async with _door() as port:
        slow = await _stalled_uploads(port)
        try:
            await asyncio.sleep(0.3)   # the server is receiving both
            status, body = await _request(port, b'{"prompt": "hi"}')
            assert status == 429, (status, body)
            assert body["error"]["type"] == "rate_limit_error" and "max_concurrent_streams" in body["error"]["message"]
            for _, writer in slow:
                writer.close()
            await asyncio.sleep(0.3)
            status, body = await _request(port, b"{not json")   # read again: refused for what it holds
            assert status == 400 and "not valid JSON" in body["error"]["message"], (status, body)
        finally:
            for _, writer in slow:
                writer.close()


def test_bodies_received_at_once_are_bounded():
    asyncio.run(_scenario())


async def _stalled_uploads_time_out() -> None:
    async with _door(http_receive_timeout_s=1.0) as port:
        slow = await _stalled_uploads(port)
        try:
            await asyncio.sleep(0.3)
            status, _ = await _request(port, b'{"prompt": "hi"}')
            assert status == 429, "both places are taken by the stalled uploads"
            for reader, _ in slow:   # answered by the server, while the clients still hold their sockets
                raw = await asyncio.wait_for(reader.read(), 10)
                head, _, payload = raw.partition(b"\r\n\r\n")
                assert int(head.split()[1]) == 408, raw[:200]
                error = json.loads(payload)["error"]
                assert error["type"] == "invalid_request_error" and "http_receive_timeout_s" in error["message"], error
            status, body = await _request(port, b"{not json")   # the places are free again
            assert status == 400 and "not valid JSON" in body["error"]["message"], (status, body)
        finally:
            for _, writer in slow:
                writer.close()


def test_an_upload_that_stalls_is_408_and_gives_its_place_up():
    asyncio.run(_stalled_uploads_time_out())


async def _client_leaves_mid_body() -> None:
    async with _door() as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD.format(length=1000).encode() + b"{")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()   # gone before its body was complete
        await asyncio.sleep(0.3)
        status, body = await _request(port, b"{not json")
        assert status == 400, (status, body)


def test_a_client_that_leaves_mid_body_is_no_error_of_ours(caplog):
    with caplog.at_level(logging.WARNING):
        asyncio.run(_client_leaves_mid_body())
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not logged, logged


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within_s) == b""
    except asyncio.TimeoutError:
        return False


async def _heads_that_never_arrive() -> None:
    # 2 s, not less: the door and this client share one event loop on a loaded 2-core CI box, where a
    # shorter limit once ran out before the server read a head that had come whole (a reset, not a 503)
    async with _door(http_receive_timeout_s=2.0) as port:
        silent = await asyncio.open_connection("127.0.0.1", port)            # opened, nothing sent
        partial = await asyncio.open_connection("127.0.0.1", port)           # a head begun, never ended
        partial[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        second = await asyncio.open_connection("127.0.0.1", port)            # one request answered, then
        second[1].write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")          # the next head begun
        assert (await asyncio.wait_for(second[0].readuntil(b"}"), 10)).startswith(b"HTTP/1.1 503")   # not serving: answered
        second[1].write(b"GET /health HTTP/1.1\r\n")
        for reader, _ in (silent, partial, second):
            assert await _closed_by_server(reader, 8), "a connection without a request head was left open"
        for _, writer in (silent, partial, second):
            writer.close()
        status, body = await _request(port, b"{not json")   # a request that comes whole is served
        assert status == 400, (status, body)


def test_a_request_head_that_does_not_arrive_in_time_closes_its_connection():
    asyncio.run(_heads_that_never_arrive())
