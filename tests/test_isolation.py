"""One client cannot hurt another: the router runs every request under its own id (the
client's request_id is a label echoed back; a live label gets ALREADY_EXISTS and the running
request is untouched, whichever call comes first); one client's cancel does not reach another;
a client that stops reading is cancelled with bounded memory and its work is freed; ServerInfo
shows every block free on an idle cluster. Cluster tests end with the cluster-wide leak check."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from engine.types import TokenDelta
from router.client import AsyncPdserveClient, PdserveClient
from router.delta_queue import DeltaQueue, SlowReaderError, merge
from router.limits import ServerLimits
from tests.conftest import cluster_leaks, hf_greedy, router_on_a_thread
from tests.test_cluster_e2e import address, start_cluster

PROMPT = [17, 18, 19, 20]


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = start_cluster("disaggregated")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(hf_reference):
    return hf_greedy(hf_reference, PROMPT, 120)


async def _collect(stream) -> tuple[list[int], set[str]]:
    tokens, labels = [], set()
    async for msg in stream:
        tokens.extend(msg.token_ids)
        labels.add(msg.request_id)
    return tokens, labels


def test_live_label_gets_already_exists_and_the_first_is_untouched(cluster, reference):
    registry = cluster.cluster.metrics.registry
    duplicates = {"decision": "reject", "reason": "duplicate_id"}
    before = registry.get_sample_value("pdserve_admission_decisions_total", duplicates) or 0.0

    async def scenario():
        async with AsyncPdserveClient(address(cluster)) as a, AsyncPdserveClient(address(cluster)) as b:
            first = a.generate(token_ids=PROMPT, max_tokens=120, ignore_eos=True, request_id="job-1")
            head = await first.__anext__()
            with pytest.raises(grpc.RpcError) as dup:
                await b.generate_text(token_ids=[5, 6], max_tokens=3, request_id="job-1")
            rest, labels = await _collect(first)
            again = await b.generate_text(token_ids=[5, 6], max_tokens=3, request_id="job-1")  # no longer live
            return list(head.token_ids) + rest, {head.request_id} | labels, dup.value, again

    tokens, labels, dup, again = asyncio.run(scenario())
    assert dup.code() is grpc.StatusCode.ALREADY_EXISTS and "request_id" in dup.details()
    assert tokens == reference and labels == {"job-1"}
    assert again.request_id == "job-1" and again.usage.completion_tokens == 3
    assert registry.get_sample_value("pdserve_admission_decisions_total", duplicates) == before + 1
    assert cluster_leaks(cluster) == {}


def test_two_calls_with_one_label_at_once_one_wins_whole(cluster, reference):
    """Both orders: whichever call the router sees first runs, complete; the other is refused."""
    async def scenario():
        async with AsyncPdserveClient(address(cluster)) as a, AsyncPdserveClient(address(cluster)) as b:
            calls = [c.generate_text(token_ids=PROMPT, max_tokens=120, ignore_eos=True, request_id="same")
                     for c in (a, b)]
            return await asyncio.gather(*calls, return_exceptions=True)

    for _ in range(2):
        results = asyncio.run(scenario())
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert len(refused) == 1 and refused[0].code() is grpc.StatusCode.ALREADY_EXISTS
        assert len(served) == 1 and served[0].token_ids == reference and served[0].request_id == "same"
    assert cluster_leaks(cluster) == {}


def test_unlabelled_calls_get_distinct_labels_and_never_share_a_stream(cluster, reference):
    async def scenario():
        async with AsyncPdserveClient(address(cluster)) as client:
            return await asyncio.gather(*(client.generate_text(token_ids=PROMPT, max_tokens=120, ignore_eos=True)
                                          for _ in range(4)))

    results = asyncio.run(scenario())
    assert len({r.request_id for r in results}) == 4 and all(len(r.request_id) == 32 for r in results)
    assert all(r.token_ids == reference for r in results)
    assert cluster_leaks(cluster) == {}


def test_one_clients_cancel_does_not_reach_another_with_the_same_prompt(cluster, reference):
    async def scenario():
        async with AsyncPdserveClient(address(cluster)) as a, AsyncPdserveClient(address(cluster)) as b:
            victim = a.generate(token_ids=PROMPT, max_tokens=120, ignore_eos=True, request_id="x")
            other = asyncio.create_task(b.generate_text(token_ids=PROMPT, max_tokens=120, ignore_eos=True,
                                                        request_id="y"))
            await victim.__anext__()
            await victim.aclose()   # cancels "x"
            return await other

    result = asyncio.run(scenario())
    assert result.token_ids == reference and result.request_id == "y"
    assert cluster_leaks(cluster) == {}


def test_idle_cluster_server_info_shows_every_block_free(cluster):
    with PdserveClient(address(cluster)) as client:
        client.generate_text(token_ids=list(range(5, 60)), max_tokens=4, ignore_eos=True)
        assert cluster_leaks(cluster) == {}
        workers = client.server_info().workers
    assert {w.worker_id for w in workers} == {"prefill-0", "decode-0"}
    assert all(w.num_free_blocks == w.num_total_blocks and w.num_running == 0 for w in workers)
    # What the router last heard from the decode worker agrees: its stream publishes stats after
    # calls that free blocks between steps (EngineLoop's between-steps report).
    decode = cluster.cluster.registry.get("decode-0")
    assert decode.stats.num_free_blocks == decode.stats.num_total_blocks


# ---------------------------------------------------------------- slow readers


@pytest.mark.parametrize("payload, reason", [
    (b"\x12\x03a\xffb", "String field had bad UTF-8"),                 # text (field 2) with an invalid UTF-8 byte
    (b"\x0a\x02\xc3\x28" + b"\x12\x02hi", "String field had bad UTF-8"),   # request_id (field 1) invalid UTF-8
    (b"\x1a\x08\x0a\x06\x0a\x02us\x12\x00" + b"\xff", "Wire format was corrupt"),   # chat, then a truncated field
    (b"\x22\x05\x0a\x03\xff\xff\xff", "Wire format was corrupt"),           # token_ids with a broken varint
])
def test_malformed_bytes_on_the_wire_are_invalid_argument(cluster, payload, reason):
    """Raw bytes no client library would send: INVALID_ARGUMENT with protobuf's reason (a probe
    found a UTF-8 hint on every one), never INTERNAL or UNKNOWN."""
    with grpc.insecure_channel(address(cluster)) as channel:
        call = channel.unary_stream("/pdserve.v1.Pdserve/Generate", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            list(call(payload, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details() == f"request: not a valid GenerateRequest: {reason}"
    assert cluster_leaks(cluster) == {}


def test_malformed_server_info_bytes_are_invalid_argument(cluster):
    """Found by a probe: ServerInfo answered UNKNOWN with Python's exception text."""
    with grpc.insecure_channel(address(cluster)) as channel:
        call = channel.unary_unary("/pdserve.v1.Pdserve/ServerInfo", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff", timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details() == "request: not a valid ServerInfoRequest: Wire format was corrupt"


def test_delta_queue_merges_and_overflows():
    async def scenario():
        queue = DeltaQueue(max_pending_tokens=6)
        for i in range(3):
            queue.put_nowait(TokenDelta("r", (i, i)))
        merged = await queue.get()
        assert merged.token_ids == (0, 0, 1, 1, 2, 2) and queue.num_pending_tokens == 0
        consumer = asyncio.current_task()
        for i in range(4):
            queue.put_nowait(TokenDelta("r", (i, i)))   # 8 > 6 pending: cancel the consumer
        assert queue.overflowed and consumer.cancelling()
        consumer.uncancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass
        item = await queue.get()
        assert isinstance(item, SlowReaderError)

    asyncio.run(scenario())
    done = merge(TokenDelta("r", (1,), logprobs=(-1.0,)), TokenDelta("r", (2,), "stop", (-2.0,)))
    assert done.token_ids == (1, 2) and done.finish_reason == "stop" and done.logprobs == (-1.0, -2.0)
    first = merge(TokenDelta("r", (1,), num_cached_tokens=32), TokenDelta("r", (2,)))
    assert first.num_cached_tokens == 32, "a lagging reader still learns the prompt's cached tokens"


class EndlessOrchestrator:
    """Streams a first token, then (once the client has read it: ``first_read``) 8-token deltas
    as fast as it can through the real DeltaQueue; records its end (``ended``, ``num_ended``). The flood waits for the read
    because it outpaces the handler's own writes on a loaded machine: the cap would cut the
    stream before the client's first read, and the test means a reader that read, then stopped."""

    def __init__(self) -> None:
        self.registry = SimpleNamespace(all=[])
        self.admission = SimpleNamespace(max_queued=None)
        self.ended = threading.Event()
        self.num_ended = 0   # generations that ended (n choices: n)
        self.first_read = threading.Event()
        self.max_pending_seen = 0

    async def generate(self, spec, trace):
        queue = DeltaQueue()   # made in the handler's task, as DecodeStreams.register does

        async def produce():
            queue.put_nowait(TokenDelta(spec.req_id, (5,)))
            while not self.first_read.is_set():
                await asyncio.sleep(0.005)
            while True:
                queue.put_nowait(TokenDelta(spec.req_id, (5,) * 8))
                self.max_pending_seen = max(self.max_pending_seen, queue.num_pending_tokens)
                await asyncio.sleep(0)

        producer = asyncio.create_task(produce())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            producer.cancel()
            self.num_ended += 1
            self.ended.set()   # where the real orchestrator aborts on every worker


class FirstWriteFloodOrchestrator(EndlessOrchestrator):
    """The first token, then more than ``max_pending_tokens`` at once while the handler's first
    write is still pending: the slow-reader cancel lands in that write, every time."""

    settle_s = 0.05   # as admission and dispatch take: the response headers' send completes meanwhile

    async def generate(self, spec, trace):
        queue = DeltaQueue()
        queue.put_nowait(TokenDelta(spec.req_id, (5,)))
        first = await queue.get()
        await asyncio.sleep(self.settle_s)
        flood = TokenDelta(spec.req_id, (5,) * (queue.max_pending_tokens + 1))
        # scheduled before the handler starts its write, so it runs while that write is pending
        asyncio.get_running_loop().call_soon(queue.put_nowait, flood)
        try:
            yield first
            item = await queue.get()
            assert isinstance(item, SlowReaderError), item
            raise item
        finally:
            self.ended.set()


class HeadersFloodOrchestrator(FirstWriteFloodOrchestrator):
    """The same flood before the response headers' send (started as the call came) completed:
    the cancel lands while the handler waits for them, before its first write."""

    settle_s = 0.0


def test_slow_reader_cancelled_before_its_headers_went_out_gets_its_status():
    """The abort waits for the headers' send (a second headers batch while it is pending would
    be refused by core and no status would leave): RESOURCE_EXHAUSTED, nothing left."""
    limits = ServerLimits(max_pending_tokens=512)
    orchestrator = HeadersFloodOrchestrator()
    with router_on_a_thread(orchestrator, limits, max_model_len=10**9) as router:
        with PdserveClient(f"127.0.0.1:{router.port}", timeout_s=60) as client:
            with pytest.raises(grpc.RpcError) as info:
                for _ in client.generate(token_ids=[5], max_tokens=10**8, request_id="slow"):
                    pass
        assert orchestrator.ended.wait(30)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "max_pending_tokens" in info.value.details()
        deadline = time.monotonic() + 10
        while len(router.servicer.live) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(router.servicer.live) == 0


@pytest.mark.parametrize("orchestrator_type", [EndlessOrchestrator, FirstWriteFloodOrchestrator],
                         ids=["mid-stream", "during-the-first-write"])
def test_slow_reader_is_cancelled_with_bounded_memory(orchestrator_type):
    limits = ServerLimits(max_pending_tokens=512)
    orchestrator = orchestrator_type()
    with router_on_a_thread(orchestrator, limits, max_model_len=10**9) as router:
        servicer = router.servicer
        with PdserveClient(f"127.0.0.1:{router.port}", timeout_s=60) as client:
            stream = client.generate(token_ids=[5], max_tokens=10**8, request_id="slow")
            next(stream)                       # then stop reading
            orchestrator.first_read.set()
            assert orchestrator.ended.wait(30), "the slow reader was never cancelled"
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "max_pending_tokens" in info.value.details()
        assert orchestrator.max_pending_seen <= limits.max_pending_tokens + 8
        deadline = time.monotonic() + 10
        while len(servicer.live) and time.monotonic() < deadline:   # the handler's finally runs on its loop
            time.sleep(0.05)
        assert len(servicer.live) == 0
        print("slow reader got", info.value.code(), info.value.details())


def test_draining_refuses_new_requests_and_waits_for_the_live_ones():
    from router.errors import status_for
    from router.identity import LiveRequests, ShuttingDownError

    async def run():
        live = LiveRequests(max_live=4)
        first, second = live.claim("a"), live.claim(None)
        live.drain()
        drained = asyncio.ensure_future(live.drained())
        with pytest.raises(ShuttingDownError) as refused:
            live.claim("b")
        assert status_for(refused.value) == (grpc.StatusCode.UNAVAILABLE, str(refused.value))
        assert "shutting down" in str(refused.value)
        live.release(first)
        await asyncio.sleep(0)
        assert not drained.done(), "one request is still live"
        live.release(second)
        await asyncio.wait_for(drained, 1)
        empty = LiveRequests(max_live=1)
        await asyncio.wait_for(empty.drained(), 1)   # nothing live: drained at once

    asyncio.run(run())


def test_a_live_labels_release_can_be_awaited_and_an_ending_request_is_told_apart():
    """``released``: the event a call waits on for a live label's release (None for a free one);
    ``ending``: whether the request holding it is unwinding (its handler cancelled: the client left)."""
    from router.identity import LiveRequests

    async def run():
        live = LiveRequests(max_live=4)
        claimed: dict[str, object] = {}
        gate = asyncio.Event()

        async def handler(label: str) -> None:
            claimed[label] = live.claim(label)
            try:
                await gate.wait()
            finally:
                await asyncio.sleep(0.01)   # its unwinding (aborts, metrics) before the release
                live.release(claimed[label])

        running = asyncio.ensure_future(handler("running"))
        ending = asyncio.ensure_future(handler("ending"))
        await asyncio.sleep(0)
        assert live.released("free") is None and live.released(None) is None
        assert not live.ending("running") and not live.ending("ending")
        ending.cancel()
        await asyncio.sleep(0)
        assert live.ending("ending") and not live.ending("running")
        released = live.released("ending")
        assert released is not None and not released.is_set()
        await asyncio.wait_for(released.wait(), 1)
        assert "ending" not in live and live.claim("ending").label == "ending"
        gate.set()
        await running

    asyncio.run(run())
