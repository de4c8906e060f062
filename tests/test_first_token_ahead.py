"""The prefill worker streams a request's first token ahead of its KV hand-off, with real Prefill
and Decode workers in one process (tiny random Llama): the ``FirstToken`` is yielded while the
decode worker's commit is still held back, the result follows once the KV has landed, the
output equals HF generate, and both workers end with every block free. A request that ends at
its first token, or whose reservation is refused, sends no token ahead (nothing to recompute
after it); a retried call replays the same first token."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.errors import CapacityError
from engine.types import FirstToken, HandoffOutcome, PrefillResult, RequestSpec, SamplingParams
from engine.worker_base import WorkerSpec
from prefill_worker.worker import PrefillWorker
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


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_first_token_is_streamed_before_the_kv_lands(hf_reference, transport):
    spec = RequestSpec("r0", PROMPT, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))

    async def run():
        prefill, decode = _workers()
        gate = asyncio.Event()
        peer = GatedPeer(decode, gate)
        try:
            stream = decode.stream()
            items = prefill.stream(spec, transport, peer)   # it reserves on the decode worker as it prefills
            first = await asyncio.wait_for(items.__anext__(), 60)
            assert isinstance(first, FirstToken) and not peer.committed, "the first token waited for the hand-off"
            assert first.received_s + first.queue_s + first.prefill_s + first.reserve_wait_s <= first.sent_s
            again = prefill.stream(spec, transport, peer)   # a retried call joins the running one
            assert await again.__anext__() == first
            gate.set()
            result = await items.__anext__()
            assert isinstance(result, PrefillResult) and result.outcome is HandoffOutcome.OK and peer.committed
            assert await again.__anext__() == result
            tokens = await _decoded(stream, spec.req_id, [first.token_id], MAX_NEW)
            return tokens, await prefill.leak_report(), await decode.leak_report()
        finally:
            prefill.shutdown()
            decode.shutdown()

    tokens, *reports = asyncio.run(run())
    assert tokens == hf_greedy(hf_reference, list(PROMPT), MAX_NEW)
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
