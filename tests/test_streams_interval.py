"""The stream interval (``ServerLimits.stream_interval``, vLLM's ``--stream-interval``): a
request's queue wakes its reader once ``stream_interval`` tokens are pending, or at once for the
stream's first tokens, its finish and an error; every token arrives once, in order, and the last
message carries the finish reason, usage and timings. Unit level on ``DeltaQueue``, then through
the real router over simulated workers (no Ray, no model), which ends with the leak check."""

from __future__ import annotations

import asyncio
import math

import pytest

from benchmarks.sim_cluster import SimCluster
from benchmarks.sim_workers import SimConfig, prompt_seed, sim_token
from deploy.launcher import ClusterConfig, ClusterThread
from engine.types import FinishReason, RequestSpec, TokenDelta
from router.client import PdserveClient
from router.delta_queue import DeltaQueue
from router.limits import ServerLimits
from router.worker_calls import WorkerLost
from tests.test_sim_cluster import SPEED, assert_nothing_left

INTERVAL = 4


def _delta(*tokens: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta("r", tuple(tokens), finish, logprobs=tuple(-t / 10 for t in tokens))


async def _try_get(queue: DeltaQueue):
    """``get`` if it returns without waiting for another put; None otherwise."""
    task = asyncio.ensure_future(queue.get())
    for _ in range(3):
        await asyncio.sleep(0)
    if task.done():
        return task.result()
    task.cancel()
    return None


def test_first_tokens_at_once_then_every_interval_then_the_finish():
    async def scenario():
        queue = DeltaQueue(stream_interval=INTERVAL)
        queue.put_nowait(_delta(1))
        first = await _try_get(queue)
        assert first.token_ids == (1,), "the first token never waits for the interval"
        got = []
        for t in range(2, 2 + INTERVAL - 1):
            queue.put_nowait(_delta(t))
            assert await _try_get(queue) is None, "fewer than the interval pending: the reader sleeps"
        queue.put_nowait(_delta(2 + INTERVAL - 1))
        message = await _try_get(queue)
        got.append(message)
        assert message.token_ids == (2, 3, 4, 5) and message.logprobs == (-0.2, -0.3, -0.4, -0.5)
        queue.put_nowait(_delta(6))
        queue.put_nowait(_delta(7, finish=FinishReason.LENGTH))
        last = await _try_get(queue)
        assert last.token_ids == (6, 7) and last.finish_reason is FinishReason.LENGTH, "the finish goes at once"
        assert queue.num_pending_tokens == 0

    asyncio.run(scenario())


def test_an_error_goes_at_once_after_the_tokens_before_it():
    async def scenario():
        queue = DeltaQueue(stream_interval=INTERVAL)
        queue.started()
        queue.put_nowait(_delta(1))
        assert await _try_get(queue) is None
        lost = WorkerLost(None, 0, "gone")
        queue.put_nowait(lost)
        assert (await _try_get(queue)).token_ids == (1,)
        assert await _try_get(queue) is lost

    asyncio.run(scenario())


def test_started_makes_the_next_tokens_wait_for_the_interval():
    """In a disaggregated pair the first token comes from the prefill worker: the orchestrator
    says so, and the decode worker's tokens after it wait for the interval."""
    async def scenario():
        queue = DeltaQueue(stream_interval=INTERVAL)
        queue.put_nowait(_delta(2))       # may arrive before the first token was yielded
        queue.started()
        assert await _try_get(queue) is None
        for t in (3, 4, 5):
            queue.put_nowait(_delta(t))
        assert (await _try_get(queue)).token_ids == (2, 3, 4, 5)

    asyncio.run(scenario())


def test_interval_one_sends_each_token_as_it_comes():
    async def scenario():
        queue = DeltaQueue()
        assert queue.stream_interval == 1
        for t in (1, 2, 3):
            queue.put_nowait(_delta(t))
            assert (await _try_get(queue)).token_ids == (t,)

    asyncio.run(scenario())


def test_interval_must_fit_the_pending_bound():
    with pytest.raises(ValueError):
        ServerLimits(stream_interval=0)
    with pytest.raises(ValueError):
        ServerLimits(stream_interval=513, max_pending_tokens=512)
    assert ServerLimits(stream_interval=512, max_pending_tokens=512).stream_interval == 512


@pytest.fixture(scope="module")
def interval_cluster():
    config = ClusterConfig(num_prefill=1, num_decode=2, port=0,
                           defaults={"limits": ServerLimits(max_concurrent_streams=64, stream_interval=INTERVAL)})
    thread = ClusterThread(config, SimCluster(config, SPEED, SimConfig(num_blocks=256)))
    port = thread.start(60)
    yield thread, port
    thread.stop()


@pytest.mark.parametrize("max_tokens", [1, 2, 13, 30])
def test_through_the_router_every_token_once_in_order(interval_cluster, max_tokens):
    thread, port = interval_cluster
    prompt = list(range(200 + max_tokens, 240 + max_tokens))
    with PdserveClient(f"127.0.0.1:{port}") as client:
        messages = list(client.generate(token_ids=prompt, max_tokens=max_tokens))
        limits = client.server_info().limits
    assert limits.stream_interval == INTERVAL
    seed = prompt_seed(RequestSpec("x", tuple(prompt)))
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == [sim_token(seed, p) for p in range(max_tokens)]
    assert messages[0].token_ids, "the first token is a message of its own, at once"
    assert all(len(m.token_ids) >= INTERVAL for m in messages[1:-1]), [len(m.token_ids) for m in messages]
    assert len(messages) <= 2 + math.ceil((max_tokens - 1) / INTERVAL)
    last = messages[-1]
    assert last.finish_reason and last.HasField("usage") and last.HasField("timings")
    assert last.usage.completion_tokens == max_tokens
    assert not any(m.HasField("usage") for m in messages[:-1])
    assert_nothing_left(thread)
