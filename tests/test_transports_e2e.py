"""Every KV transport end to end (real Ray actors, real gRPC, tiny random Llama): output equals
HF generate; a failed hand-off is recomputed, never decoded from garbage; a worker that dies in a
torch.distributed group is replaced, its request migrates, the pairs route around the broken
group until it is formed again with the replacement. Each test ends with a cluster-wide leak check."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray

from router.client import PdserveClient
from tests.conftest import cluster_leaks, greedy_workload, hf_greedy
from tests.test_cluster_e2e import _concurrent, address, start_cluster


@pytest.fixture(scope="module")
def small_workload(hf_reference):
    return greedy_workload(hf_reference, seed=5, num=8, prompt_len=(5, 100), output_len=(2, 20))


@pytest.fixture(scope="module")
def cluster(ray_session):
    """Started with torch_dist forced so the process group is up; tests switch transports."""
    cluster = start_cluster("disaggregated", kv_transport="torch_dist")
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("transport", ["shm", "torch_dist", "object_store"])
def test_each_transport_matches_hf(cluster, small_workload, transport):
    registry = cluster.cluster.registry
    registry.force_transport(transport)
    prompts, max_tokens, refs = small_workload
    got = asyncio.run(_concurrent(address(cluster), prompts, max_tokens))
    assert got == refs
    with PdserveClient(address(cluster)) as client:
        timings = client.generate_text(token_ids=prompts[0], max_tokens=2, ignore_eos=True).timings
    assert timings.kv_transfer_bytes > 0
    assert registry.transport(registry.prefill[0], registry.decode[0]) == transport
    assert cluster_leaks(cluster) == {}


def test_failed_hand_off_is_recomputed(cluster, small_workload):
    prompts, max_tokens, refs = small_workload
    prefill = cluster.cluster.registry.get("prefill-0")
    ray.get(prefill.actor.inject_fault.remote("kv_send"))
    with PdserveClient(address(cluster)) as client:
        # min_tokens = max_tokens: the recompute continues after the first token, which its
        # max_tokens no longer counts and its min_tokens does (a probe: INVALID_ARGUMENT before)
        result = client.generate_text(token_ids=prompts[1], max_tokens=max_tokens[1], ignore_eos=True,
                                      min_tokens=max_tokens[1])
    assert list(result.token_ids) == refs[1]
    assert result.timings.kv_transfer_bytes == 0, "nothing moved: the decode worker recomputed"
    assert result.timings.kv_handoff == "transfer_failed" and result.timings.recomputed_on_decode
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("transport", ["shm", "torch_dist", "object_store"])
def test_shared_prefix_moves_fewer_bytes(cluster, hf_reference, transport):
    """The decode worker's prefix cache holds the shared system prompt after the first request:
    the second moves only the blocks after it, whatever the transport."""
    registry = cluster.cluster.registry
    registry.force_transport(transport)
    rng = random.Random(transport)
    system = [rng.randrange(3, 512) for _ in range(70)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(n)] for n in (20, 9)]
    sent = []
    with PdserveClient(address(cluster)) as client:
        for p in prompts:
            result = client.generate_text(token_ids=p, max_tokens=4, ignore_eos=True)
            assert list(result.token_ids) == hf_greedy(hf_reference, p, 4)
            sent.append(result.timings)
    first, second = sent
    assert 0 < second.kv_transfer_bytes < first.kv_transfer_bytes, f"{transport}: {sent}"
    assert (first.decode_cached_tokens, second.decode_cached_tokens) == (0, 64), "4 blocks of 16 held by decode"
    assert second.prefill_cached_tokens == 64 and second.kv_transfer_saved_bytes > 0
    assert second.kv_transfer_saved_bytes == 4 * second.kv_transfer_bytes, "79 tokens: 4 blocks held, 1 moved"
    for worker in (registry.prefill[0], registry.decode[0]):   # KV events crossed Ray to the router's index
        assert worker.prefix.last_seq > 0, worker.worker_id
    assert cluster_leaks(cluster) == {}


def _torch_dist_handoffs(cluster) -> float:
    return cluster.cluster.metrics.registry.get_sample_value(
        "pdserve_kv_transfer_bytes_count", {"transport": "torch_dist"}) or 0.0


def _group_gauge(cluster) -> float | None:
    return cluster.cluster.metrics.registry.get_sample_value("pdserve_kv_group_up")


def _wait_for_group(registry, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not registry.dist_ready:
        assert time.monotonic() < deadline, "the KV group was not formed again"
        time.sleep(0.2)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_dead_member_of_the_kv_group_is_replaced_and_the_group_formed_again(cluster, hf_reference, role):
    """A worker of the torch.distributed group dies mid-stream (the decode worker, or the prefill
    worker: rank 0, whose node holds the group's store). The stream migrates (output still equals
    HF) while pairs route around the broken group; the worker is replaced and the group formed
    again with it, after which KV moves over torch.distributed again."""
    registry = cluster.cluster.registry
    registry.force_transport("torch_dist")
    victim = registry.get(f"{role}-0")
    restarts = victim.restarts
    formed = cluster.cluster.kv_group.num_formed
    prompt = list(range(10, 40))
    with PdserveClient(address(cluster)) as client:
        stream = client.generate(token_ids=prompt, max_tokens=60, ignore_eos=True)
        tokens = list(next(stream).token_ids)
        victim.actor.inject_fault.remote("die")
        for msg in stream:
            tokens.extend(msg.token_ids)
            last = msg
    assert tokens == hf_greedy(hf_reference, prompt, 60)
    if role == "decode":   # the prefill worker's part was done: only the decode side's loss moves it
        assert last.timings.migrations == 1
    _wait_for_group(registry)
    assert victim.restarts == restarts + 1 and victim.alive
    assert cluster.cluster.kv_group.num_formed == formed + 1 and _group_gauge(cluster) == 1.0
    assert registry.transport(registry.prefill[0], registry.decode[0]) == "torch_dist"
    moved = _torch_dist_handoffs(cluster)
    with PdserveClient(address(cluster)) as client:
        result = client.generate_text(token_ids=prompt, max_tokens=5, ignore_eos=True)
    assert list(result.token_ids) == hf_greedy(hf_reference, prompt, 5) and result.timings.kv_handoff == "ok"
    assert _torch_dist_handoffs(cluster) == moved + 1, "the KV did not move over the new group"
    assert cluster_leaks(cluster) == {}
