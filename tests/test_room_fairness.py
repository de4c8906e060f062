"""KV room is first come, first served across the cluster (real Ray actors, real gRPC): a
request that needs most of the decode worker's pool, sent while a steady stream of small
requests keeps the pool busy, is served within seconds (found by a probe: it waited 30 s behind
1,552 small ones, which fitted the room as it freed, then failed), its output HF's; the small
ones go on being served; the leak check after."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from engine.config import EngineConfig
from router.client import AsyncPdserveClient
from tests.conftest import cluster_leaks, hf_greedy
from tests.test_cluster_e2e import address, start_cluster

POOL_BLOCKS, BLOCK = 24, 16   # the decode pool: 384 tokens, also the model's length limit here
BIG_PROMPT, BIG_OUTPUT = 330, 40


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = start_cluster("disaggregated", decode_engine=EngineConfig(num_kv_blocks=POOL_BLOCKS, block_size=BLOCK),
                      prefill_engine=EngineConfig(num_kv_blocks=40, max_num_batched_tokens=64))
    yield c
    c.stop()


def test_a_large_request_is_not_starved_by_a_stream_of_small_ones(cluster, hf_reference):
    rng = random.Random(4)
    big = [rng.randrange(3, 512) for _ in range(BIG_PROMPT)]
    served = {"small": 0}

    async def small_loop(client, stop: asyncio.Event, seed: int):
        own = random.Random(seed)
        while not stop.is_set():
            prompt = [own.randrange(3, 512) for _ in range(own.randint(10, 60))]
            try:
                await client.generate_text(token_ids=prompt, max_tokens=own.randint(20, 40), ignore_eos=True)
                served["small"] += 1
            except grpc.aio.AioRpcError as exc:   # none expected: no targets, room for each in turn
                pytest.fail(f"a small request failed: {exc.code().name}: {exc.details()}")

    async def scenario():
        async with AsyncPdserveClient(address(cluster), timeout_s=120) as client:
            stop = asyncio.Event()
            loops = [asyncio.create_task(small_loop(client, stop, seed)) for seed in range(8)]
            await asyncio.sleep(2.0)   # the pool is busy with small requests
            before = served["small"]
            start = time.monotonic()
            result = await client.generate_text(token_ids=big, max_tokens=BIG_OUTPUT, ignore_eos=True)
            took = time.monotonic() - start
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*loops)
            return result, took, before

    result, took, before = asyncio.run(scenario())
    assert before > 0 and served["small"] > before, served
    assert took < 15.0, f"the large request waited {took:.1f} s behind the small ones"
    assert list(result.token_ids) == hf_greedy(hf_reference, big, BIG_OUTPUT)
    assert cluster_leaks(cluster) == {}
