"""Joining a Ray cluster at an explicit address: it must answer within a bound, and the wait
leaves the event loop free, so a signal meanwhile stops the start (found by a probe: ``pdserve
serve --address`` a head that was down retried for minutes inside ``ray.init``, deaf to
SIGTERM until systemd's SIGKILL)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from deploy.ray_init import wait_reachable
from deploy.start_failure import RayUnreachableError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_there_is_said_in_one_line_after_the_bound():
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(RayUnreachableError) as info:
        asyncio.run(wait_reachable(f"127.0.0.1:{port}", timeout_s=1.0))
    assert 1.0 <= time.monotonic() - started < 5.0
    assert str(info.value).startswith(f"--address 127.0.0.1:{port}: nothing answers there after 1 s (")


def test_a_listener_answers_and_addresses_ray_resolves_itself_are_not_probed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            asyncio.run(wait_reachable(address, timeout_s=5.0))
    for address in (None, "auto", "local"):
        asyncio.run(wait_reachable(address, timeout_s=0.0))


def test_the_wait_leaves_the_loop_free_and_ends_at_a_cancel():
    async def scenario():
        waiting = asyncio.create_task(wait_reachable(f"127.0.0.1:{_free_port()}", timeout_s=30.0))
        ticks = 0
        for _ in range(10):    # the loop runs other work meanwhile (a signal's handler, say)
            await asyncio.sleep(0.05)
            ticks += 1
        waiting.cancel()        # what a signal during the start does
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return ticks, time.monotonic() - started

    ticks, ended_in = asyncio.run(scenario())
    assert ticks == 10 and ended_in < 1.0
