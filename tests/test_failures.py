"""A cluster that keeps serving (real Ray actors, real gRPC, tiny random Llama): kill -9 of a
decode worker mid-stream, of a prefill worker mid-prefill, of both; a paused (unreachable, not
dead) worker. Every stream completes equal to HF generate with no token repeated or missing,
the dead workers are replaced, health says NOT_SERVING exactly while nothing can serve, the
load gauges return to idle once nothing runs, and every test ends with the cluster-wide leak
check."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.launcher import ClusterThread
from router.client import AsyncPdserveClient, GenerationResult, PdserveClient
from tests.conftest import cluster_leaks, greedy_workload, hf_greedy
from tests.test_cluster_e2e import address, start_cluster

RECOVERY_S = 60.0   # generous for a loaded 2-core CI box; the chaos benchmark measures the real figure


@pytest.fixture(scope="module", params=["standby", "cold"])
def cluster(ray_session, request):
    """Replacements from a warm spare (the default), and cold starts (no spare)."""
    cluster = start_cluster("disaggregated", standby_workers=request.param == "standby")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def workload(hf_reference):
    return greedy_workload(hf_reference, seed=23, num=8, prompt_len=(8, 90), output_len=(40, 80))


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


async def _streams(addr: str, prompts, max_tokens, on_first_tokens=None, sampling=None,
                   received: list[int] | None = None) -> list[tuple[list[int], object]]:
    """Run every request as a stream; ``on_first_tokens`` runs once all of them have tokens;
    ``sampling``: one dict of sampling fields per request; ``received``: kept up to date with how
    many tokens each stream has had so far (what ``on_first_tokens`` may look at)."""
    started = asyncio.Event()
    count = {"n": 0}
    received = [0] * len(prompts) if received is None else received

    async def one(client, i, prompt, n, extra):
        tokens, last = [], None
        async for msg in client.generate(token_ids=prompt, max_tokens=n, ignore_eos=True, **extra):
            if not tokens and msg.token_ids:
                count["n"] += 1
                if count["n"] == len(prompts):
                    started.set()
            tokens.extend(msg.token_ids)
            received[i] = len(tokens)
            last = msg
        return tokens, last

    async with AsyncPdserveClient(addr, timeout_s=180) as client:
        extras = sampling or [{}] * len(prompts)
        tasks = [asyncio.create_task(one(client, i, p, n, e))
                 for i, (p, n, e) in enumerate(zip(prompts, max_tokens, extras))]
        if on_first_tokens is not None:
            await asyncio.wait_for(started.wait(), 60)
            on_first_tokens()
        return await asyncio.gather(*tasks)


def _wait_ready(cluster: ClusterThread, worker_id: str, restarts: int) -> None:
    worker = cluster.cluster.registry.get(worker_id)
    deadline = time.monotonic() + RECOVERY_S
    while not (worker.alive and worker.restarts >= restarts):
        assert time.monotonic() < deadline, f"{worker_id} not replaced: {worker.state}"
        time.sleep(0.05)


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Pdserve"), timeout=5).status


def test_kill_decode_worker_mid_stream_every_stream_completes(cluster, workload):
    prompts, max_tokens, refs = workload
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts
    received, at_kill = [0] * len(prompts), []

    def kill():
        at_kill.extend(received)
        _kill(decode.pid)

    results = asyncio.run(_streams(address(cluster), prompts, max_tokens, kill, received=received))
    for i, (tokens, last) in enumerate(results):
        assert tokens == refs[i], f"stream {i} differs from HF (repeated or missing tokens?)"
        # Every stream far from its end at the kill moved, once; one the worker may have finished
        # before it died (the first to start, on a slow machine) moved at most once (found by CI:
        # 1 of 8 streams of 40-80 tokens had them all before the last one's first token came).
        assert last.finish_reason and last.timings.migrations <= 1
        if at_kill[i] < max_tokens[i] // 2:
            assert last.timings.migrations == 1, f"stream {i} was at {at_kill[i]} of {max_tokens[i]} tokens"
    assert sum(r[1].timings.migrations for r in results) >= 1
    _wait_ready(cluster, "decode-0", restarts + 1)
    info = PdserveClient(address(cluster)).server_info()
    states = {w.worker_id: (w.state, w.restarts) for w in info.workers}
    assert states["decode-0"] == ("ready", restarts + 1) and states["prefill-0"][0] == "ready"
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("cluster", ["standby"], indirect=True)   # the kill's moment, not the restart's kind
def test_kill_decode_worker_mid_stream_with_penalties_and_logit_bias(cluster, hf_reference):
    """A migrated request is prefilled elsewhere with the tokens it streamed appended to its
    prompt: its penalties keep counting those as output, so it goes on as if never moved."""
    from engine.types import SamplingParams
    from tests.test_logit_adjust import ADJUSTMENTS, hf_adjusted_greedy

    prompts, max_tokens, _ = greedy_workload(hf_reference, seed=31, num=len(ADJUSTMENTS), prompt_len=(8, 60),
                                             output_len=(40, 70))
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **a) for n, a in zip(max_tokens, ADJUSTMENTS)]
    refs = [hf_adjusted_greedy(hf_reference, p, s.max_tokens, s) for p, s in zip(prompts, params)]
    # min_tokens = max_tokens (EOS ignored: outputs unchanged): a migrated request's max_tokens no
    # longer counts the tokens it streamed, its min_tokens does (a probe: INVALID_ARGUMENT before)
    sampling = [dict(repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
                     presence_penalty=s.presence_penalty, logit_bias=dict(s.logit_bias), min_tokens=s.max_tokens)
                for s in params]
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts
    results = asyncio.run(_streams(address(cluster), prompts, max_tokens, lambda: _kill(decode.pid), sampling))
    for i, (tokens, last) in enumerate(results):
        assert tokens == refs[i], f"stream {i} ({params[i]}) differs from HF after its migration"
        assert last.timings.migrations == 1
    _wait_ready(cluster, "decode-0", restarts + 1)
    assert cluster_leaks(cluster) == {}


@pytest.fixture(scope="module")
def long_workload(hf_reference, workload):
    """Prompts of several chunks each under the prefill worker's 64-token budget."""
    prompts = [p * 4 for p in workload[0]]
    return prompts, [hf_greedy(hf_reference, p, 12) for p in prompts]


def test_kill_prefill_worker_during_prefill_requests_complete(cluster, long_workload):
    long_prompts, long_refs = long_workload
    prefill = cluster.cluster.registry.get("prefill-0")
    restarts = prefill.restarts

    async def run():
        async with AsyncPdserveClient(address(cluster), timeout_s=180) as client:
            tasks = [asyncio.create_task(client.generate_text(token_ids=p, max_tokens=12, ignore_eos=True))
                     for p in long_prompts]
            await asyncio.sleep(0.05)   # the prompts reached the prefill worker's queue
            _kill(prefill.pid)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [list(r.token_ids) for r in results] == long_refs
    moved = [r.timings for r in results if r.timings.migrations or r.timings.kv_handoff == "prefilled_locally"]
    assert moved, "the kill hit no prefill: the test proved nothing"
    _wait_ready(cluster, "prefill-0", restarts + 1)
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("cluster", ["standby"], indirect=True)   # the kill's moment, not the restart's kind
@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_prompt_logprobs_arrive_once_whichever_worker_dies(cluster, hf_reference, victim):
    """Prompt logprobs ride on a request's first message: the prefill worker killed while it
    prefills (the request starts over on its replacement, which computes them), or the decode
    worker killed once every stream has its first tokens (the request moves with them sent:
    nobody sends them again). Each stream gets them exactly once, equal to HF's, and HF's tokens."""
    from tests.test_prompt_logprobs import _assert_matches

    prompts = [list(range(20 + i, 20 + i + n)) for i, n in enumerate((150, 90, 120, 60))]
    # Outputs long enough that no stream ends between its second message and the kill on a busy
    # machine (with 30 tokens, all four once finished first: the kill moved nothing).
    refs = [hf_greedy(hf_reference, p, 160) for p in prompts]
    worker = cluster.cluster.registry.get(victim)
    restarts = worker.restarts

    async def one(client, prompt, messages):
        async for msg in client.generate(token_ids=prompt, max_tokens=160, ignore_eos=True, prompt_logprobs=2):
            messages.append(msg)

    async def run():
        received = [[] for _ in prompts]
        async with AsyncPdserveClient(address(cluster), timeout_s=180) as client:
            tasks = [asyncio.create_task(one(client, p, m)) for p, m in zip(prompts, received)]
            if victim == "prefill-0":
                await asyncio.sleep(0.05)   # the prompts reached the prefill worker's queue
            else:   # every stream past its first message: decoding on the victim
                while any(len(m) < 2 for m in received):
                    await asyncio.sleep(0.005)
            _kill(worker.pid)
            await asyncio.gather(*tasks)
        return received

    results = asyncio.run(run())
    for prompt, ref, messages in zip(prompts, refs, results):
        assert [t for m in messages for t in m.token_ids] == ref
        carrying = [i for i, m in enumerate(messages) if m.HasField("prompt_logprobs")]
        assert carrying == [0], f"prompt logprobs in messages {carrying}"
        collected = GenerationResult()
        collected.add(messages[0])
        _assert_matches(collected.prompt_logprobs, hf_reference, prompt, 2)
    assert any(m.timings.migrations for *_, m in results), "the kill moved no request: the test proved nothing"
    _wait_ready(cluster, victim, restarts + 1)
    assert cluster_leaks(cluster) == {}


def test_prefill_worker_killed_after_streaming_the_first_token(cluster, hf_reference):
    """The first token reaches the client ahead of the KV hand-off; the prefill worker then dies
    mid-hand-off. The request migrates with that token in its prompt: no token repeated or
    missing (output equals HF), the decode reservation freed, the worker replaced."""
    prefill = cluster.cluster.registry.get("prefill-0")
    restarts = prefill.restarts
    prompt = list(range(30, 70))
    ref = hf_greedy(hf_reference, prompt, 10)
    ray.get(prefill.actor.inject_fault.remote("hang_kv_send"))   # the hand-off never finishes
    with PdserveClient(address(cluster), timeout_s=120) as client:
        stream = client.generate(token_ids=prompt, max_tokens=10, ignore_eos=True)
        first = next(stream)
        assert list(first.token_ids) == ref[:1], "the first token came ahead of the hand-off"
        _kill(prefill.pid)
        rest = list(stream)
    assert list(first.token_ids) + [t for msg in rest for t in msg.token_ids] == ref
    assert rest[-1].timings.migrations == 1
    _wait_ready(cluster, "prefill-0", restarts + 1)
    assert cluster_leaks(cluster) == {}


def _health_changes(addr: str, statuses: list[int], watching: threading.Event) -> None:
    """Every status the health service's Watch stream sends (it reports each change), until
    NOT_SERVING has been followed by SERVING: a warm spare replaces a worker that served in
    tens of ms, quicker than a poll of Check would catch the gap."""
    with grpc.insecure_channel(addr) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="pdserve.v1.Pdserve"), timeout=RECOVERY_S)
        for update in stream:
            statuses.append(update.status)
            watching.set()
            if health_pb2.HealthCheckResponse.NOT_SERVING in statuses and statuses[-1] == _SERVING:
                stream.cancel()
                return


_SERVING = health_pb2.HealthCheckResponse.SERVING


def test_both_workers_killed_health_follows_then_serves(cluster, hf_reference):
    registry = cluster.cluster.registry
    prefill, decode = registry.get("prefill-0"), registry.get("decode-0")
    restarts = (prefill.restarts, decode.restarts)
    statuses: list[int] = []
    watching = threading.Event()
    watcher = threading.Thread(target=_health_changes, args=(address(cluster), statuses, watching), daemon=True)
    watcher.start()
    assert watching.wait(10) and statuses == [_SERVING]
    _kill(prefill.pid)
    _kill(decode.pid)
    watcher.join(RECOVERY_S)
    assert statuses == [_SERVING, health_pb2.HealthCheckResponse.NOT_SERVING, _SERVING], statuses
    assert _health(address(cluster)) == _SERVING
    assert decode.alive and decode.restarts == restarts[1] + 1
    prompt = [5, 6, 7, 8, 9]
    with PdserveClient(address(cluster), timeout_s=120) as client:
        result = client.generate_text(token_ids=prompt, max_tokens=8, ignore_eos=True)
    assert list(result.token_ids) == hf_greedy(hf_reference, prompt, 8)
    _wait_ready(cluster, "prefill-0", restarts[0] + 1)
    assert cluster_leaks(cluster) == {}


def test_request_sent_while_nothing_serves_waits_for_the_replacement(cluster, hf_reference):
    """Not yet admitted, never lost: it queues until a decode worker is back."""
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts
    _kill(decode.pid)
    deadline = time.monotonic() + 10
    # Until the loss is seen: a warm spare can take the slot between two polls (restarts moves on).
    while decode.alive and decode.restarts == restarts:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    prompt = [11, 12, 13]
    with PdserveClient(address(cluster), timeout_s=120) as client:
        result = client.generate_text(token_ids=prompt, max_tokens=6, ignore_eos=True)
    assert list(result.token_ids) == hf_greedy(hf_reference, prompt, 6)
    assert decode.restarts == restarts + 1
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("role", ["prefill-0", "decode-0"])
def test_paused_worker_is_transient_not_dead(cluster, workload, role):
    """SIGSTOP for 2 s: calls and streams stall, nothing fails, nothing is replaced."""
    prompts, max_tokens, refs = workload
    worker = cluster.cluster.registry.get(role)
    restarts = worker.restarts

    def pause():
        _kill(worker.pid, signal.SIGSTOP)
        time.sleep(2.0)
        _kill(worker.pid, signal.SIGCONT)

    results = asyncio.run(_streams(address(cluster), prompts, max_tokens, pause))
    assert [t for t, _ in results] == refs
    assert all(last.timings.migrations == 0 for _, last in results)
    assert worker.restarts == restarts and worker.alive
    assert cluster_leaks(cluster) == {}


def test_colocated_worker_killed_mid_stream_streams_complete(ray_session, workload):
    """Colocated mode: the only worker dies; its requests wait for the spare and resume there."""
    prompts, max_tokens, refs = workload
    cluster = start_cluster("colocated", standby_workers=True)
    try:
        worker = cluster.cluster.registry.get("decode-0")
        time.sleep(3)   # let the spare load, so this exercises it
        results = asyncio.run(_streams(address(cluster), prompts[:4], max_tokens[:4], lambda: _kill(worker.pid)))
        assert [t for t, _ in results] == refs[:4]
        assert all(last.timings.migrations == 1 and last.timings.kv_handoff == "" for _, last in results)
        assert worker.restarts == 1 and worker.alive
        assert cluster_leaks(cluster) == {}
    finally:
        cluster.stop()


def test_a_spare_that_dies_idle_is_rebuilt_one_that_dies_loading_falls_back_to_a_cold_start(ray_session, workload):
    """The spare is killed while it waits (a probe found it stayed dead, its 2 GiB pool left in
    /dev/shm, and the next loss then started cold): the pool notices at once, builds another
    (whose pool creation reclaims the dead one's file), and the next worker loss is taken by the
    new spare, its requests complete. Then a spare that dies while it loads: that loss is a cold
    start, and a spare is built again for the one after."""
    from pathlib import Path

    prompts, max_tokens, refs = workload
    cluster = start_cluster("disaggregated", standby_workers=True)
    try:
        standby = cluster.cluster.standby
        spare = cluster.run(standby.peek("decode"), 120)
        (spare_pool,) = Path("/dev/shm").glob(f"pdserve-{ray.get(spare.ping.remote(), timeout=30)}-*.kv")   # pid-named
        ray.kill(spare, no_restart=True)
        rebuilt = _new_spare(cluster, "decode", spare)
        assert not spare_pool.exists(), "the dead spare's pool was left in /dev/shm"
        decode = cluster.cluster.registry.get("decode-0")
        results = asyncio.run(_streams(address(cluster), prompts[:2], max_tokens[:2], lambda: _kill(decode.pid)))
        assert [t for t, _ in results] == refs[:2]
        assert decode.restarts == 1 and decode.alive
        assert decode.actor._actor_id == rebuilt._actor_id, "the loss should be taken by the rebuilt spare"
        cluster.run(_fail_spare(standby, "decode"))
        _kill(decode.pid)
        _wait_ready(cluster, "decode-0", 2)
        assert cluster.run(standby.peek("decode"), 120) is not None, "no spare after a spare failed to load"
        assert cluster_leaks(cluster) == {}
    finally:
        cluster.stop()


def _new_spare(cluster: ClusterThread, kind: str, dead) -> object:
    """The pool's ready spare of ``kind`` once it is another actor than ``dead``."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        spare = cluster.run(cluster.cluster.standby.peek(kind), RECOVERY_S)
        if spare._actor_id != dead._actor_id:
            return spare
        assert time.monotonic() < deadline, "the spare that died idle was not rebuilt"
        time.sleep(0.1)


async def _fail_spare(standby, kind: str) -> None:
    """The spare of ``kind`` dies while it loads (its build fails, as when its process is killed)."""
    import ray

    spare = await standby.take(kind)
    ray.kill(spare, no_restart=True)
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(RuntimeError("the spare's process died while it loaded"))
    standby._spares[kind] = failed


def test_no_reservation_is_freed_under_a_paused_writer(cluster, long_workload):
    """The prefill worker reserves blocks on the decode worker as its prompts arrive, and is
    paused (a live writer that cannot answer) while it still prefills them; then their clients
    cancel: the reservations stay held until the prefill worker confirms its aborts (after it
    resumes), then everything is freed."""
    prompts, _ = long_workload
    registry = cluster.cluster.registry
    prefill, decode = registry.get("prefill-0"), registry.get("decode-0")
    restarts = prefill.restarts

    async def decode_report():
        return await decode.actor.leak_report.remote()

    async def cancelled_while_paused():
        async with AsyncPdserveClient(address(cluster), timeout_s=60) as client:
            tasks = [asyncio.create_task(client.generate_text(token_ids=p, max_tokens=8, ignore_eos=True))
                     for p in prompts[:4]]
            deadline = time.monotonic() + 30
            while (await decode_report())["free_blocks"] == total and time.monotonic() < deadline:
                await asyncio.sleep(0.002)   # until the prefill worker has reserved (its prompts take a while)
            _kill(prefill.pid, signal.SIGSTOP)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    total = cluster.run(decode_report())["total_blocks"]
    try:
        asyncio.run(cancelled_while_paused())
        time.sleep(1.0)   # the router's aborts are under way; the prefill worker's cannot finish
        held = cluster.run(decode_report())
    finally:
        _kill(prefill.pid, signal.SIGCONT)
    assert held["free_blocks"] < held["total_blocks"], "a reservation was freed under a live writer"
    assert prefill.alive and prefill.restarts == restarts, "a paused worker is not a dead one"
    assert cluster_leaks(cluster) == {}


def _worker_gauges(cluster: ClusterThread) -> dict[str, float]:
    """The ``pdserve_worker_*`` load gauges as a scrape reads them (no ServerInfo first: it
    asks every worker for fresh stats, which a scrape never does)."""
    text = cluster.cluster.metrics.exposition().decode()
    names = ("running_requests", "waiting_requests", "waiting_tokens", "kv_usage_ratio")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if any(line.startswith(f"pdserve_worker_{n}{{") for n in names)}


def _kill_decode_and_cancel(cluster, prompts) -> None:
    """Every prompt decoding, the decode worker SIGKILLed, every client cancels; returns once
    the replacement is ready."""
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts

    async def kill_and_cancel():
        async with AsyncPdserveClient(address(cluster), timeout_s=120) as client:
            streams = [client.generate(token_ids=p, max_tokens=100, ignore_eos=True) for p in prompts]
            for stream in streams:
                await stream.__anext__()   # every request is decoding
            _kill(decode.pid)
            for stream in streams:
                await stream.aclose()

    asyncio.run(kill_and_cancel())
    _wait_ready(cluster, "decode-0", restarts + 1)


def test_gauges_return_to_idle_after_a_kill_and_cancels(cluster, workload):
    """The decode worker dies with every request decoding and their clients cancel at once: no
    request reaches the replacement, which stays idle. The load gauges must not keep showing
    the dead process's last report (running requests, KV in use) for as long as nothing runs."""
    _kill_decode_and_cancel(cluster, workload[0])
    deadline = time.monotonic() + 10   # before the leak check: its calls make workers report
    while any(_worker_gauges(cluster).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    stuck = {name: value for name, value in _worker_gauges(cluster).items() if value}
    assert not stuck, f"gauges stuck after the kill: {stuck}"
    assert cluster_leaks(cluster) == {}


def test_cancels_after_a_kill_log_no_error_per_request(cluster, workload, caplog):
    """The decode worker dies with every request decoding and their clients cancel: the death is
    logged (by the components that saw it); the cancelled requests add no ERROR line each (gRPC
    core's ExecuteBatchError for a write into a call the client already ended was an "internal
    error" with a traceback; a first-token read left unretrieved was asyncio's "Task exception
    was never retrieved")."""
    import logging

    with caplog.at_level(logging.INFO):
        _kill_decode_and_cancel(cluster, workload[0])
        assert cluster_leaks(cluster) == {}
    the_death = {"router.supervisor", "router.health", "router.streams"}
    noisy = [f"{r.name}: {r.getMessage()[:300]}" for r in caplog.records
             if r.levelno >= logging.ERROR and r.name not in the_death and not _client_loop_closed(r)]
    assert not noisy, noisy


def _client_loop_closed(record) -> bool:
    """grpc.aio's poller handing an event to this test's own client loop after asyncio.run closed
    it (this process runs the cluster's loop and a loop per test client): the test's artefact,
    not a line the router logs."""
    exc = record.exc_info[1] if record.exc_info else None
    return ("PollerCompletionQueue._handle_events" in record.getMessage()
            and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")


def test_a_kill_is_logged_once_with_pids_and_the_requests_it_moved(cluster, workload, caplog):
    """What an operator reads after a worker's death (a probe: one WARNING per migrating request
    naming Ray's generic 'actor died', no pid, no count, and a warm spare's replacement line
    printing the spare's own 20 s start-up as if it were the restart's): the loss with the dead
    pid, the replacement with its pid and kind, one line counting the requests moved."""
    import logging

    prompts, max_tokens, _ = workload
    decode = cluster.cluster.registry.get("decode-0")
    dead_pid, restarts = decode.pid, decode.restarts
    with caplog.at_level(logging.INFO):
        asyncio.run(_streams(address(cluster), prompts, max_tokens, lambda: _kill(dead_pid)))
        _wait_ready(cluster, "decode-0", restarts + 1)
        time.sleep(1.5)   # the loss log's window
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    lost = [m for name, _, m in said if name == "router.supervisor" and " lost: " in m]
    assert len(lost) == 1 and f"pid {dead_pid}" in lost[0], said
    replaced = [m for name, _, m in said if name == "router.supervisor" and "replaced" in m]
    kind = "a warm spare" if cluster.cluster.standby is not None else "a cold start"
    assert len(replaced) == 1 and f"by {kind} (pid {decode.pid}" in replaced[0], replaced
    moved = [m for name, _, m in said if name == "router.loss_log"]
    assert len(moved) == 1 and f"moved {len(prompts)} request(s)" in moved[0], moved
    per_request = [m for name, level, m in said if name == "router.orchestrator" and level >= logging.INFO
                   and "migrating" in m]
    assert not per_request, per_request[:3]
    assert cluster_leaks(cluster) == {}
