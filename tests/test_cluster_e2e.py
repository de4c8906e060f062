"""End to end over real gRPC and real Ray actors (tiny random Llama): disaggregated output
equals colocated output equals HF generate; bad input, cancel, deadline and worker faults get
the right status; every test ends with a cluster-wide leak check."""

from __future__ import annotations

import asyncio
import re

import grpc
import ray
import pytest

from deploy.launcher import ClusterConfig, ClusterThread
from engine.config import EngineConfig
from router.client import AsyncPdserveClient, PdserveClient
from tests.conftest import cluster_leaks, greedy_workload, hf_greedy

MODEL = {"seed": 0}


def start_cluster(mode: str, **overrides) -> ClusterThread:
    """Warm spares only where a test asks for them (they cost a process each on 2 cores)."""
    overrides.setdefault("standby_workers", False)
    overrides.setdefault("prefill_engine", EngineConfig(num_kv_blocks=96, max_num_batched_tokens=64))
    overrides.setdefault("decode_engine", EngineConfig(num_kv_blocks=160, block_size=16))
    overrides.setdefault("random_model", None if overrides.get("model") else MODEL)
    config = ClusterConfig(
        mode=mode, port=0, cpus_per_worker=0.5, threads_per_worker=1, allow_fault_injection=True, **overrides,
    )
    cluster = ClusterThread(config)
    cluster.start()
    return cluster


@pytest.fixture(scope="module")
def disagg(ray_session):
    cluster = start_cluster("disaggregated")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def coloc(ray_session):
    cluster = start_cluster("colocated")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def workload(hf_reference):
    return greedy_workload(hf_reference, seed=11, num=16, prompt_len=(1, 120), output_len=(1, 30))


def address(cluster: ClusterThread) -> str:
    return f"127.0.0.1:{cluster.cluster.port}"


async def _concurrent(addr: str, prompts, max_tokens) -> list[list[int]]:
    async with AsyncPdserveClient(addr) as client:
        results = await asyncio.gather(*(
            client.generate_text(token_ids=p, max_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_tokens)
        ))
    return [list(r.token_ids) for r in results]


def test_sixteen_streams_disaggregated_equals_colocated_equals_hf(disagg, coloc, workload):
    prompts, max_tokens, refs = workload
    got_disagg = asyncio.run(_concurrent(address(disagg), prompts, max_tokens))
    got_coloc = asyncio.run(_concurrent(address(coloc), prompts, max_tokens))
    for i, ref in enumerate(refs):
        assert got_disagg[i] == ref, f"disaggregated request {i} differs from HF"
        assert got_coloc[i] == ref, f"colocated request {i} differs from HF"
    assert cluster_leaks(disagg) == {} and cluster_leaks(coloc) == {}


def test_penalties_and_logit_bias_disaggregated_and_colocated_equal_hf(disagg, coloc, hf_reference):
    """On a disaggregated pair the first token is chosen on the prefill worker, the rest on the
    decode worker: both apply the request's adjustments to the same tokens as one engine would."""
    import random

    from engine.types import SamplingParams
    from tests.test_logit_adjust import ADJUSTMENTS, hf_adjusted_greedy

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 30) for _ in range(rng.randint(2, 90))] for _ in ADJUSTMENTS]
    params = [SamplingParams(max_tokens=rng.randint(4, 20), ignore_eos=True, **a) for a in ADJUSTMENTS]
    refs = [hf_adjusted_greedy(hf_reference, p, s.max_tokens, s) for p, s in zip(prompts, params)]

    async def run(cluster):
        async with AsyncPdserveClient(address(cluster)) as client:
            return await asyncio.gather(*(client.generate_text(
                token_ids=p, max_tokens=s.max_tokens, ignore_eos=True, repetition_penalty=s.repetition_penalty,
                frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                logit_bias=dict(s.logit_bias)) for p, s in zip(prompts, params)))

    for cluster in (disagg, coloc):
        results = asyncio.run(run(cluster))
        assert [list(r.token_ids) for r in results] == refs
        assert cluster_leaks(cluster) == {}
    assert all(r.timings.kv_handoff == "ok" for r in asyncio.run(run(disagg)))


@pytest.mark.parametrize("fixture", ["disagg", "coloc"])
def test_cancel_mid_stream_with_every_adjustment_frees_everything(request, fixture):
    """A stream whose every step is adjusted (penalties, bias, allowed set, min_tokens), cancelled
    after its first tokens: nothing of it is left on any worker."""
    cluster = request.getfixturevalue(fixture)
    with PdserveClient(address(cluster)) as client:
        stream = client.generate(token_ids=list(range(10, 60)), max_tokens=400, ignore_eos=True, min_tokens=300,
                                 repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                                 logit_bias={3: 2.0}, allowed_token_ids=list(range(3, 200)), stop_token_ids=[7])
        received = [next(stream) for _ in range(3)]
        stream.close()
    assert all(3 <= t < 200 and t != 7 for msg in received for t in msg.token_ids)
    assert cluster_leaks(cluster) == {}


def test_min_tokens_holds_back_the_first_token_on_the_prefill_worker(disagg, coloc, hf_reference):
    """The first token is chosen where the prompt is prefilled: there too, a stop token id (the
    one plain greedy would start with) cannot end the output before min_tokens."""
    from tests.test_logit_adjust import _hf_min_new_tokens

    prompt = [11, 12, 13, 14, 15, 16, 17]
    stop = hf_greedy(hf_reference, prompt, 1)[0]
    for min_tokens in (0, 4):
        ref = _hf_min_new_tokens(hf_reference, prompt, 20, min_tokens, [2, stop])
        assert (len(ref) == 1) == (min_tokens == 0)
        for cluster in (disagg, coloc):
            with PdserveClient(address(cluster)) as client:
                got = client.generate_text(token_ids=prompt, max_tokens=20, min_tokens=min_tokens, stop_token_ids=[stop])
            assert list(got.token_ids) == ref
            assert cluster_leaks(cluster) == {}


def test_prompt_logprobs_disaggregated_and_colocated_equal_hf(disagg, coloc, hf_reference):
    """Computed where the prompt is prefilled (the prefill worker, or the colocated engine), in
    the first message only, equal to HF's log-softmax over the prompt; a prompt whose blocks are
    cached is computed again (nothing read from the cache) and gives the same; the output stays
    HF's greedy tokens; one that ends with its first token (max_tokens 1) has them too."""
    from tests.test_prompt_logprobs import _assert_matches

    prompts = [tuple(range(40, 40 + n)) for n in (70, 1, 33)] + [tuple(range(40, 110))]   # the last: cached
    asks = [(3, 8), (0, 3), (5, 1), (2, 6)]   # (prompt_logprobs, max_tokens)

    async def run(cluster):
        async with AsyncPdserveClient(address(cluster)) as client:
            first = await client.generate_text(token_ids=list(prompts[0]), max_tokens=8, ignore_eos=True,
                                               prompt_logprobs=3)
            rest = await asyncio.gather(*(client.generate_text(token_ids=list(p), max_tokens=m, ignore_eos=True,
                                                               prompt_logprobs=n)
                                          for p, (n, m) in zip(prompts[1:], asks[1:])))
            plain = await client.generate_text(token_ids=list(prompts[0]), max_tokens=2, ignore_eos=True)
        return [first, *rest], plain

    for cluster in (disagg, coloc):
        results, plain = asyncio.run(run(cluster))
        for prompt, (n, m), result in zip(prompts, asks, results):
            assert result.prompt_logprobs is not None
            _assert_matches(result.prompt_logprobs, hf_reference, prompt, n)
            assert list(result.token_ids) == hf_greedy(hf_reference, list(prompt), m)
        assert results[-1].timings.prefill_cached_tokens == 0, "computed again, not read from the cache"
        assert plain.prompt_logprobs is None
        assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("fixture", ["disagg", "coloc"])
def test_cancel_a_prompt_logprobs_stream_frees_everything(request, fixture):
    cluster = request.getfixturevalue(fixture)
    with PdserveClient(address(cluster)) as client:
        stream = client.generate(token_ids=list(range(10, 130)), max_tokens=300, ignore_eos=True, prompt_logprobs=20)
        first = next(stream)
        next(stream)
        stream.close()
    assert len(first.prompt_logprobs.logprobs) == 119 and len(first.prompt_logprobs.top_logprobs) == 119
    assert cluster_leaks(cluster) == {}


def test_a_burst_of_prompt_logprobs_requests_past_their_ttft_is_shed_and_the_rest_served(disagg, hf_reference):
    """Overload: 24 prompt-logprobs requests at once with a TTFT no queue can meet: admission
    refuses some (RESOURCE_EXHAUSTED naming TTFT), every one it admitted gets HF's prompt logprobs
    and tokens, nothing is left behind, and the cluster serves the next request."""
    from tests.test_prompt_logprobs import _assert_matches

    prompts = [tuple(range(30 + i, 330 + i)) for i in range(24)]

    async def burst():
        async with AsyncPdserveClient(address(disagg)) as client:
            async def one(prompt):
                try:
                    return await client.generate_text(token_ids=list(prompt), max_tokens=4, ignore_eos=True,
                                                      prompt_logprobs=1, ttft_ms=15.0)
                except grpc.aio.AioRpcError as exc:
                    return exc
            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert refused and all(r.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "TTFT" in r.details() for r in refused)
    served = [(p, r) for p, r in zip(prompts, results) if not isinstance(r, grpc.aio.AioRpcError)]
    assert served, "an idle pair is always given the first request"
    for prompt, result in served:
        _assert_matches(result.prompt_logprobs, hf_reference, prompt, 1)
        assert list(result.token_ids) == hf_greedy(hf_reference, list(prompt), 4)
    assert cluster_leaks(disagg) == {}
    with PdserveClient(address(disagg)) as client:
        assert list(client.generate_text(token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True).token_ids) == \
            hf_greedy(hf_reference, [5, 6, 7], 3)


def test_the_stdlib_asyncio_loop_serves_the_same(ray_session, disagg, workload):
    """The router runs on uvloop by default (router/event_loop.py); asyncio's own loop, the
    fallback where uvloop is not installed, serves the same tokens and frees everything."""
    import uvloop

    assert isinstance(disagg.loop, uvloop.Loop)
    cluster = start_cluster("disaggregated", event_loop="asyncio")
    try:
        assert not isinstance(cluster.loop, uvloop.Loop)
        prompts, max_tokens, refs = workload
        assert asyncio.run(_concurrent(address(cluster), prompts, max_tokens)) == refs
        assert cluster_leaks(cluster) == {}
    finally:
        cluster.stop()


def test_final_message_carries_usage_and_timings(disagg):
    with PdserveClient(address(disagg)) as client:
        result = client.generate_text(token_ids=list(range(30, 90)), max_tokens=5, ignore_eos=True)
    assert result.usage.prompt_tokens == 60 and result.usage.completion_tokens == 5
    t = result.timings
    assert t.kv_transfer_bytes > 0 and t.ttft_s > 0 and t.e2e_s >= t.ttft_s
    assert t.prefill_worker_id == "prefill-0" and t.decode_worker_id == "decode-0"
    # The first token's path outside the engine (one node: the cross-process spans are exact).
    path = [t.admission_s, t.dispatch_s, t.to_prefill_worker_s, t.prefill_worker_overhead_s, t.first_token_return_s]
    assert all(s > 0 for s in path) and 0 <= t.reservation_wait_s <= t.prefill_worker_overhead_s
    assert sum(path) + t.queue_s + t.prefill_s <= t.ttft_s
    assert cluster_leaks(disagg) == {}


def test_colocated_prefix_cache_reports_cached_tokens(coloc):
    system = list(range(200, 280))   # 5 blocks of 16
    with PdserveClient(address(coloc)) as client:
        first = client.generate_text(token_ids=system + [7, 8, 9], max_tokens=3, ignore_eos=True).timings
        second = client.generate_text(token_ids=system + [9, 8], max_tokens=3, ignore_eos=True).timings
    assert first.prefill_cached_tokens == 0 and second.prefill_cached_tokens == 80
    assert second.decode_cached_tokens == 0 and second.kv_transfer_bytes == 0, "colocated: no hand-off"
    assert cluster_leaks(coloc) == {}


BAD_REQUESTS = [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [5] * 600}, "token_ids"),
    ({"token_ids": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"token_ids": [5, 6], "max_tokens": -3}, "max_tokens"),
    ({"token_ids": [5] * 500, "max_tokens": 100}, "max_tokens"),
    ({"token_ids": [5, 6], "temperature": -1.0}, "temperature"),
    ({"token_ids": [5, 6], "top_p": 1.5}, "top_p"),
    ({"token_ids": [5, 6], "top_k": -2}, "top_k"),
    ({"token_ids": [5, 100000]}, "token_ids"),
    ({"token_ids": [-1, 5]}, "token_ids"),
    ({"text": "hello"}, "tokenizer"),
    ({"token_ids": [5, 6], "repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"token_ids": [5, 6], "frequency_penalty": 3.0}, "sampling.frequency_penalty"),
    ({"token_ids": [5, 6], "presence_penalty": -2.5}, "sampling.presence_penalty"),
    ({"token_ids": [5, 6], "logit_bias": {7: 101.0}}, "sampling.logit_bias"),
    ({"token_ids": [5, 6], "logit_bias": {100000: 1.0}}, "sampling.logit_bias"),
    ({"token_ids": [5, 6], "min_tokens": 2, "allowed_token_ids": [2]}, "sampling.allowed_token_ids"),   # 2: EOS
    ({"token_ids": [5, 6], "allowed_token_ids": [600]}, "sampling.allowed_token_ids"),
    ({"token_ids": [5, 6], "prompt_logprobs": 21}, "sampling.prompt_logprobs"),
    ({"token_ids": [5, 6], "prompt_logprobs": -1}, "sampling.prompt_logprobs"),
]


@pytest.mark.parametrize("kwargs, needle", BAD_REQUESTS)
def test_bad_input_gets_invalid_argument_and_server_keeps_serving(disagg, kwargs, needle):
    with PdserveClient(address(disagg)) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text(**kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details()
        assert client.generate_text(token_ids=[7, 8, 9], max_tokens=3, ignore_eos=True).finish_reason is not None
    assert cluster_leaks(disagg) == {}


def test_malformed_chat_gets_invalid_argument(disagg):
    with PdserveClient(address(disagg)) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text(chat=[{"role": "wizard", "content": "hi"}])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role" in info.value.details()


@pytest.mark.parametrize("fixture", ["disagg", "coloc"])
def test_cancel_mid_stream_frees_everything(request, fixture):
    cluster = request.getfixturevalue(fixture)
    with PdserveClient(address(cluster)) as client:
        stream = client.generate(token_ids=list(range(10, 60)), max_tokens=400, ignore_eos=True)
        received = [next(stream) for _ in range(3)]
        stream.close()  # stops reading: the client cancels the RPC
    assert len(received) == 3
    assert cluster_leaks(cluster) == {}


def test_deadline_exceeded_frees_everything(disagg):
    with PdserveClient(address(disagg), timeout_s=0.3) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text(token_ids=list(range(10, 60)), max_tokens=450, ignore_eos=True)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cluster_leaks(disagg) == {}


@pytest.mark.parametrize("role", ["prefill-0", "decode-0"])
def test_worker_raising_mid_request_gets_internal(disagg, role, caplog, monkeypatch):
    import router.errors
    from router.failure_log import FailureLog

    # A fresh failure log: the same failure within its window shares a ref logged in the last test.
    monkeypatch.setattr(router.errors, "failure_log", FailureLog(router.errors.logger))
    worker = disagg.cluster.registry.get(role)
    with PdserveClient(address(disagg)) as client:
        if role.startswith("prefill"):   # armed first: the worker's next step is this request's prefill
            ray.get(worker.actor.inject_fault.remote("step"))
        stream = client.generate(token_ids=list(range(10, 40)), max_tokens=300, ignore_eos=True)
        if role.startswith("decode"):
            next(stream)  # the request is decoding when the fault hits
            ray.get(worker.actor.inject_fault.remote("step"))
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
    # The client gets a reference, never the worker's text; the router's log has both.
    assert info.value.code() == grpc.StatusCode.INTERNAL and "injected fault" not in info.value.details()
    ref = re.search(r"internal error \(ref ([0-9a-f]+)\); see router logs", info.value.details()).group(1)
    assert any(ref in r.getMessage() and "injected fault" in r.getMessage() for r in caplog.records)
    with PdserveClient(address(disagg)) as client:  # and the cluster still serves
        assert client.generate_text(token_ids=[3, 4], max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    assert cluster_leaks(disagg) == {}


def test_health_and_reflection_are_served(disagg):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(address(disagg)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Pdserve"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"pdserve.v1.Pdserve", "grpc.health.v1.Health"} <= names


def test_a_burst_past_the_decode_pool_waits_for_room_instead_of_failing(ray_session, hf_reference):
    """Eight prompts at once into a decode pool that holds four, and each grows past its prompt's
    blocks as it decodes (the decode worker preempts): admission's view of the pool is the decode
    worker's last report, which the burst outruns. A full decode side queues, it does not
    refuse: those requests wait for room (in admission, or after a refused reservation) and are
    served, equal to HF, and nothing leaks."""
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(90)] for _ in range(8)]   # 6 blocks each
    cluster = start_cluster("disaggregated", decode_engine=EngineConfig(num_kv_blocks=24, block_size=16))
    try:
        results = asyncio.run(_concurrent(address(cluster), prompts, [20] * len(prompts)))
        metrics = cluster.cluster.metrics
        waited = metrics.admissions.labels("queue", "kv_full")._value.get() \
            + metrics.handoffs.labels("reserve_refused")._value.get()
        assert waited > 0, "no request waited for decode room: the test proved nothing"
        assert results == [hf_greedy(hf_reference, p, 20) for p in prompts]
        assert cluster_leaks(cluster) == {}
    finally:
        cluster.stop()


def test_a_burst_past_the_decode_pool_prefills_each_prompt_once(ray_session, hf_reference):
    """The same burst, each request within its prompt's blocks (no growth, no preemption):
    admission counts the blocks promised to the reservations it sent since the decode worker's
    last report, so it sends no prefill whose reservation that worker would refuse (a refused
    one computes the prompt again under a fresh id): none is refused, the prefill worker admits
    each prompt once, outputs equal HF, nothing leaks."""
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(90)] for _ in range(8)]   # 6 blocks each, with 6 tokens
    cluster = start_cluster("disaggregated", decode_engine=EngineConfig(num_kv_blocks=24, block_size=16))
    try:
        results = asyncio.run(_concurrent(address(cluster), prompts, [6] * len(prompts)))
        metrics = cluster.cluster.metrics
        assert metrics.admissions.labels("queue", "kv_full")._value.get() > 0, "nothing waited: proved nothing"
        assert metrics.handoffs.labels("reserve_refused")._value.get() == 0
        prefill = cluster.cluster.registry.prefill[0]
        assert prefill.stats.prefix_cache_query_tokens == sum(map(len, prompts)), "a prompt was prefilled twice"
        assert results == [hf_greedy(hf_reference, p, 6) for p in prompts]
        assert cluster_leaks(cluster) == {}
    finally:
        cluster.stop()


def test_a_request_that_ends_at_its_first_token_reports_its_prefill(disagg):
    """Found by a probe: max_tokens 1 (no hand-off) reported no prefill time and no cache hit."""
    prompt = [(i * 13) % 400 + 20 for i in range(100)]
    with PdserveClient(address(disagg)) as client:
        cold = client.generate_text(token_ids=prompt, max_tokens=1, ignore_eos=True).timings
        warm = client.generate_text(token_ids=prompt, max_tokens=1, ignore_eos=True).timings
    assert cold.kv_handoff == warm.kv_handoff == "ended_at_prefill"
    assert cold.prefill_s > 0 and warm.prefill_s > 0
    assert cold.prefill_cached_tokens == 0 and warm.prefill_cached_tokens >= 96   # six full 16-token blocks
    assert cluster_leaks(disagg) == {}
