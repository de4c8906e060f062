"""The parts of worker-failure recovery that need no cluster: a migrated request resumes exactly
(greedy and seeded sampling), the attempt bookkeeping, Ray's failure modes told apart (an
unavailable actor is retried, a dead one is lost), the supervisor's backoff, the fence that
keeps a late writer out of a freed reservation, and one failure event costing one migration
(the real orchestrator over in-process decode workers behind Ray-like handles that die on
demand). Engine tests end with a leak check."""

from __future__ import annotations

import asyncio
import inspect
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import KVTransferError, WorkerFailedError
from engine.request import Request
from engine.types import KVLayout, RequestSpec, SamplingParams, StepTiming, TokenDelta, WorkerStats
from kvtransfer.handle import KVBlocksHandle
from router import supervisor as supervisor_module
from router.admission import Admission
from router.migration import RequestMigration
from router.registry import WorkerHandle, WorkerRegistry, WorkerState
from router.supervisor import Supervisor
from router.worker_calls import WorkerLost, call
from tests.conftest import assert_no_leaks


@pytest.fixture()
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128))


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=30, ignore_eos=True),
    SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, top_p=0.9, seed=1234),
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 7, 29])
def test_resumed_request_continues_exactly(engine, sampling, cut):
    prompt = (17, 4, 99, 250, 3, 8)
    whole = engine.generate([RequestSpec("whole", prompt, sampling)])["whole"]
    run = RequestMigration(RequestSpec("r", prompt, sampling))
    for t in whole[:cut]:
        run.sent(TokenDelta("r", (t,)))
    run.migrate("worker died")
    resumed = run.attempt_spec()
    assert resumed.req_id != "r" and resumed.num_generated == cut
    assert resumed.sampling.max_tokens == 30 - cut
    rest = engine.generate([resumed])[resumed.req_id]
    assert whole[:cut] + rest == whole
    assert_no_leaks(engine)


def test_migration_limit_gives_up_with_the_cause():
    run = RequestMigration(RequestSpec("r", (1, 2)), limit=2)
    run.migrate("a")
    run.migrate("b")
    assert run.attempt_spec().req_id == "r.m2"
    with pytest.raises(WorkerFailedError, match="migration limit.*c"):
        run.migrate("c")


def test_deltas_reach_the_client_under_its_own_id():
    run = RequestMigration(RequestSpec("client-id", (1, 2)))
    run.migrate("x")
    out = run.sent(TokenDelta(run.attempt_spec().req_id, (5, 6)))
    assert out.req_id == "client-id" and run.sent_token_ids == [5, 6]


def test_generated_tail_reaches_into_a_migrated_prompt():
    spec = RequestSpec("r", (1, 2, 3, 40, 41), num_generated=2)
    request = Request(spec)
    request.append_output(42, None)
    assert request.generated_tail(10) == [40, 41, 42]   # never the real prompt
    assert request.generated_tail(2) == [41, 42]
    assert request.num_generated == 3


# ---------------------------------------------------------------- Ray's failure modes


class FlakyActor:
    """``ping`` raises the given errors in turn, then answers."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.calls = 0
        self.ping = SimpleNamespace(remote=self._remote)

    def _remote(self, *args):
        self.calls += 1

        async def answer():
            if self.errors:
                raise self.errors.pop(0)
            return "pong"
        return answer()


def _worker(actor) -> WorkerHandle:
    return WorkerHandle("w0", "decode", actor, "node", "cpu")


def test_unavailable_actor_is_retried_not_lost():
    actor = FlakyActor([ActorUnavailableError("blip", None), ActorUnavailableError("blip", None)])
    worker = _worker(actor)
    assert asyncio.run(call(worker, "ping")) == "pong"
    assert actor.calls == 3 and worker.alive


def test_unavailable_for_too_long_is_lost():
    actor = FlakyActor([ActorUnavailableError("blip", None)] * 100)
    with pytest.raises(WorkerLost, match="unreachable"):
        asyncio.run(call(_worker(actor), "ping", give_up_s=0.3))


def test_dead_actor_is_lost_at_once():
    actor = FlakyActor([ActorDiedError()])
    with pytest.raises(WorkerLost) as info:
        asyncio.run(call(_worker(actor), "ping"))
    assert actor.calls == 1 and info.value.generation == 0


def test_a_call_for_a_replaced_generation_is_lost():
    worker = _worker(FlakyActor([]))
    worker.mark_down(0)
    worker.replace(FlakyActor([]), {"node_id": "n", "device": "cpu"})
    with pytest.raises(WorkerLost):
        asyncio.run(call(worker, "ping", generation=0))
    assert asyncio.run(call(worker, "ping", generation=1)) == "pong"


def test_only_the_first_report_of_a_generation_takes_the_slot_down():
    worker = _worker(None)
    worker.decoding["r"] = object()
    assert worker.mark_down(0) and worker.state is WorkerState.RESTARTING
    assert not worker.mark_down(0)
    worker.replace("new actor", {"node_id": "n", "device": "cpu", "shm_path": "/dev/shm/x", "pid": 7})
    assert worker.alive and worker.generation == 1 and worker.restarts == 1 and not worker.decoding
    assert not worker.mark_down(0)
    assert worker.alive


# ---------------------------------------------------------------- the supervisor


async def _spawn(w):
    """A replacement actor at once (a name stands for it)."""
    return f"actor-{w.generation + 1}", {"node_id": "n", "device": "cpu"}


def _recorded_sleeps(monkeypatch) -> list[float]:
    """The supervisor's backoff delays, recorded instead of slept."""
    delays: list[float] = []

    async def fake_sleep(s):
        delays.append(s)

    monkeypatch.setattr(supervisor_module.asyncio, "sleep", fake_sleep)
    return delays


def _supervised_on_a_clock(monkeypatch, role: str):
    """A worker slot, a settable clock, the recorded backoff delays, and a maker of the supervisor
    watching the slot (call it inside the event loop) with the clock as its time."""
    monkeypatch.setattr(supervisor_module, "_kill", lambda actor: None)
    registry = WorkerRegistry()
    worker = WorkerHandle("w0", role, "actor-0", "n", "cpu")
    registry.add(worker)
    clock, delays = [1000.0], _recorded_sleeps(monkeypatch)
    monkeypatch.setattr(supervisor_module.time, "monotonic", lambda: clock[0])

    def supervisor() -> Supervisor:
        sup = Supervisor(registry, _spawn, on_down=lambda w: None, on_ready=lambda w: None)
        sup.watch = lambda w: sup._up_since.__setitem__(w.worker_id, clock[0])   # no lifeline on a fake actor
        sup.watch(worker)
        return sup

    return worker, clock, delays, supervisor


def test_supervisor_replaces_with_backoff_and_reports(monkeypatch):
    monkeypatch.setattr(supervisor_module, "_kill", lambda actor: None)
    registry = WorkerRegistry()
    worker = WorkerHandle("d0", "decode", "actor-0", "n", "cpu")
    registry.add(worker)
    events, delays = [], _recorded_sleeps(monkeypatch)

    async def run():
        sup = Supervisor(registry, _spawn, on_down=lambda w: events.append(("down", w.generation)),
                         on_ready=lambda w: events.append(("ready", w.generation)))
        sup.watch = lambda w: None   # no real actor to hold a lifeline on
        for generation in range(3):
            sup.worker_lost(WorkerLost(worker, generation, "killed"))
            sup.worker_lost(WorkerLost(worker, generation, "reported twice"))
            await asyncio.gather(*sup._tasks)
        return sup

    asyncio.run(run())
    assert events == [("down", 0), ("ready", 1), ("down", 1), ("ready", 2), ("down", 2), ("ready", 3)]
    assert delays == [0.0, 1.0, 2.0], "first crash at once, then exponential backoff"
    assert worker.alive and worker.restarts == 3


def test_a_worker_killed_after_a_stable_run_is_replaced_at_once_a_crash_loop_backs_off(monkeypatch):
    """Kills spaced wider than STABLE_S (an OOM killer, kill -9 every 17 s) restart at once every
    time; crashes sooner than that after the replacement was ready back off, and one stable run
    clears the backoff."""
    worker, clock, delays, supervisor = _supervised_on_a_clock(monkeypatch, "prefill")

    async def run():
        sup = supervisor()
        for up_s in (17.0, 17.0, 17.0, 2.0, 2.0, 2.0, supervisor_module.STABLE_S, 1.0):
            clock[0] += up_s
            sup.worker_lost(WorkerLost(worker, worker.generation, "killed"))
            await asyncio.gather(*sup._tasks)

    asyncio.run(run())
    # 17 s runs: at once each time; then each quick crash doubles (1, 2, 4 s); a stable run: at once again.
    assert delays == [0.0, 0.0, 0.0, 1.0, 2.0, 4.0, 0.0, 1.0]
    assert worker.alive and worker.restarts == 8


def test_a_worker_that_served_is_replaced_at_once_however_soon_it_dies(monkeypatch):
    """A generation that ran engine steps (its model loads and runs) was killed, not crash-looping:
    restarted at once even 3 s after it was ready; one that reported no step yet backs off. A
    replacement starts unserved. (At a kill every 5 s, the time rule alone kept the decode slot
    empty for up to 30 s: benchmarks/results/chaos-every-5s.txt.)"""
    worker, clock, delays, supervisor = _supervised_on_a_clock(monkeypatch, "decode")
    stepped = WorkerStats("w0", "decode", 0, 1, 0, 10, 10, 16, recent_steps=(StepTiming(1, 1, 0, 8, 0.01),))
    idle = WorkerStats("w0", "decode", 0, 0, 0, 10, 10, 16)

    async def run():
        sup = supervisor()
        for stats in (stepped, stepped, stepped, idle, None, idle, stepped, None):
            clock[0] += 3.0
            worker.observe_stats(stats)
            sup.worker_lost(WorkerLost(worker, worker.generation, "killed"))
            await asyncio.gather(*sup._tasks)
            assert not worker.served   # each replacement starts unproven

    asyncio.run(run())
    # served: at once (three times); no step yet, 3 s after ready: 1, 2, 4 s; served: at once; unserved: 1 s.
    assert delays == [0.0, 0.0, 0.0, 1.0, 2.0, 4.0, 0.0, 1.0]
    assert worker.alive and worker.restarts == 8


def test_supervisor_gives_up_past_max_restarts(monkeypatch):
    monkeypatch.setattr(supervisor_module, "_kill", lambda actor: None)
    registry = WorkerRegistry()
    worker = WorkerHandle("d0", "decode", "a", "n", "cpu", restarts=2)
    registry.add(worker)

    async def run():
        sup = Supervisor(registry, None, on_down=lambda w: None, on_ready=lambda w: None, max_restarts=2)
        sup.worker_lost(WorkerLost(worker, 0, "killed"))
        await asyncio.gather(*sup._tasks)

    asyncio.run(run())
    assert worker.state is WorkerState.DEAD and not registry.can_serve


def test_a_worker_lost_while_the_cluster_stops_is_down_not_ready():
    """No replacement comes once the supervisor stops, yet the slot must not read as serving:
    requests would migrate onto the dead actor until the migration limit, whose message then
    blamed the limit. DEAD: admission says no decode worker is alive (or picks another)."""
    registry = WorkerRegistry()
    dead, other = WorkerHandle("d0", "decode", "a", "n", "cpu"), WorkerHandle("d1", "decode", "b", "n", "cpu")
    registry.add(dead)
    registry.add(other)
    downs = []

    async def run():
        sup = Supervisor(registry, None, on_down=downs.append, on_ready=lambda w: None)
        await sup.stop()
        sup.worker_lost(WorkerLost(dead, 0, "killed at stop"))
        sup.worker_lost(WorkerLost(other, 7, "a stale generation's report"))
        assert not sup._tasks, "no restart while stopping"

    asyncio.run(run())
    assert dead.state is WorkerState.DEAD and downs == [dead]
    assert other.alive and registry.alive("decode") == [other]
    with pytest.raises(WorkerFailedError, match="no decode worker is alive"):
        other.mark_dead()
        Admission(registry).decide(RequestSpec("r", (1, 2), SamplingParams(max_tokens=2)))


# ---------------------------------------------------------------- the reservation fence


def _layout() -> KVLayout:
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


@pytest.mark.parametrize("lease_left_s", [1.0, 20.0])   # 20 s: less than a whole transfer may take
def test_prefill_worker_refuses_a_write_after_the_lease(lease_left_s):
    from prefill_worker.worker import PrefillWorker

    handle = KVBlocksHandle("r", (), (0,), 3, _layout(), "local", lease_deadline_s=time.time() + lease_left_s)
    done = SimpleNamespace(req_id="r", block_ids=(0,), first_token_id=5)
    worker = PrefillWorker.__new__(PrefillWorker)   # only the lease check runs before any send
    worker._next_send_fault, worker._senders = None, {}
    with pytest.raises(KVTransferError, match="lease"):
        asyncio.run(worker._send(done, handle, decode=None))


def test_decode_reservation_aborted_under_a_possible_writer_stays_fenced_until_its_lease(monkeypatch):
    from decode_worker import worker as decode_module
    from engine.worker_base import WorkerSpec

    monkeypatch.setattr(decode_module, "RESERVATION_LEASE_S", 0.6)
    spec = WorkerSpec("fence-test", random_model={"seed": 0}, engine=EngineConfig(num_kv_blocks=32))

    async def run():
        worker = decode_module.DecodeWorker(spec)
        worker.start()
        try:
            request = RequestSpec("r", tuple(range(3, 40)), SamplingParams(max_tokens=4))
            handle = await worker.reserve(request, "shm")
            assert await worker.reserve(request, "shm") == handle, "a retried reserve returns the same blocks"
            await worker.abort("r", writer_gone=False)
            fenced = await worker.leak_report()
            with pytest.raises(KVTransferError, match="no live reservation"):
                await worker.commit("r", 5, handle)
            await asyncio.sleep(0.9)
            after = await worker.leak_report()
            await worker.reserve(RequestSpec("q", (5, 6), SamplingParams(max_tokens=2)), "shm")
            await worker.abort("q")   # the writer is known to be gone: freed at once
            return fenced, after, await worker.leak_report(), worker.engine
        finally:
            worker.shutdown()

    fenced, after, last, engine = asyncio.run(run())
    assert fenced["free_blocks"] < fenced["total_blocks"], "freed under a possibly live writer"
    assert after["free_blocks"] == after["total_blocks"] and after["requests"] == 0
    assert last["free_blocks"] == last["total_blocks"] and last["requests"] == 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("moment", ["before_reserve", "during_reserve"])
def test_a_reserve_overtaken_by_its_free_is_refused_and_holds_nothing(moment):
    """The prefill worker submits ``reserve`` and the router ``abort``: Ray orders nothing between
    two callers, so the free can come first (or while the reserve waits for the engine). The
    reserve is then refused, and no block stays held until a lease runs out."""
    from decode_worker.worker import DecodeWorker
    from engine.worker_base import WorkerSpec

    spec = WorkerSpec("ended-test", random_model={"seed": 0}, engine=EngineConfig(num_kv_blocks=32))
    request = RequestSpec("r", tuple(range(3, 40)), SamplingParams(max_tokens=4))

    async def run():
        worker = DecodeWorker(spec)
        worker.start()
        try:
            if moment == "before_reserve":
                await worker.abort("r")
                reserving = asyncio.ensure_future(worker.reserve(request, "shm"))
            else:
                reserving = asyncio.ensure_future(worker.reserve(request, "shm"))
                await asyncio.sleep(0)   # the reserve has asked the engine loop for blocks
                await worker.abort("r")
            with pytest.raises(KVTransferError, match="ended this request"):
                await reserving
            await worker.reserve(RequestSpec("q", (5, 6), SamplingParams(max_tokens=2)), "shm")
            await worker.abort("q")   # other ids reserve as before
            return await worker.leak_report(), worker.engine
        finally:
            worker.shutdown()

    report, engine = asyncio.run(run())
    assert report["free_blocks"] == report["total_blocks"] and report["requests"] == 0
    assert_no_leaks(engine)


def test_ended_requests_are_forgotten_after_their_ttl():
    from engine.ended_requests import EndedRequests

    ended = EndedRequests(ttl_s=0.2)
    ended.add("a")
    ended.add("b")
    assert "a" in ended and "b" in ended and "c" not in ended
    time.sleep(0.3)
    ended.add("c")
    assert "a" not in ended and "b" not in ended and len(ended) == 1


def test_a_retry_after_a_refused_reservation_runs_under_a_fresh_id():
    run = RequestMigration(RequestSpec("r", (1, 2)))
    run.migrate("worker died")
    ids = [run.attempt_spec().req_id]
    run.refused()
    ids.append(run.attempt_spec().req_id)
    run.refused()
    ids.append(run.attempt_spec().req_id)
    run.migrate("again")
    ids.append(run.attempt_spec().req_id)
    assert ids == ["r.m1", "r.m1.r1", "r.m1.r2", "r.m2"]


def test_a_first_attempt_refused_for_room_retries_under_a_fresh_id():
    """The refused attempt's free may still be on its way to the decode worker, which then
    refuses any later reserve under that id: the retry runs as a new id, the same request."""
    spec = RequestSpec("r", (1, 2), SamplingParams(max_tokens=4))
    run = RequestMigration(spec)
    assert run.attempt_spec() is spec
    run.refused()
    retry = run.attempt_spec()
    assert retry.req_id == "r.r1" and retry.prompt_token_ids == (1, 2) and retry.sampling == spec.sampling
    assert run.sent(TokenDelta("r.r1", (5,))).req_id == "r"


def test_a_pair_whose_transport_keeps_failing_routes_around_it():
    registry = WorkerRegistry(dist_ready=True)
    p, d = WorkerHandle("p0", "prefill", None, "n1", "cpu"), WorkerHandle("d0", "decode", None, "n2", "cpu")
    registry.add(p)
    registry.add(d)
    assert registry.transport(p, d) == "torch_dist"
    registry.handoff_done(p, d, ok=False)
    registry.handoff_done(p, d, ok=True)
    registry.handoff_done(p, d, ok=False)
    assert registry.transport(p, d) == "torch_dist", "failures must be consecutive"
    registry.handoff_done(p, d, ok=False)
    assert registry.transport(p, d) == "object_store"
    registry.lose_kv_group()
    assert registry.transport(p, d) == "object_store" and not registry.dist_ready


def test_losing_the_kv_group_is_said_once_and_pairs_fall_back(caplog):
    """A probe found a forced torch_dist given up without a word after a worker died."""
    registry = WorkerRegistry(forced_transport="torch_dist", dist_ready=True)
    p, d = WorkerHandle("p0", "prefill", None, "n1", "cpu"), WorkerHandle("d0", "decode", None, "n1", "cpu")
    registry.add(p)
    registry.add(d)
    assert registry.transport(p, d) == "torch_dist"
    with caplog.at_level("WARNING", logger="router.registry"):
        registry.lose_kv_group()
        registry.lose_kv_group()
    assert registry.transport(p, d) == "shm", "one node: shared memory once the group is gone"
    said = [r.getMessage() for r in caplog.records if r.name == "router.registry"]
    assert len(said) == 1 and "KV group lost a member" in said[0], said


def test_a_migrating_request_waits_for_room_for_its_prompt_instead_of_failing():
    from engine.types import WorkerStats
    from router.admission import Action, Admission

    registry = WorkerRegistry()
    prefill = WorkerHandle("p0", "prefill", None, "n", "cpu")
    decode = WorkerHandle("d0", "decode", None, "n", "cpu", stats=WorkerStats("d0", "decode", 0, 9, 0, 2, 64, 16))
    registry.add(prefill)
    registry.add(decode)
    admission = Admission(registry)
    resumed = RequestSpec("r.m1", tuple(range(3, 60)), SamplingParams(max_tokens=4), num_generated=20)
    assert admission.decide(resumed, best_effort=True).action is Action.QUEUE, "57 tokens need 4 blocks, 2 are free"
    decode.observe_stats(WorkerStats("d0", "decode", 0, 9, 0, 4, 64, 16))
    decision = admission.decide(resumed, best_effort=True)
    assert decision.action is Action.ADMIT and decision.prediction.prefill is prefill


def test_a_decode_actors_refusal_reaches_the_hand_off_in_its_own_words(ray_session):
    """The prefill worker's view of a decode actor (``DecodePeer``) passes an error the decode
    worker raised on purpose through as that error: Ray's wrapper around it names the process,
    address and actor and carries the traceback, and a refusal's text reaches the client
    (RESOURCE_EXHAUSTED: the prompt's blocks did not fit)."""
    import ray

    from engine.errors import CapacityError
    from prefill_worker.actor import DecodePeer

    @ray.remote
    class FullDecodeWorker:
        def reserve(self, spec, transport):
            raise CapacityError("3 KV blocks needed, 2 free")

    peer = DecodePeer(FullDecodeWorker.remote())
    with pytest.raises(CapacityError) as info:
        asyncio.run(peer.reserve(RequestSpec("r", (1, 2)), "shm"))
    assert str(info.value) == "3 KV blocks needed, 2 free"


@pytest.mark.parametrize("ttft_s, migrating, said", [
    (None, False, "it waited 30 s, the limit for a request without a TTFT target"),
    (0.5, False, "it waited past its TTFT deadline"),
    (0.5, True, "its migration waited 60 s"),
])
def test_reservations_refused_to_the_deadline_are_said_in_admissions_words(ttft_s, migrating, said):
    """Found by a probe: the client got the last decode worker's words alone ("21 KV blocks
    needed, 6 free"), counted under no cause of admission's."""
    from engine.types import SLOTarget
    from router.orchestrator import ReservationRefused, _waited_for_room

    spec = RequestSpec("r", (1, 2), slo=SLOTarget(ttft_s=ttft_s))
    error = _waited_for_room(spec, migrating, ReservationRefused("21 KV blocks needed, 6 free"))
    assert str(error) == f"no decode worker had room for the prompt's KV blocks: {said} (the last refusal: 21 KV blocks needed, 6 free)"
    assert error.reason == "queue_deadline"


def test_workers_run_requests_in_the_order_admission_let_them_in():
    """Found by a probe: best-effort long prompts that arrived first but were let in as room freed
    went before short ones admitted earlier with a TTFT target (workers order by arrival), which
    then missed it 3-5x. An attempt reaches the workers stamped with its admission; a migrating
    one keeps its arrival (it goes first: its client is mid-stream)."""
    from engine.types import FinishReason
    from router.orchestrator import Orchestrator, RequestTrace

    decode = WorkerHandle("d0", "decode", None, "n", "cpu")
    seen: list[RequestSpec] = []

    async def admit(spec, num_migrations, line_since=None):
        await asyncio.sleep(0.01)
        return SimpleNamespace(prefill=None, decode=decode)

    async def attempt(spec, pair, trace, learn=True):
        seen.append(spec)
        if len(seen) == 1:
            yield TokenDelta(spec.req_id, (7,))
            raise WorkerLost(decode, 0, "died")
        yield TokenDelta(spec.req_id, (8,), FinishReason.LENGTH)

    orchestrator = Orchestrator(WorkerRegistry(), None, None)
    orchestrator._admit, orchestrator._attempt = admit, attempt
    spec = RequestSpec("r", (1, 2), SamplingParams(max_tokens=2), arrival_s=time.monotonic() - 5.0)

    async def run():
        return [delta.token_ids async for delta in orchestrator.generate(spec, RequestTrace())]

    assert asyncio.run(run()) == [(7,), (8,)]
    assert seen[0].arrival_s > spec.arrival_s + 4.9, "the first attempt is stamped with its admission"
    assert seen[1].arrival_s == spec.arrival_s and seen[1].num_generated == 1, "a migrating one keeps its arrival"


# ---------------------------------------------------------------- one failure event, one migration


class InProcessActor:
    """A worker object behind a Ray-like handle, in this process: ``actor.<method>.remote(*args)``
    is awaitable, a streaming method's an async iterator of awaitables. ``kill`` makes every call
    fail as a dead actor's does (``ActorDiedError``), and the streams open on it too, unless
    ``noticed=False``: the router has not noticed the death yet (Ray's notice is still on its way),
    only a call finds it. ``worker=None``: an actor that is dead from the start."""

    def __init__(self, worker=None) -> None:
        self.worker = worker
        self.dead = worker is None
        self.stream_broken = asyncio.Event()

    def kill(self, noticed: bool = True) -> None:
        self.dead = True
        if noticed:
            self.stream_broken.set()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return SimpleNamespace(remote=lambda *args: self._remote(name, args))

    def _remote(self, name: str, args):
        if self.worker is None:   # dead from the start: calls fail, its stream waits for the notice
            return self._items(_idle(), opened_before=True) if name == "stream" else self._call(None, args)
        fn = getattr(self.worker, name)
        return self._items(fn(*args)) if inspect.isasyncgenfunction(fn) else self._call(fn, args)

    async def _call(self, fn, args):
        if self.dead:
            raise ActorDiedError()
        return await fn(*args)

    async def _items(self, items, opened_before: bool = False):
        if self.dead and not opened_before:
            raise ActorDiedError()
        broken = asyncio.ensure_future(self.stream_broken.wait())
        try:
            while True:
                item = asyncio.ensure_future(anext(items))
                done, _ = await asyncio.wait({item, broken}, return_when=asyncio.FIRST_COMPLETED)
                if broken in done:
                    item.cancel()
                    raise ActorDiedError()
                yield asyncio.sleep(0, item.result())   # awaitable, as Ray's refs are
        finally:
            broken.cancel()


async def _idle():
    await asyncio.Event().wait()
    yield  # pragma: no cover - never reached: it makes this a stream


class PrefillingForever:
    """A prefill worker busy with the request's long prompt: its call yields nothing (until it dies)."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()

    async def prefill(self, spec, transport, decode, inbox=None):
        self.reached.set()
        await asyncio.Event().wait()
        yield  # pragma: no cover - never reached: it makes this a streaming method

    async def stats(self):
        return None


def _decode_workers(n: int):
    from decode_worker.worker import DecodeWorker
    from engine.worker_spec import WorkerSpec

    workers = [DecodeWorker(WorkerSpec(f"decode-{i}", random_model={"seed": 0},
                                       engine=EngineConfig(num_kv_blocks=64, block_size=16))) for i in range(n)]
    for w in workers:
        w.start()
    return workers


def _orchestrated(registry: WorkerRegistry, limit: int):
    """The real orchestrator, decode streams and admission over ``registry``; pairs chosen in
    slot order among the workers alive (no prefill worker alive: the decode worker prefills, as
    admission does); a lost worker is marked down at once, as the supervisor does."""
    from router.orchestrator import Orchestrator
    from router.pair_search import Prediction
    from router.streams import DecodeStreams

    def lose(lost):
        lost.worker.mark_down(lost.generation)

    streams = DecodeStreams(registry, on_lost=lose)
    orchestrator = Orchestrator(registry, streams, Admission(registry), on_lost=lose, migration_limit=limit)
    placed: list[str] = []

    async def admit(spec, num_moves, line_since=None):
        prefill = next((w for w in registry.prefill if w.alive), None)
        decode = next(w for w in registry.decode if w.alive)
        placed.append(f"{prefill.worker_id}+{decode.worker_id}" if prefill else decode.worker_id)
        return Prediction(prefill, decode, None, None, num_prompt_tokens=len(spec.prompt_token_ids))

    orchestrator._admit = admit
    streams.start()
    return orchestrator, streams, placed


async def _collect(orchestrator, spec, on_tokens=lambda tokens: None):
    from router.orchestrator import RequestTrace

    trace, tokens = RequestTrace(), []
    async for delta in orchestrator.generate(spec, trace):
        tokens.extend(delta.token_ids)
        on_tokens(tokens)
    return tokens, trace


async def _settled(orchestrator, streams, workers) -> None:
    await orchestrator.drain_cleanups()
    await streams.stop()
    for w in workers:
        await w.leak_report()   # the engine loop has run past the request's last step
        w.shutdown()


def _decode_registry(n: int, *first: WorkerHandle):
    """``n`` in-process decode workers behind killable handles, registered after ``first``."""
    workers = _decode_workers(n)
    actors = [InProcessActor(w) for w in workers]
    registry = WorkerRegistry()
    for handle in first:
        registry.add(handle)
    for i, actor in enumerate(actors):
        registry.add(WorkerHandle(f"decode-{i}", "decode", actor, "n", "cpu"))
    return workers, actors, registry


GREEDY_30 = SamplingParams(max_tokens=30, ignore_eos=True)
PROMPT = (17, 4, 99, 250, 3, 8)


def test_a_decode_worker_dead_before_the_migrated_attempt_reaches_it_costs_no_second_migration(engine):
    """Found by a kill probe: decode-0 dies mid-stream and decode-1 at the same moment; the
    request moves off decode-0 (its one migration, limit 1) and is placed on decode-1 before the
    router knows it is dead. That second loss is of the same failure event: not counted. The
    request completes on decode-2 equal to an uninterrupted run; no request left, every block free."""
    whole = engine.generate([RequestSpec("whole", PROMPT, GREEDY_30)])["whole"]

    async def run():
        workers, actors, registry = _decode_registry(3)
        orchestrator, streams, placed = _orchestrated(registry, limit=1)

        def kill_two_at_five(tokens):
            if len(tokens) >= 5 and not actors[0].dead:
                actors[0].kill()
                actors[1].kill(noticed=False)

        try:
            tokens, trace = await _collect(orchestrator, RequestSpec("r", PROMPT, GREEDY_30), kill_two_at_five)
        finally:
            await _settled(orchestrator, streams, workers)
        return tokens, trace, placed, workers[2].engine

    tokens, trace, placed, survivor = asyncio.run(run())
    assert placed == ["decode-0", "decode-1", "decode-2"]
    assert tokens == whole
    assert trace.migrations == 2, "two moves, one of them counted"
    assert_no_leaks(survivor)


def test_a_prefill_and_a_decode_worker_killed_together_cost_one_migration(engine):
    """The request prefills on prefill-0 (which answers others meanwhile: alive after the attempt
    reached it, so its loss counts) for decode-0; both die at once. With limit 1 the request
    moves off prefill-0, is placed on decode-0 (no prefill worker left: it would prefill there)
    before its death is known, and that loss is not counted: it completes on decode-1, equal to
    an uninterrupted run. Before: UNAVAILABLE, "migration limit (1) is reached"."""
    whole = engine.generate([RequestSpec("whole", PROMPT, GREEDY_30)])["whole"]

    async def run():
        prefilling = PrefillingForever()
        prefill_actor = InProcessActor(prefilling)
        prefill = WorkerHandle("prefill-0", "prefill", prefill_actor, "n", "cpu")
        workers, decode_actors, registry = _decode_registry(2, prefill)
        orchestrator, streams, placed = _orchestrated(registry, limit=1)

        async def kill_both_mid_prefill():
            await prefilling.reached.wait()
            await call(prefill, "stats")   # it serves others meanwhile
            prefill_actor.kill()
            decode_actors[0].kill(noticed=False)

        killer = asyncio.ensure_future(kill_both_mid_prefill())
        try:
            tokens, trace = await _collect(orchestrator, RequestSpec("r", PROMPT, GREEDY_30))
        finally:
            killer.cancel()
            await _settled(orchestrator, streams, workers)
        return tokens, trace, placed, workers[1].engine

    tokens, trace, placed, survivor = asyncio.run(run())
    assert placed == ["prefill-0+decode-0", "decode-0", "decode-1"]
    assert tokens == whole
    assert trace.migrations == 2
    assert_no_leaks(survivor)


def test_the_migration_limit_still_ends_a_request_whose_workers_keep_dying_mid_stream(engine):
    """Each worker dies under the live stream (alive when the attempt began: every loss counts):
    with limit 1 the second loss ends the request, UNAVAILABLE naming the limit, after the
    tokens both attempts streamed (none repeated or missing)."""
    whole = engine.generate([RequestSpec("whole", PROMPT, GREEDY_30)])["whole"]
    received: list[int] = []

    async def run():
        workers, actors, registry = _decode_registry(3)
        orchestrator, streams, placed = _orchestrated(registry, limit=1)

        def kill_every_four(tokens):
            received[:] = tokens
            for k in (0, 1):
                if len(tokens) >= 4 * (k + 1) and not actors[k].dead:
                    actors[k].kill()

        try:
            with pytest.raises(WorkerFailedError, match=r"migration limit \(1\) is reached"):
                await _collect(orchestrator, RequestSpec("r", PROMPT, GREEDY_30), kill_every_four)
        finally:
            await _settled(orchestrator, streams, workers)
        return placed, workers[2].engine

    placed, untouched = asyncio.run(run())
    assert placed == ["decode-0", "decode-1"]
    assert received == whole[:len(received)] and len(received) >= 8
    assert_no_leaks(untouched)


def test_losses_found_at_the_first_call_are_excused_once_per_worker_slot():
    """A request whose every attempt finds its worker dead (a worker that dies at its first call,
    replaced each time) does not loop: the first loss counts, each slot's next one is excused
    once, then they count, and the limit ends it: limit + 1 + one attempt per slot."""
    registry = WorkerRegistry()
    slot = WorkerHandle("decode-0", "decode", InProcessActor(), "n", "cpu")
    registry.add(slot)

    async def run():
        orchestrator, streams, placed = _orchestrated(registry, limit=2)

        def lose_and_replace(lost):   # the supervisor: a fresh actor, dead at its first call again
            if lost.worker.mark_down(lost.generation):
                lost.worker.replace(InProcessActor(), {"node_id": "n", "device": "cpu"})

        orchestrator.on_lost = lose_and_replace
        try:
            with pytest.raises(WorkerFailedError, match=r"migration limit \(2\) is reached"):
                await _collect(orchestrator, RequestSpec("r", PROMPT, GREEDY_30))
        finally:
            await orchestrator.drain_cleanups()
            await streams.stop()
        return placed

    assert asyncio.run(run()) == ["decode-0"] * 4
    assert slot.generation == 4


def test_an_excused_loss_moves_the_request_under_a_fresh_id_without_counting():
    run = RequestMigration(RequestSpec("r", (1, 2)), limit=1)
    assert run.migrate("d0 died mid-stream") is True
    assert run.migrate("d1 found dead", found_lost="decode-1") is False
    assert run.migrate("p0 found dead", found_lost="prefill-0") is False
    assert (run.num_migrations, run.num_moves, run.attempt_spec().req_id) == (1, 3, "r.m3")
    with pytest.raises(WorkerFailedError, match="migration limit"):
        run.migrate("d1 found dead again", found_lost="decode-1")   # once per slot


def test_the_first_attempts_loss_always_counts_so_limit_0_fails_at_once():
    """Excusal is for a loss that follows a move (the same failure event found again): a
    request's first attempt finding its worker dead counts, and ``--migration-limit 0`` still
    means no migration at all (found by review)."""
    with pytest.raises(WorkerFailedError, match=r"migration limit \(0\) is reached"):
        RequestMigration(RequestSpec("r", (1, 2)), limit=0).migrate("p0 found dead", found_lost="prefill-0")
    run = RequestMigration(RequestSpec("r", (1, 2)), limit=1)
    assert run.migrate("p0 found dead", found_lost="prefill-0") is True
    assert run.migrate("d0 found dead", found_lost="decode-0") is False


def test_an_answer_after_the_attempt_began_shows_the_worker_was_alive():
    worker = _worker(FlakyActor([]))
    began = time.monotonic()
    assert not worker.heard_since(0, began)
    assert asyncio.run(call(worker, "ping")) == "pong"
    assert worker.heard_since(0, began) and not worker.heard_since(0, time.monotonic())
    worker.mark_down(0)
    worker.replace(FlakyActor([]), {"node_id": "n", "device": "cpu"})
    worker.heard(0)   # a late answer of the old actor says nothing of the new one
    assert not worker.heard_since(1, began) and worker.heard_since(0, began)
