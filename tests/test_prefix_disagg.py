"""Prefix caching across the hand-off, with real Prefill and Decode workers in one process
(tiny random Llama): the decode worker's reservation names only the blocks it does not hold,
the prefill worker skips its own cached prefix, and a second request sharing a prefix moves
fewer bytes; output equals HF generate; both workers end with every block free."""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.types import HandoffOutcome, RequestSpec, SamplingParams
from engine.worker_base import WorkerSpec
from prefill_worker.worker import PrefillWorker
from router.prefix_index import PrefixIndex
from tests.conftest import hf_greedy

BLOCK = 4
MAX_NEW = 6


class InProcessPeer:
    """The prefill worker's view of a decode worker in the same process (no Ray)."""

    peer_id = "in-process"

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self.handles: dict = {}   # the reservations made, by request id

    async def reserve(self, spec, transport: str):
        handle = self.handles[spec.req_id] = await self.worker.reserve(spec, transport)
        return handle

    async def commit(self, req_id: str, first_token_id: int, handle) -> float:
        return await self.worker.commit(req_id, first_token_id, handle)


async def serve(prefill: PrefillWorker, decode: DecodeWorker, transport: str, specs,
                stream=None, decode_events: list | None = None) -> tuple[dict, list]:
    """Each request in turn: prefill (the prefill worker reserves) + hand-off, decode to the
    end. The decode worker's KV events on the batches read go to ``decode_events``."""
    outputs, results = {}, []
    stream = stream or decode.stream()
    peer = InProcessPeer(decode)
    for spec in specs:
        result = await prefill.prefill(spec, transport, peer)
        assert result.outcome is HandoffOutcome.OK, result.error
        results.append((peer.handles[spec.req_id], result))
        tokens = [result.first_token_id]
        while len(tokens) < spec.sampling.max_tokens:
            batch = await stream.__anext__()
            if decode_events is not None:
                decode_events.extend(batch.kv_events)
            for d in batch.deltas:
                if d.req_id == spec.req_id:
                    tokens.extend(d.token_ids)
        outputs[spec.req_id] = tokens
    return outputs, results


@pytest.fixture(scope="module")
def prompts(hf_reference):
    rng = random.Random(3)
    system = [rng.randrange(3, 500) for _ in range(30)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(n)] for n in (7, 12, 3)]
    return prompts, [hf_greedy(hf_reference, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_shared_prefix_moves_fewer_bytes(prompts, transport):
    prompts, refs = prompts
    engine = EngineConfig(num_kv_blocks=64, block_size=BLOCK, max_num_batched_tokens=16)
    specs = [RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
             for i, p in enumerate(prompts)]

    async def run():
        prefill = PrefillWorker(WorkerSpec("prefill-t", random_model={"seed": 0}, engine=engine))
        decode = DecodeWorker(WorkerSpec("decode-t", random_model={"seed": 0}, engine=engine))
        prefill.start()
        decode.start()
        try:
            outputs, results = await serve(prefill, decode, transport, specs)
            return outputs, results, await prefill.leak_report(), await decode.leak_report(), \
                prefill.engine.kv.counters, decode.engine.kv.counters
        finally:
            prefill.shutdown()
            decode.shutdown()

    outputs, results, prefill_leaks, decode_leaks, prefill_hits, decode_hits = asyncio.run(run())
    assert [outputs[s.req_id] for s in specs] == refs
    (h0, r0), (h1, r1), _ = results
    assert h0.num_cached_tokens == 0 and h1.num_cached_tokens == 28, "7 full blocks of the 30-token system prompt"
    assert r1.transfer_bytes < r0.transfer_bytes
    assert r1.transfer_bytes == h1.num_blocks * h1.layout.bytes_per_block
    assert prefill_hits.hits >= 28 * 2 and decode_hits.hits >= 28 * 2
    for report in (prefill_leaks, decode_leaks):
        assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]


def test_workers_report_stored_and_evicted_prefixes_to_the_router_index(prompts):
    """The router's prefix index fed only by the workers' KV events (prefill results, decode
    stream batches): it learns the shared system prompt, then forgets it once both workers'
    pools have evicted it under pressure, in agreement with the workers' own lookups."""
    prompts, refs = prompts
    rng = random.Random(9)
    flood = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]   # 30 blocks > a pool of 24
    engine = EngineConfig(num_kv_blocks=24, block_size=BLOCK, max_num_batched_tokens=16)
    specs = [RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
             for i, p in enumerate([prompts[0], *flood])]
    index = {"prefill": PrefixIndex(BLOCK, enabled=True), "decode": PrefixIndex(BLOCK, enabled=True)}
    probe = prompts[1]                              # shares the 30-token system prompt: 7 full blocks

    def feed(results, decode_events):
        for _, result in results:
            index["prefill"].apply(result.kv_events)
        index["decode"].apply(decode_events)

    async def held(worker) -> int:
        """Prompt tokens of ``probe`` the worker's own cache holds (looked up on its loop)."""
        def look(e) -> int:
            found = len(e.kv.find_cached("probe", probe)) * BLOCK
            e.kv.free("probe")
            return found
        return await worker.call(look)

    async def run():
        prefill = PrefillWorker(WorkerSpec("prefill-t", random_model={"seed": 0}, engine=engine))
        decode = DecodeWorker(WorkerSpec("decode-t", random_model={"seed": 0}, engine=engine))
        prefill.start()
        decode.start()
        stream, seen = decode.stream(), []
        try:
            events: list = []
            outputs, results = await serve(prefill, decode, "local", specs[:1], stream, events)
            feed(results, events)
            seen.append({k: i.expected_hit(probe) for k, i in index.items()})
            truth = [await held(prefill), await held(decode)]
            events = []
            outputs2, results = await serve(prefill, decode, "local", specs[1:], stream, events)
            feed(results, events)
            seen.append({k: i.expected_hit(probe) for k, i in index.items()})
            truth += [await held(prefill), await held(decode)]
            return {**outputs, **outputs2}, seen, truth, await prefill.leak_report(), await decode.leak_report()
        finally:
            prefill.shutdown()
            decode.shutdown()

    outputs, seen, truth, *leaks = asyncio.run(run())
    assert outputs["r0"] == refs[0]
    assert seen[0] == {"prefill": 28, "decode": 28}, "learned from stored events alone"
    assert truth[:2] == [28, 28]
    assert truth[2:] == [0, 0], "both pools evicted the system prompt"
    assert seen[1] == {"prefill": 0, "decode": 0}, "... and the removed events made the index forget it"
    assert index["prefill"].num_gaps == 0 and index["decode"].num_gaps == 0
    for report in leaks:
        assert report["requests"] == 0 and report["free_blocks"] == report["total_blocks"]
