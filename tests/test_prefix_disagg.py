"""Prefix caching across the hand-off, with real Prefill and Decode workers in one process
(tiny random Llama): the decode worker's reservation names only the blocks it does not hold,
the prefill worker skips its own cached prefix, and a second request sharing a prefix moves
fewer bytes; output equals HF generate; both workers end with every block free."""

from __future__ import annotations

import asyncio
import inspect
import random

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.types import HandoffOutcome, RequestSpec, SamplingParams
from engine.worker_base import WorkerSpec
from prefill_worker.worker import PrefillWorker
from tests.conftest import hf_greedy

BLOCK = 4
MAX_NEW = 6


class InProcessPeer:
    """The prefill worker's view of a decode worker in the same process (no Ray)."""

    peer_id = "in-process"

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def reservation(self, handle):
        return await handle if inspect.isawaitable(handle) else handle

    async def commit(self, req_id: str, first_token_id: int, handle) -> float:
        return await self.worker.commit(req_id, first_token_id, handle)


async def serve(prefill: PrefillWorker, decode: DecodeWorker, transport: str, specs) -> tuple[dict, list]:
    """Each request in turn: reserve, prefill + hand-off, decode to the end."""
    outputs, results = {}, []
    stream = decode.stream()
    peer = InProcessPeer(decode)
    for spec in specs:
        handle = await decode.reserve(spec, transport)
        result = await prefill.prefill(spec, handle, peer)
        assert result.outcome is HandoffOutcome.OK, result.error
        results.append((handle, result))
        tokens = [result.first_token_id]
        while len(tokens) < spec.sampling.max_tokens:
            batch = await stream.__anext__()
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
