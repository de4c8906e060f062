"""``router.task_ending.cancel_and_wait``: a task that swallows its cancel (as Python 3.11's
``wait_for`` does when its inner result lands in the same loop turn) is cancelled again until it
ends; one that never ends is returned after the bound, not waited for forever. The supervisor's
stop ends its watches that way (a failed start hung its stop forever in a stall watch)."""

from __future__ import annotations

import asyncio
import time

from router.registry import WorkerRegistry
from router.supervisor import Supervisor
from router.task_ending import cancel_and_wait


async def _swallows(times: int, ended: list[int]) -> None:
    swallowed = 0
    while True:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if swallowed == times:
                ended.append(swallowed)
                raise
            swallowed += 1


async def _ends_only_once_released(released: asyncio.Event) -> None:
    while True:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if released.is_set():
                raise


def test_a_task_that_swallows_cancels_is_cancelled_again_until_it_ends():
    async def scenario():
        ended: list[int] = []
        tasks = {asyncio.create_task(_swallows(n, ended)) for n in (0, 1, 3)}
        await asyncio.sleep(0)
        assert await cancel_and_wait(tasks, 10.0) == set()
        assert sorted(ended) == [0, 1, 3]

    asyncio.run(scenario())


def test_a_task_that_never_ends_is_returned_after_the_bound():
    async def scenario():
        released = asyncio.Event()
        stubborn = asyncio.create_task(_ends_only_once_released(released), name="stubborn")
        await asyncio.sleep(0)
        started = time.monotonic()
        assert await cancel_and_wait({stubborn}, 0.5) == {stubborn}
        assert time.monotonic() - started < 2.0
        released.set()   # leave nothing behind
        assert await cancel_and_wait({stubborn}, 5.0) == set()

    asyncio.run(scenario())


def test_the_supervisors_stop_ends_a_watch_that_swallowed_its_cancel():
    async def scenario():
        supervisor = Supervisor(WorkerRegistry(), spawn=None, on_down=lambda w: None, on_ready=lambda w: None)
        ended: list[int] = []
        supervisor._spawn_task(_swallows(2, ended), "stalls-w")
        await asyncio.sleep(0)
        await asyncio.wait_for(supervisor.stop(), 10)
        assert ended == [2] and not supervisor._tasks

    asyncio.run(scenario())
