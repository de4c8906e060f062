"""What a request leaves behind in the router and on its decode worker once it has ended, however
it ended (found by benchmarks/probe_soak.py: the router's live objects grew ~14 per request and
the decode worker's ~14 per reservation under a mix with cancels and deadlines).

- A streaming call (the prefill call) whose reader is cancelled while it waits for the next item:
  Ray keeps that wait's completion callback (the item's ref, two futures, a lock) for the life of
  the process once the generator is dropped; ``stream_call`` hands it to ``StreamDrains``, which
  reads it to its end, so everything is freed.
- A decode worker's reservation schedules its lease timer; one that ends (committed or aborted)
  cancels it, instead of leaving the request's spec and handle held for the whole lease.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from engine.config import EngineConfig
from engine.types import RequestSpec, SamplingParams
from router.registry import WorkerHandle
from router.stream_drain import StreamDrains
from router.worker_calls import stream_call


def _live_refs_of(task_hex: str) -> int:
    from ray import ObjectRef

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is ObjectRef and o.task_id().hex() == task_hex)


@pytest.fixture(scope="module")
def gated(ray_session):
    """An actor whose streaming call yields one item, then the second once ``release`` is called
    (as the prefill call yields its first token, then its result once the request ends)."""
    import ray

    @ray.remote
    class Gated:
        def __init__(self) -> None:
            self.gate = asyncio.Event()

        async def items(self):
            yield "first"
            await self.gate.wait()
            yield "result"

        async def release(self) -> None:
            self.gate.set()

        async def reset(self) -> None:
            self.gate = asyncio.Event()

    return Gated.remote()


@pytest.mark.parametrize("drained", [True, False])
def test_a_streaming_call_cancelled_mid_wait_leaves_nothing_once_it_ends(gated, drained):
    import ray

    worker = WorkerHandle("prefill-t", "prefill", gated, "node", "cpu")
    drains = StreamDrains() if drained else None
    ray.get(gated.reset.remote())

    async def scenario() -> tuple[str, int]:
        calls = []
        real = type(gated.items).remote

        def recorded(method, *args, **kwargs):   # the call's task id, to find its refs afterwards
            stream = real(method, *args, **kwargs)
            calls.append(stream._generator_ref.task_id().hex())
            return stream

        type(gated.items).remote = recorded
        try:
            items = stream_call(worker, "items", drains=drains)
            assert await anext(items) == "first"
            reading = asyncio.ensure_future(anext(items))
            await asyncio.sleep(0.3)              # waiting for the second item
            reading.cancel()                      # the client went away (its request is aborted)
            await asyncio.gather(reading, return_exceptions=True)
            await items.aclose()
            del items, reading
        finally:
            type(gated.items).remote = real
        await gated.release.remote()              # the worker ends the stream, as an abort ends it
        for _ in range(100):
            if drains is None or drains.num_draining == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        return calls[0], drains.num_draining if drains else 0

    task_hex, draining = asyncio.run(scenario())
    assert draining == 0
    if drained:
        assert _live_refs_of(task_hex) == 0, "the call's refs outlived it"
    else:   # the premise: Ray itself keeps the cancelled wait's ref (if this fails, the drain is moot)
        assert _live_refs_of(task_hex) >= 1


def test_a_drain_is_bounded_for_a_stream_that_never_ends(gated):
    import ray

    ray.get(gated.reset.remote())

    async def scenario() -> int:
        drains = StreamDrains(bound_s=0.3)
        stream = gated.items.remote()
        assert await (await anext(stream)) == "first"
        drains.take(stream)
        await asyncio.sleep(0.8)
        return drains.num_draining

    assert asyncio.run(scenario()) == 0
    ray.get(gated.release.remote())


@pytest.mark.parametrize("end", ["abort", "fenced_abort", "lease"])
def test_a_reservation_that_ends_cancels_its_lease_timer(monkeypatch, end):
    from decode_worker import worker as decode_module
    from engine.worker_base import WorkerSpec

    monkeypatch.setattr(decode_module, "RESERVATION_LEASE_S", 0.4)
    spec = WorkerSpec("lease-test", random_model={"seed": 0}, engine=EngineConfig(num_kv_blocks=32))
    lease_ends = []

    async def run():
        worker = decode_module.DecodeWorker(spec)
        real = worker._lease_ended
        worker._lease_ended = lambda *a: lease_ends.append(a[0]) or real(*a)
        worker.start()
        try:
            await worker.reserve(RequestSpec("r", tuple(range(3, 40)), SamplingParams(max_tokens=4)), "shm")
            held = await worker.leak_report()
            if end != "lease":
                await worker.abort("r", writer_gone=end == "abort")
            await asyncio.sleep(1.2)   # past the lease (and a fence's wait)
            return held, await worker.leak_report()
        finally:
            worker.shutdown()

    held, after = asyncio.run(run())
    assert held["reservations"] == 1 and held["free_blocks"] < held["total_blocks"]
    assert after["reservations"] == 0 and after["free_blocks"] == after["total_blocks"] and after["requests"] == 0
    assert lease_ends == (["r"] if end == "lease" else []), "an ended reservation's lease timer still ran"
