"""The simulated workers (benchmarks/sim_workers.py) and the real router over them
(benchmarks/sim_cluster.py): steps take what the fitted step-time model says, the stats they
report are what admission fits, tokens arrive in order through gRPC, and nothing is left on the
router or on any simulated worker at the end, cancelled streams included. No Ray, no model."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from benchmarks.sim_cluster import SimCluster
from benchmarks.sim_workers import SimConfig, SimDecodeWorker, SimPrefillWorker, SimSpeed, prompt_seed, sim_token
from deploy.launcher import ClusterConfig, ClusterThread
from engine.types import RequestSpec, SamplingParams, StepTiming
from router.client import PdserveClient
from router.limits import ServerLimits
from router.step_model import StepTimeModel
from tests.conftest import cluster_leaks

A, B, C = 0.004, 0.0002, 2e-7       # decode step = A + B * seqs + C * kv tokens
PREFILL_S_PER_TOKEN = 2e-5


def real_like_steps() -> list[StepTiming]:
    decode = [StepTiming(n, n, 0, kv, A + B * n + C * kv) for n, kv in
              [(1, 50), (4, 300), (8, 900), (16, 2000), (32, 3000), (64, 8000)]]
    prefill = [StepTiming(1, t, t, t, t * PREFILL_S_PER_TOKEN) for t in (64, 256, 512)]
    return decode + prefill


SPEED = SimSpeed.fitted(real_like_steps())



async def _last(stream):
    """The last item of a streaming call (the prefill call's result), as the router reads it."""
    items = [await ref async for ref in stream]
    return items[-1]

def test_speed_is_the_fitted_model():
    assert SPEED.prefill_s_per_token == pytest.approx(PREFILL_S_PER_TOKEN)
    for seqs, kv in [(1, 10), (48, 5000), (104, 20000)]:
        assert SPEED.step_s(seqs, kv) == pytest.approx(A + B * seqs + C * kv, rel=1e-6)
    assert SPEED.step_s(4, 100, num_prefill_tokens=300) == pytest.approx(A + 4 * B + 100 * C + 300 * PREFILL_S_PER_TOKEN)


def spec(i: int, prompt: int = 40, max_tokens: int = 6) -> RequestSpec:
    return RequestSpec(f"r{i}", tuple(range(i + 1, i + 1 + prompt)), SamplingParams(max_tokens=max_tokens))


def test_decode_worker_follows_the_step_model_and_reports_what_admission_fits():
    """Requests run locally (prefill chunks, then one token per step for all of them at once):
    each reported step lasts what the model predicts for its shape, the whole run at least their
    sum, every token is the simulator's, and the router's own StepTimeModel, fed the reported
    stats, recovers the coefficients."""

    async def run():
        worker = SimDecodeWorker("d0", SPEED, SimConfig(num_blocks=256))
        worker.start()
        specs = [spec(i, max_tokens=3 + 2 * i) for i in range(5)]   # the batch shrinks from 5 to 1
        start = time.perf_counter()
        for s in specs:
            await worker.add_request(s)
        tokens: dict[str, list[int]] = {s.req_id: [] for s in specs}
        batches = []
        async for batch in worker.stream():
            batches.append(batch)
            for d in batch.deltas:
                tokens[d.req_id] += d.token_ids
            if all(len(tokens[s.req_id]) == s.sampling.max_tokens for s in specs):
                break
        elapsed = time.perf_counter() - start
        leaks = worker.leak_report()
        worker.shutdown()
        return specs, tokens, batches, elapsed, leaks

    specs, tokens, batches, elapsed, leaks = asyncio.run(run())
    steps = batches[-1].stats.recent_steps
    assert len(steps) == 1 + 10   # the prefill step (with the first tokens), then 10 decode steps
    for s in steps:
        assert s.duration_s == pytest.approx(SPEED.step_s(s.num_tokens - s.num_prefill_tokens, s.num_kv_tokens,
                                                          s.num_prefill_tokens))
    assert elapsed >= sum(s.duration_s for s in steps) * 0.99
    assert steps[0].num_prefill_tokens == 5 * 40 and [s.num_seqs for s in steps[1:]] == [5, 5, 4, 4, 3, 3, 2, 2, 1, 1]
    for s in specs:
        assert tokens[s.req_id] == [sim_token(prompt_seed(s), p) for p in range(s.sampling.max_tokens)]
    assert leaks == {"requests": 0, "free_blocks": 256, "total_blocks": 256}
    model = StepTimeModel()
    model.observe(real_like_steps()[6:] + list(steps))   # what admission.observe_stats does with them
    assert model.predict(64, 8000) == pytest.approx(A + 64 * B + 8000 * C, rel=0.05)


def test_prefill_hand_off_and_refusals():
    """A prefill hands its first token and KV over to the reserved decode slot; a reservation
    refused for room comes back as RESERVE_REFUSED, as from the real worker."""
    from benchmarks.sim_cluster import SimActor, SimHost
    from engine.types import HandoffOutcome

    host = SimHost()
    host.start()
    prefill, decode = SimPrefillWorker("p0", SPEED), SimDecodeWorker("d0", SPEED, SimConfig(num_blocks=4))
    p_actor, d_actor = SimActor(prefill, host), SimActor(decode, host)

    async def run():
        await p_actor.start.remote()
        await d_actor.start.remote()
        ok = spec(1, prompt=40)
        result = await _last(p_actor.prefill.remote(ok, "shm", d_actor))
        too_big = spec(2, prompt=200)
        refused = await _last(p_actor.prefill.remote(too_big, "shm", d_actor))
        return ok, result, refused

    try:
        ok, result, refused = asyncio.run(run())
        assert result.outcome is HandoffOutcome.OK and result.first_token_id == sim_token(prompt_seed(ok), 0)
        assert result.transfer_bytes == 3 * 30 * 2 * 16 * 3 * 64 * 4 and result.stats.role == "prefill"
        assert refused.outcome is HandoffOutcome.RESERVE_REFUSED and "KV blocks needed" in refused.error
        assert prefill.leak_report()["requests"] == 0 and prefill.blocks.free == prefill.blocks.total
        assert decode.leak_report()["requests"] == 1   # r1 decodes on
    finally:
        host.stop()


@pytest.fixture(scope="module")
def sim_cluster():
    config = ClusterConfig(num_prefill=2, num_decode=3, port=0,
                           defaults={"limits": ServerLimits(max_concurrent_streams=512)})
    thread = ClusterThread(config, SimCluster(config, SPEED, SimConfig(num_blocks=512)))
    port = thread.start(60)
    yield thread, port
    thread.stop()


def test_streams_through_the_real_router_then_nothing_left(sim_cluster):
    thread, port = sim_cluster
    prompts = [list(range(100 + i, 140 + i)) for i in range(48)]

    async def run():
        from router.client import AsyncPdserveClient

        async with AsyncPdserveClient(f"127.0.0.1:{port}") as client:
            return await asyncio.gather(*(client.generate_text(token_ids=p, max_tokens=12) for p in prompts))

    results = asyncio.run(run())
    for prompt, r in zip(prompts, results):
        seed = prompt_seed(RequestSpec("x", tuple(prompt)))
        assert r.token_ids == [sim_token(seed, p) for p in range(12)] and not r.error
        assert r.timings.kv_handoff == "ok" and r.timings.prefill_worker_id.startswith("prefill-")
    assert {r.timings.decode_worker_id for r in results} == {"decode-0", "decode-1", "decode-2"}
    assert_nothing_left(thread)


def test_cancelled_streams_leave_nothing(sim_cluster):
    thread, port = sim_cluster
    with PdserveClient(f"127.0.0.1:{port}") as client:
        for i in range(6):
            stream = client.generate(token_ids=list(range(7 + i, 60 + i)), max_tokens=500)
            next(stream)     # the first token, then cancel
            stream.close()
    with PdserveClient(f"127.0.0.1:{port}", timeout_s=0.2) as client:
        with pytest.raises(grpc.RpcError) as err:   # past its deadline mid-stream
            for _ in client.generate(token_ids=list(range(3, 30)), max_tokens=5_000):
                pass
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert_nothing_left(thread)


def test_a_request_ending_names_its_decode_worker_to_the_queue(sim_cluster):
    """A request that ends after its first token held room on its decode worker alone: the wake
    it sends queued requests names that worker (each is checked against it, as on its report),
    not every worker (a full decision each). One that ends before its first token also changed
    its prefill worker's queue: its wake names none."""
    thread, port = sim_cluster
    admission = thread.cluster.admission
    woken: list[object] = []
    notify = admission.notify

    def recording(worker=None):
        woken.append(worker)
        notify(worker)

    thread.run(_patched(admission, "notify", recording))
    try:
        with PdserveClient(f"127.0.0.1:{port}") as client:
            results = [client.generate_text(token_ids=list(range(5 + i, 45 + i)), max_tokens=4) for i in range(6)]
        assert all(not r.error for r in results)
        names = [w.worker_id if w is not None else None for w in woken]
        assert None not in names, names
        assert {r.timings.decode_worker_id for r in results} <= set(names)
        woken.clear()
        with PdserveClient(f"127.0.0.1:{port}", timeout_s=0.06) as client:
            with pytest.raises(grpc.RpcError) as err:   # past its deadline in a 6,000-token prefill (120 ms)
                client.generate_text(token_ids=[7] * 6_000, max_tokens=4)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert thread.run(_router_idle(thread.cluster))
        assert None in woken
    finally:
        thread.run(_patched(admission, "notify", notify))
    assert_nothing_left(thread)


async def _patched(obj, name: str, value) -> None:
    """Set an attribute on the cluster's own loop (its handlers read it there)."""
    setattr(obj, name, value)


def assert_nothing_left(thread) -> None:
    """The leak check: no request on any simulated worker, all blocks free, and nothing counted
    on the router (streams registered, requests decoding or prefilling, queued in admission)."""
    assert cluster_leaks(thread) == {}
    cluster = thread.cluster
    assert thread.run(_router_idle(cluster))


async def _router_idle(cluster, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (cluster.streams.num_registered or cluster.admission.num_queued or cluster.orchestrator._cleanups
                or any(w.num_inflight or w.num_prefill_tokens for w in cluster.registry.all)):
            return True
        await asyncio.sleep(0.05)
    return False


def test_the_simulated_cluster_left_no_ray_in_this_process():
    """After the module's simulated cluster (no Ray in it): a Ray instance started here by
    accident (Ray's runtime context auto-inits) outlives it, and the next ``ray.init`` on the
    machine (a ``pdserve serve``) joins it and takes it down at its exit, and this process with it."""
    import ray

    assert not ray.is_initialized()
