"""A worker alive but hung is killed and replaced, and its requests go on elsewhere: the router's
stall watch (router/stall_watch.py) over the engine loop's turn clock (EngineLoop.turn_s).

Unit tests drive the watch against a scripted actor; cluster tests (real Ray actors, real gRPC,
tiny random Llama) freeze a worker's process with SIGSTOP and leave it frozen, or wedge a
decode worker's forward for good (the ``hang_step`` fault): every stream completes equal to HF
generate, the worker is replaced, the stall is counted, and the leak check is clean. A pause
shorter than the timeout stays a pause."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from engine.config import EngineConfig
from engine.loop import EngineLoop
from router.client import AsyncPdserveClient
from router.registry import WorkerHandle
from router.stall_watch import Stall, watch_stalls
from tests.conftest import cluster_leaks, greedy_workload, hf_greedy
from tests.test_cluster_e2e import address, start_cluster
from tests.test_failures import _kill, _streams, _wait_ready

STALL_TIMEOUT_S = 8.0   # far above any step of the tiny model, even on a loaded 2-core box


# ---------------------------------------------------------------- the engine loop's turn clock


class _IdleEngine:
    """Just enough engine for EngineLoop: never has work of its own."""

    class grammars:
        on_compiled = None

    def has_work(self) -> bool:
        return False

    def stats(self, name: str):
        return None

    def take_kv_events(self):
        return ()


def test_turn_clock_reads_zero_while_idle_and_runs_during_a_turn():
    loop = EngineLoop(_IdleEngine(), on_step=lambda result: None)
    loop.start()
    try:
        assert loop.call(lambda e: None).result(5) is None
        time.sleep(0.05)
        assert loop.turn_s() == 0.0, "an idle loop is waiting, not in a turn"
        release = threading.Event()
        blocked = loop.call(lambda e: release.wait(10))
        time.sleep(0.3)
        assert loop.turn_s() >= 0.25, "a call that does not return keeps the turn running"
        release.set()
        blocked.result(5)
        time.sleep(0.05)
        assert loop.turn_s() == 0.0
    finally:
        loop.stop()


# ---------------------------------------------------------------- the watch, on a scripted actor

_NEVER = object()


class _Late:
    """A scripted answer that comes after ``delay_s`` (a process paused, then resumed)."""

    def __init__(self, delay_s: float, turn_s: float = 0.0) -> None:
        self.delay_s, self.turn_s = delay_s, turn_s


class _Heartbeats:
    """``actor.heartbeat.remote()``: each call takes the next scripted answer (a float, an
    exception to raise, or _NEVER: no answer); past the script, 0.0."""

    def __init__(self, answers) -> None:
        self.answers = list(answers)
        self.calls = 0

    def remote(self):
        answer = self.answers.pop(0) if self.answers else 0.0
        self.calls += 1

        async def reply():
            if answer is _NEVER:
                await asyncio.Event().wait()
            if isinstance(answer, _Late):
                await asyncio.sleep(answer.delay_s)
                return answer.turn_s
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return reply()


class _Actor:
    def __init__(self, answers) -> None:
        self.heartbeat = _Heartbeats(answers)


def _watch(answers, timeout_s=0.4, until_s=2.0, change=None):
    """Run the watch for up to ``until_s``; returns (stalls reported, heartbeat calls)."""
    actor = _Actor(answers)
    worker = WorkerHandle("decode-0", "decode", actor, "n", "cpu")
    stalls = []

    async def run():
        task = asyncio.create_task(watch_stalls(worker, 0, timeout_s, lambda w, g, why, s: stalls.append((g, why, s))))
        if change is not None:
            await asyncio.sleep(0.15)
            change(worker)
        try:
            await asyncio.wait_for(task, until_s)
        except TimeoutError:
            pass
    asyncio.run(run())
    return stalls, actor.heartbeat.calls


def test_a_long_turn_is_a_stall():
    stalls, _ = _watch([0.0, 0.1, 0.5])
    assert [(g, why) for g, why, _ in stalls] == [(0, Stall.LONG_TURN)]
    assert stalls[0][2] == 0.5


def test_no_answer_for_the_timeout_is_a_stall():
    started = time.monotonic()
    stalls, _ = _watch([0.0, _NEVER])
    assert [why for _, why, _ in stalls] == [Stall.NO_ANSWER]
    assert 0.4 <= stalls[0][2] < 1.0 and time.monotonic() - started < 1.5


def test_short_turns_and_a_moment_unreachable_are_not_stalls():
    unavailable = ActorUnavailableError("paused", None)
    stalls, calls = _watch([0.1, unavailable, unavailable, 0.2, 0.0], until_s=1.0)
    assert stalls == [] and calls >= 6, "the watch kept asking"


def test_unreachable_for_the_whole_timeout_is_a_stall():
    stalls, _ = _watch([ActorUnavailableError("gone quiet", None)] * 50)
    assert [why for _, why, _ in stalls] == [Stall.NO_ANSWER]


def _said(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.stall_watch"]


def test_a_slow_turn_that_ends_under_the_timeout_is_one_warning_then_its_end(caplog):
    caplog.set_level("INFO", logger="router.stall_watch")
    stalls, _ = _watch([0.0, 0.1, 0.25, 0.3, 0.35, 0.0, 0.05, 0.0], until_s=1.2)
    assert stalls == []
    said = _said(caplog)
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "engine turn" in said[0][1] and "has run 0.2 s" in said[0][1] and "--worker-stall-timeout" in said[0][1]
    assert "ended (it ran at least 0.3 s)" in said[1][1]   # 0.35, as last seen


def test_a_silence_that_ends_under_the_timeout_is_one_warning_then_its_end(caplog):
    caplog.set_level("INFO", logger="router.stall_watch")
    stalls, _ = _watch([0.0, _Late(0.2), 0.0, 0.0], until_s=1.2)   # 0.3 s since the last answer
    assert stalls == []
    said = _said(caplog)
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert "no heartbeat for 0.2 s" in said[0][1] and "answered its heartbeat again after 0.3 s" in said[1][1]


def test_a_stall_past_the_timeout_is_warned_of_on_the_way(caplog):
    caplog.set_level("INFO", logger="router.stall_watch")
    stalls, _ = _watch([0.0, _NEVER])
    assert [why for _, why, _ in stalls] == [Stall.NO_ANSWER]
    assert [level for level, _ in _said(caplog)] == ["WARNING"]


def test_short_turns_say_nothing(caplog):
    caplog.set_level("INFO", logger="router.stall_watch")
    _watch([0.1, 0.15, 0.0, 0.19, 0.0], until_s=0.8)
    assert _said(caplog) == []


def test_a_dead_actor_is_left_to_the_lifeline():
    stalls, calls = _watch([0.0, ActorDiedError()])
    assert stalls == [] and calls == 2


def test_the_watch_ends_with_its_generation():
    stalls, calls = _watch([_NEVER], change=lambda w: w.mark_down(0), until_s=1.0)
    assert stalls == [], "a slot already down is not reported again"
    stalls, calls = _watch([0.0] * 3 + [_NEVER], change=lambda w: setattr(w, "generation", 1), until_s=1.0)
    assert stalls == []


# ---------------------------------------------------------------- a live cluster


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = start_cluster("disaggregated", standby_workers=True, worker_stall_timeout_s=STALL_TIMEOUT_S,
                            prefill_engine=EngineConfig(num_kv_blocks=96, max_num_batched_tokens=64))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def workload(hf_reference):
    return greedy_workload(hf_reference, seed=41, num=6, prompt_len=(8, 90), output_len=(60, 90))


def _stalls(cluster, worker_id: str, role: str) -> float:
    value = cluster.cluster.metrics.registry.get_sample_value(
        "pdserve_worker_stalls_total", {"worker": worker_id, "role": role})
    return value or 0.0


def _assert_migrated_exact(results, refs):
    for i, (tokens, last) in enumerate(results):
        assert tokens == refs[i], f"stream {i} differs from HF (repeated or missing tokens?)"
        assert last.finish_reason and last.timings.migrations == 1


def test_frozen_decode_worker_is_replaced_and_its_streams_complete(cluster, workload):
    """SIGSTOP, never SIGCONT: no heartbeat comes back, the worker is killed and replaced, and
    every stream resumes on the replacement."""
    prompts, max_tokens, refs = workload
    decode = cluster.cluster.registry.get("decode-0")
    restarts, stalls = decode.restarts, _stalls(cluster, "decode-0", "decode")
    frozen = []

    def freeze():
        frozen.append(decode.pid)
        _kill(decode.pid, signal.SIGSTOP)

    started = time.monotonic()
    results = asyncio.run(_streams(address(cluster), prompts, max_tokens, freeze))
    _assert_migrated_exact(results, refs)
    assert time.monotonic() - started < 60
    _wait_ready(cluster, "decode-0", restarts + 1)
    assert _stalls(cluster, "decode-0", "decode") == stalls + 1
    assert not _process_alive(frozen[0]), "the frozen process was killed"
    assert cluster_leaks(cluster) == {}


def test_hung_decode_step_is_replaced_and_its_streams_complete(cluster, workload):
    """The forward never returns (a deadlock, a collective on a lost peer): the process answers
    its heartbeat, which says its turn has run too long."""
    prompts, max_tokens, refs = workload
    decode = cluster.cluster.registry.get("decode-0")
    restarts, stalls = decode.restarts, _stalls(cluster, "decode-0", "decode")
    actor = decode.actor
    results = asyncio.run(_streams(address(cluster), prompts, max_tokens,
                                   lambda: ray.get(actor.inject_fault.remote("hang_step"))))
    _assert_migrated_exact(results, refs)
    _wait_ready(cluster, "decode-0", restarts + 1)
    assert _stalls(cluster, "decode-0", "decode") == stalls + 1
    assert cluster_leaks(cluster) == {}


def test_frozen_prefill_worker_is_replaced_and_its_requests_complete(cluster, hf_reference):
    """Frozen mid-prefill (prompts of several chunks each): the requests are prefilled again
    on the replacement (or on the decode worker), equal to HF."""
    prompts, _, _ = greedy_workload(hf_reference, seed=43, num=4, prompt_len=(150, 250), output_len=(1, 2))
    refs = [hf_greedy(hf_reference, p, 8) for p in prompts]
    prefill = cluster.cluster.registry.get("prefill-0")
    restarts, stalls = prefill.restarts, _stalls(cluster, "prefill-0", "prefill")

    async def run():
        async with AsyncPdserveClient(address(cluster), timeout_s=120) as client:
            tasks = [asyncio.create_task(client.generate_text(token_ids=p, max_tokens=8, ignore_eos=True))
                     for p in prompts]
            await asyncio.sleep(0.05)   # the prompts reached the prefill worker's queue
            _kill(prefill.pid, signal.SIGSTOP)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [list(r.token_ids) for r in results] == refs
    _wait_ready(cluster, "prefill-0", restarts + 1)
    assert _stalls(cluster, "prefill-0", "prefill") == stalls + 1
    assert cluster_leaks(cluster) == {}


def test_a_pause_shorter_than_the_timeout_is_not_a_stall(cluster, workload):
    prompts, max_tokens, refs = workload
    decode = cluster.cluster.registry.get("decode-0")
    restarts, stalls = decode.restarts, _stalls(cluster, "decode-0", "decode")

    def pause():
        _kill(decode.pid, signal.SIGSTOP)
        time.sleep(STALL_TIMEOUT_S / 2)
        _kill(decode.pid, signal.SIGCONT)

    results = asyncio.run(_streams(address(cluster), prompts, max_tokens, pause))
    assert [t for t, _ in results] == refs
    assert all(last.timings.migrations == 0 for _, last in results)
    assert decode.restarts == restarts and _stalls(cluster, "decode-0", "decode") == stalls
    assert cluster_leaks(cluster) == {}


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
