"""The prefill worker streams a request's first token ahead of its KV hand-off, with real Prefill
and Decode workers in one process (tiny random Llama): the ``FirstToken`` is yielded while the
decode worker's commit is still held back (and reaches the router's first-token inbox too),
the result follows once the KV has landed, the
output equals HF generate, and both workers end with every block free. A request that ends at
its first token, or whose reservation is refused, sends no token ahead (nothing to recompute
after it) and answers without waiting for its reserve; a reserve that arrives after the router
freed the request is refused, so nothing stays held; a retried call replays the same first token."""

from __future__ import annotations

import asyncio
import threading

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.errors import CapacityError, KVTransferError
from engine.types import FirstToken, HandoffOutcome, PrefillResult, RequestSpec, SamplingParams
from engine.worker_base import WorkerSpec
from prefill_worker.worker import PrefillWorker
from router.first_token_inbox import FirstTokenInbox
from tests.conftest import hf_greedy
from tests.test_prefix_disagg import InProcessPeer

PROMPT = tuple(range(40, 77))
MAX_NEW = 6


class GatedPeer(InProcessPeer):
    """The decode worker's commit waits for ``gate``: the hand-off is provably unfinished."""

    def __init__(self, worker: DecodeWorker, gate: asyncio.Event) -> None:
        super().__init__(worker)
        self.gate = gate
        self.committed = False

    async def commit(self, req_id: str, first_token_id: int, handle) -> float:
        await self.gate.wait()
        self.committed = True
        return await super().commit(req_id, first_token_id, handle)


class RefusingPeer(InProcessPeer):
    """A decode worker with no room for the prompt."""

    async def reserve(self, spec, transport: str):
        raise CapacityError("no room for the prompt's blocks")


class LateReservePeer(InProcessPeer):
    """The reserve reaches the decode worker only once ``gate`` opens: as when the router's free
    overtakes it (two callers: Ray orders nothing between them), or the prefill worker died
    after submitting it. ``outcome`` gets what the decode worker answered."""

    def __init__(self, worker: DecodeWorker, gate: asyncio.Event) -> None:
        super().__init__(worker)
        self.gate = gate
        self.outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    async def reserve(self, spec, transport: str):
        await self.gate.wait()
        try:
            handle = await super().reserve(spec, transport)
        except Exception as exc:
            self.outcome.set_result(exc)
            raise
        self.outcome.set_result(handle)
        return handle


def _workers():
    engine = EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    prefill = PrefillWorker(WorkerSpec("prefill-t", random_model={"seed": 0}, engine=engine))
    decode = DecodeWorker(WorkerSpec("decode-t", random_model={"seed": 0}, engine=engine))
    prefill.start()
    decode.start()
    return prefill, decode


async def _decoded(stream, req_id: str, tokens: list[int], max_tokens: int) -> list[int]:
    while len(tokens) < max_tokens:
        batch = await stream.__anext__()
        tokens += [t for d in batch.deltas if d.req_id == req_id for t in d.token_ids]
    return tokens


class LateReservingPeer(GatedPeer):
    """Its reservation holds only once ``reserve_gate`` opens: after the prefill step ended."""

    def __init__(self, worker: DecodeWorker, gate: asyncio.Event, reserve_gate: asyncio.Event) -> None:
        super().__init__(worker, gate)
        self.reserve_gate = reserve_gate

    async def reserve(self, spec, transport: str):
        await self.reserve_gate.wait()
        return await super().reserve(spec, transport)


def _spy(obj, name: str, after) -> None:
    """``obj.name(*args)`` calls ``after(*args)`` once it returned (an instance attribute
    shadows the method: the worker looks it up at each call)."""
    method = getattr(obj, name)

    def spied(*args):
        method(*args)
        after(*args)

    setattr(obj, name, spied)


def _pushes_by_thread(prefill: PrefillWorker) -> list[str]:
    """The threads ``prefill``'s first-token pushes ran on, recorded as they happen."""
    threads: list[str] = []
    push = prefill._pusher.push

    def recorded(path, first):
        threads.append(threading.current_thread().name)
        return push(path, first)

    prefill._pusher.push = recorded
    return threads


# inbox: the router's first-token inbox takes the token (the stream carries only the result);
# late_reserve: the same, but the reservation holds after the prefill step (the event loop
# pushes, not the engine loop thread); none: no inbox named; gone: an inbox that is not there
# (the push fails: the stream carries the token).
@pytest.mark.parametrize("transport,inbox", [("local", "inbox"), ("shm", "inbox"), ("shm", "late_reserve"),
                                             ("shm", "none"), ("local", "gone")])
def test_first_token_is_streamed_before_the_kv_lands(hf_reference, transport, inbox):
    spec = RequestSpec("r0", PROMPT, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))

    async def run():
        prefill, decode = _workers()
        gate, reserve_gate = asyncio.Event(), asyncio.Event()
        peer = LateReservingPeer(decode, gate, reserve_gate) if inbox == "late_reserve" else GatedPeer(decode, gate)
        if inbox != "late_reserve":
            reserve_gate.set()
        router_inbox = FirstTokenInbox()
        threads = _pushes_by_thread(prefill)
        reserved, prefilled = threading.Event(), asyncio.Event()
        _spy(prefill, "_reserved", lambda *_: reserved.set())
        loop = asyncio.get_running_loop()
        _spy(prefill, "_push_from_loop_thread", lambda *_: loop.call_soon_threadsafe(prefilled.set))
        try:
            stream = decode.stream()
            early = router_inbox.expect(spec.req_id)
            path = await router_inbox.start()
            path = {"none": None, "gone": "/nonexistent/pdserve-inbox.sock"}.get(inbox, path)
            if inbox != "late_reserve":   # the engine waits for the reservation (the usual order, made sure)
                prefill.loop.call(lambda e: reserved.wait(60))
            # It reserves on the decode worker as it prefills; the first token goes to the inbox.
            items = prefill.stream(spec, transport, peer, path)
            next_item = asyncio.ensure_future(items.__anext__())
            if inbox == "late_reserve":   # the prefill step ends, then the reservation holds
                await asyncio.wait_for(prefilled.wait(), 60)
                reserve_gate.set()
            if inbox in ("inbox", "late_reserve"):
                first = await asyncio.wait_for(early, 60)
                assert not next_item.done(), "the stream carried a copy of the first token too"
            else:
                first = await asyncio.wait_for(next_item, 60)
                assert not early.done()
            assert isinstance(first, FirstToken) and not peer.committed, "the first token waited for the hand-off"
            assert first.received_s + first.queue_s + first.prefill_s + first.reserve_wait_s <= first.sent_s
            again = prefill.stream(spec, transport, peer)   # a retried call joins the running one
            again_next = asyncio.ensure_future(again.__anext__())
            await asyncio.sleep(0)   # it has joined before the hand-off may end
            if inbox not in ("inbox", "late_reserve"):
                assert await again_next == first   # and replays the first token
                again_next = asyncio.ensure_future(again.__anext__())
            gate.set()
            result = await (next_item if inbox in ("inbox", "late_reserve") else items.__anext__())
            assert isinstance(result, PrefillResult) and result.outcome is HandoffOutcome.OK and peer.committed
            assert result.first_token_id == first.token_id and await again_next == result
            tokens = await _decoded(stream, spec.req_id, [first.token_id], MAX_NEW)
            return tokens, threads, await prefill.leak_report(), await decode.leak_report()
        finally:
            prefill.shutdown()
            decode.shutdown()
            router_inbox.forget(spec.req_id)
            await router_inbox.close()

    tokens, threads, *reports = asyncio.run(run())
    assert tokens == hf_greedy(hf_reference, list(PROMPT), MAX_NEW)
    # The engine loop thread pushes as its step ends when the reservation holds by then.
    expected = {"inbox": ["prefill-t"], "late_reserve": ["MainThread"], "none": [], "gone": ["prefill-t"]}[inbox]
    assert threads == expected
    for report in reports:
        assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]


@pytest.mark.parametrize("case", ["ends_at_prefill", "reservation_refused"])
def test_no_token_goes_ahead_without_a_hand_off(case):
    max_tokens = 1 if case == "ends_at_prefill" else MAX_NEW
    spec = RequestSpec("r1", PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    async def run():
        prefill, decode = _workers()
        try:
            peer = InProcessPeer(decode) if case == "ends_at_prefill" else RefusingPeer(decode)
            items = [item async for item in prefill.stream(spec, "shm", peer)]
            await decode.abort(spec.req_id)   # the unused reservation, as the router frees it
            return items, await prefill.leak_report(), await decode.leak_report()
        finally:
            prefill.shutdown()
            decode.shutdown()

    items, *reports = asyncio.run(run())
    assert len(items) == 1 and isinstance(items[0], PrefillResult), items
    expected = HandoffOutcome.ENDED_AT_PREFILL if case == "ends_at_prefill" else HandoffOutcome.RESERVE_REFUSED
    assert items[0].outcome is expected and items[0].first_token_id is not None
    for report in reports:
        assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]


def test_a_reserve_that_arrives_after_the_routers_free_is_refused():
    """Ends at its first token while its reserve is still on its way: the result comes at once,
    the router frees the request on the decode worker, and the late reserve is refused there."""
    spec = RequestSpec("r2", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True))

    async def run():
        prefill, decode = _workers()
        try:
            peer = LateReservePeer(decode, asyncio.Event())
            items = await asyncio.wait_for(_collect(prefill.stream(spec, "shm", peer)), 60)
            await decode.abort(spec.req_id)   # the router frees the unused reservation
            peer.gate.set()
            late = await asyncio.wait_for(peer.outcome, 30)
            return items, late, await prefill.leak_report(), await decode.leak_report()
        finally:
            prefill.shutdown()
            decode.shutdown()

    items, late, *reports = asyncio.run(run())
    assert [item.outcome for item in items] == [HandoffOutcome.ENDED_AT_PREFILL]
    assert isinstance(late, KVTransferError) and "ended this request" in str(late), late
    for report in reports:
        assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]


async def _collect(stream) -> list:
    return [item async for item in stream]


@pytest.mark.parametrize("num_requests", [1, 3])
def test_the_last_result_of_a_burst_reports_every_block_back(num_requests):
    """A prefill worker reports its stats only on its results (it has no stream), so the
    result that leaves it idle must show the blocks its hand-off released: the router's
    gauges (KV usage, free blocks) read that report until the next request, however long."""
    specs = [RequestSpec(f"b{i}", tuple(range(40 + i, 77 + 5 * i)), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
             for i in range(num_requests)]

    async def run():
        prefill, decode = _workers()
        try:
            peer = InProcessPeer(decode)
            results = await asyncio.gather(*(prefill.prefill(spec, "shm", peer) for spec in specs))
            for spec in specs:
                await decode.abort(spec.req_id)
            return results, await prefill.leak_report(), await decode.leak_report()
        finally:
            prefill.shutdown()
            decode.shutdown()

    results, *reports = asyncio.run(run())
    assert all(r.outcome is HandoffOutcome.OK for r in results)
    for report in reports:
        assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]
    last = results[-1].stats   # the last to finish here (each hands off in order)
    assert (last.num_running, last.num_waiting) == (0, 0)
    assert last.num_free_blocks == last.num_total_blocks, "the idle worker's last report shows blocks held"
