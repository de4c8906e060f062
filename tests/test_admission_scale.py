"""Admission at scale: the pair search chooses exactly what scanning every (prefill, decode)
pair chooses, and its work is counted, not timed: per decision each worker is read once (not
once per pair) and no running request is read for a disaggregated pair; per worker report the
work does not grow with the number of requests queued in admission. No Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from engine.types import RequestSpec, SamplingParams, SLOTarget, StepTiming, WorkerStats
from router.admission import Action, Admission
from router.pair_search import Prediction, has_kv_room
from router.prefix_index import PrefixIndex
from router.registry import DecodeProgress, WorkerHandle, WorkerRegistry
from router.step_model import REFIT_AFTER, StepTimeModel
from tests.test_admission import decode_steps, prefill_steps

NOW = 1000.0


def make_cluster(rng: random.Random, num_prefill: int, num_decode: int, running: int, conditional: bool,
                 identical: bool = False) -> Admission:
    """Workers with random (or, ``identical``, equal: every choice is a tie) queues, loads,
    free blocks, requests decoding with TPOT targets, and cached prefixes."""
    pick = (lambda *choices: choices[0]) if identical else (lambda *choices: rng.choice(choices))
    registry = WorkerRegistry()
    for i in range(num_prefill):
        w = WorkerHandle(f"p{i}", "prefill", None, "n", "cpu",
                         WorkerStats(f"p{i}", "prefill", 0, 0, 0, 1000, 1000, 16, 0, prefill_steps()),
                         prefix=PrefixIndex(16, enabled=True))
        w.num_prefill_tokens = pick(0, 500, 3000, 9000)
        registry.add(w)
    for i in range(num_decode):
        free = pick(1000, 40, 3)
        w = WorkerHandle(f"d{i}", "decode", None, "n", "cpu",
                         WorkerStats(f"d{i}", "decode", 0, running, 0, free, 1000, 16, 0, decode_steps() + prefill_steps()),
                         prefix=PrefixIndex(16, enabled=True))
        for j in range(running):
            progress = DecodeProgress(64, pick(0.03, 0.05, 0.2), prefill_mark=0)
            progress.on_tokens(pick(1, 10, 40), now=NOW - pick(0.1, 1.0, 2.5))
            w.track(f"r{i}-{j}", progress)
        w.begin_prefill(pick(0, 0, 400, 4000), now=NOW - 10)
        registry.add(w)
    admission = Admission(registry, conditional=conditional)
    for w in registry.all:
        admission.observe_stats(w)
    return admission


def request(rng: random.Random, admission: Admission, identical: bool = False) -> RequestSpec:
    prompt = tuple(rng.randrange(3, 500) for _ in range(rng.choice((8, 40, 200, 1500))))
    if not identical:   # some workers hold some of it (prefix routing, cheap local prefills)
        for w in rng.sample(admission.registry.all, k=2):
            w.placed_prompt(prompt[: rng.choice((16, len(prompt) - 3))])
    slo = rng.choice((SLOTarget(0.5, 0.05), SLOTarget(2.0, 0.1), SLOTarget(0.2, None), SLOTarget(None, 0.03)))
    return RequestSpec("x", prompt, SamplingParams(max_tokens=rng.choice((16, 64, 300))), slo, rng.choice((0, 0, 2)))


def every_pair(admission: Admission, spec: RequestSpec, waited_s: float) -> list[Prediction]:
    registry = admission.registry
    decodes, prefills = registry.alive("decode"), registry.alive("prefill")
    predict = lambda p, d: admission.predict(spec, p, d, NOW, waited_s)  # noqa: E731
    preds = [predict(p, d) for p in prefills for d in decodes]
    if admission.conditional or not prefills:
        preds += [predict(None, d) for d in decodes]
    return preds


def scan_choice(admission: Admission, spec: RequestSpec, waited_s: float) -> Prediction:
    """The rule as written before the search: every pair formed, then min / max over them all."""
    ttft_t, tpot_t = admission._targets(spec)
    preds = every_pair(admission, spec, waited_s)
    disagg = [p for p in preds if p.prefill is not None] or preds
    if (ttft_t is None and tpot_t is None) or any(p.ttft_s is None for p in preds):
        return min(disagg, key=load)
    fits_ttft = [p for p in preds if p.fits_ttft(ttft_t, admission.ttft_margin.share)]
    fits = [p for p in fits_ttft if p.fits_tpot(tpot_t) and has_kv_room(p.decode, spec)]
    if fits:
        pool = [p for p in fits if p.prefill is not None or p.cheap_local] or fits
        return min(pool, key=lambda p: (p.ttft_s, -p.headroom(ttft_t, tpot_t)))
    return max(fits_ttft or preds, key=lambda p: p.headroom(ttft_t, tpot_t))


def load(p: Prediction) -> tuple[int, int, int, int]:
    free = p.decode.stats.num_free_blocks if p.decode.stats else 0
    queued = p.prefill.num_prefill_tokens if p.prefill else 0
    return (queued - p.cached_tokens, p.decode.num_inflight, -p.decode_cached_tokens, -free)


@pytest.mark.parametrize("identical", [False, True], ids=["random workers", "identical workers (ties)"])
@pytest.mark.parametrize("conditional", [True, False])
def test_the_search_chooses_what_scanning_every_pair_chooses(conditional, identical):
    rng = random.Random(7 + conditional + 2 * identical)
    for trial in range(150):
        admission = make_cluster(rng, rng.choice((1, 3, 4)), rng.choice((1, 4, 5)), rng.choice((0, 3)), conditional,
                                 identical)
        spec = request(rng, admission, identical)
        waited = rng.choice((0.0, 0.0, 0.15))
        chosen = admission.decide(spec, now=NOW, waited_s=waited).prediction
        assert chosen == scan_choice(admission, spec, waited), f"trial {trial}"


def test_a_migration_takes_the_least_loaded_pair_with_room_as_scanning_does():
    rng = random.Random(3)
    for _ in range(100):
        admission = make_cluster(rng, 3, 5, 2, conditional=True)
        spec = request(rng, admission)
        decision = admission.decide(spec, now=NOW, best_effort=True)
        disagg = [p for p in every_pair(admission, spec, 0.0) if p.prefill is not None]
        roomy = [p for p in disagg if -(-len(spec.prompt_token_ids) // 16) <= p.decode.stats.num_free_blocks]
        assert decision.prediction == min(roomy or disagg, key=load)
        assert decision.action is (Action.ADMIT if roomy else Action.QUEUE)


class Counts:
    """Calls of the per-worker and per-running-request pieces of a decision."""

    def __init__(self, monkeypatch) -> None:
        self.decode_steps = self.projections = self.fits = 0
        self._wrap(monkeypatch, Admission, "decode_step", "decode_steps")
        self._wrap(monkeypatch, DecodeProgress, "projected_tpot", "projections")
        self._wrap(monkeypatch, StepTimeModel, "_fit_decode_steps", "fits")

    def _wrap(self, monkeypatch, cls, name: str, counter: str) -> None:
        original = getattr(cls, name)

        def counted(*args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)


@pytest.mark.parametrize("running", [10, 200])
def test_a_decision_reads_each_decode_worker_once_and_no_running_request_of_a_disaggregated_pair(monkeypatch, running):
    """16 x 48 workers: 48 decode-step predictions (was one per pair: 768 + 48), and the
    requests decoding there (10 or 200 per worker) are not read at all when a disaggregated
    pair fits (was: every one of them, once per pair)."""
    admission = make_cluster(random.Random(1), 16, 48, running, conditional=True, identical=True)
    spec = RequestSpec("x", tuple(range(3, 203)), SamplingParams(max_tokens=64), SLOTarget(2.0, 0.5))
    counts = Counts(monkeypatch)
    decision = admission.decide(spec, now=NOW)
    assert decision.action is Action.ADMIT and decision.prediction.prefill is not None
    assert counts.decode_steps == 48 and counts.projections == 0


def test_when_decode_workers_must_prefill_only_the_chosen_ones_running_requests_are_read(monkeypatch):
    """Every prefill worker misses the TTFT: the decode workers prefilling are the candidates,
    and the running-TPOT check (2 projections per request there) is made for the best-bound
    candidate, not for all 48."""
    admission = make_cluster(random.Random(1), 16, 48, 100, conditional=True, identical=True)
    for w in admission.registry.prefill:
        w.num_prefill_tokens = 50_000
    spec = RequestSpec("x", tuple(range(3, 35)), SamplingParams(max_tokens=64), SLOTarget(2.0, 0.5))
    counts = Counts(monkeypatch)
    decision = admission.decide(spec, now=NOW)
    assert decision.prediction.prefill is None
    assert counts.projections <= 2 * 100


def test_a_decision_after_reports_fits_nothing(monkeypatch):
    """Every worker just reported new steps (enough for a refit, prefill steps too): the step
    models are brought up to date on the reports, and the decision after them only reads them
    (the refits inside decisions were their tail)."""
    admission = make_cluster(random.Random(3), 16, 48, 50, conditional=True, identical=True)
    for w in admission.registry.all:
        fresh = tuple(StepTiming(7, 7 + 64 * (w.role == "prefill"), 64 * (w.role == "prefill"), 900 + k,
                                 0.03 + k * 1e-4) for k in range(REFIT_AFTER))
        w.observe_stats(dataclasses.replace(w.stats, recent_steps=(w.stats.recent_steps + fresh)[-64:]))
        admission.observe_stats(w)
    spec = RequestSpec("x", tuple(range(3, 35)), SamplingParams(max_tokens=64), SLOTarget(2.0, 0.5))

    def no_work(*args, **kwargs):
        raise AssertionError("a step model computed inside a decision")

    for name in ("_fit_decode_steps", "_seconds_per_prefill_token", "_prefill_stall_per_token"):
        monkeypatch.setattr(StepTimeModel, name, no_work)
    decision = admission.decide(spec, now=NOW)
    assert decision.prediction is not None


def test_per_report_work_does_not_grow_with_the_queue(monkeypatch):
    """A worker's report wakes at most MAX_WAKE_PER_NOTIFY queued requests (each decides
    once) and refits its step model at most every REFIT_AFTER new steps: the same decisions
    and fits per report with 10 or 1,000 requests queued."""
    per_report = {n: asyncio.run(_queued_reports(monkeypatch, n)) for n in (10, 1000)}
    assert per_report[10] == per_report[1000]
    decisions, fits = per_report[1000]
    assert decisions <= 8 * 20 and fits <= 20 // 8 + 1


async def _queued_reports(monkeypatch, num_queued: int) -> tuple[int, int]:
    from router.admission import MAX_WAKE_PER_NOTIFY

    admission, spec, waiters = await _full_with_queue(num_queued, conditional=False)
    counts = Counts(monkeypatch)
    decided = _count_decisions(admission)
    worker = admission.registry.decode[0]
    for step in range(20):   # 20 reports, each with one new step, as a worker's stream sends them
        steps = worker.stats.recent_steps + (StepTiming(5, 5, 0, 800 + step, 0.02 + step * 1e-5),)
        worker.observe_stats(dataclasses.replace(worker.stats, recent_steps=steps[-64:]))
        admission.observe_stats(worker)
        admission.notify()
        for _ in range(4):
            await asyncio.sleep(0)
        admission.decide(spec, now=NOW)   # the step model is asked once per report at least
        decided[0] -= 1
    decisions = decided[0]
    assert decisions <= 20 * MAX_WAKE_PER_NOTIFY
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    return decisions, counts.fits


def test_a_report_from_a_worker_still_full_wakes_without_a_decision(monkeypatch):
    """While requests queue for KV room, a decode worker's report that leaves it full wakes
    the next few, who check that one worker and stay queued: no decision over every worker."""
    decisions = asyncio.run(_reports_from(monkeypatch, free_blocks=0))
    assert decisions == {"made": 0, "admitted": 0, "queued": 12}


def test_a_report_from_a_worker_still_full_switches_to_no_waiting_task(monkeypatch):
    """The woken requests' check of that worker runs in the report's own ``notify``: the next
    MAX_WAKE_PER_NOTIFY queued requests are checked there, none of their tasks is woken, and
    the next report checks the next ones (the rotation goes on)."""
    from router.admission import MAX_WAKE_PER_NOTIFY

    async def scenario():
        admission, _, waiters = await _full_with_queue(20, conditional=True)
        checked = []
        could_take = admission._could_take
        monkeypatch.setattr(admission, "_could_take", lambda w, spec: checked.append(spec.req_id) or could_take(w, spec))
        events = admission._waiters._waiters
        for report in range(2):
            admission.notify(admission.registry.decode[1])
            assert not any(e.is_set() for e in events.values()), f"report {report} woke a task"
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        return checked

    checked = asyncio.run(scenario())
    assert checked == [f"q{k}" for k in range(2 * MAX_WAKE_PER_NOTIFY)]


def test_a_report_that_frees_room_admits_there(monkeypatch):
    """The same report with room freed on that worker: the woken requests decide again and
    the first ones are admitted, on that worker."""
    decisions = asyncio.run(_reports_from(monkeypatch, free_blocks=1000))
    assert decisions["made"] >= 1 and decisions["admitted"] >= 1
    assert decisions["queued"] == 12 - decisions["admitted"]


async def _reports_from(monkeypatch, free_blocks: int) -> dict:
    from router.admission import MAX_WAKE_PER_NOTIFY

    admission, _, waiters = await _full_with_queue(12, conditional=True)
    decided = _count_decisions(admission)
    worker = admission.registry.decode[1]
    worker.observe_stats(dataclasses.replace(worker.stats, num_free_blocks=free_blocks))
    admission.notify(worker)   # the launcher's report handler: the reporting worker named
    for _ in range(10):
        await asyncio.sleep(0)
    admitted = [t.result() for t in waiters if t.done()]
    assert all(p.decode is worker for p in admitted)
    assert decided[0] <= MAX_WAKE_PER_NOTIFY
    queued = admission.num_queued
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    return {"made": decided[0], "admitted": len(admitted), "queued": queued}


async def _full_with_queue(num_queued: int, conditional: bool):
    """2 prefill + 3 decode workers with no KV room left, and ``num_queued`` requests queued for
    it: (admission, the requests' spec, their tasks)."""
    admission = make_cluster(random.Random(2), 2, 3, 5, conditional=conditional, identical=True)
    for w in admission.registry.decode:   # full: every request queues for KV room
        w.observe_stats(dataclasses.replace(w.stats, num_free_blocks=0))
    spec = RequestSpec("q", tuple(range(3, 40)), SamplingParams(max_tokens=16), SLOTarget(1e6, 1.0))
    waiters = [asyncio.create_task(admission.acquire(dataclasses.replace(spec, req_id=f"q{k}")))
               for k in range(num_queued)]
    while admission.num_queued < num_queued:
        await asyncio.sleep(0)
    return admission, spec, waiters


def _count_decisions(admission: Admission) -> list[int]:
    """Counts ``admission.decide`` calls from now on, in the returned one-item list."""
    decided = [0]
    decide = admission.decide

    def counted(*args, **kwargs):
        decided[0] += 1
        return decide(*args, **kwargs)

    admission.decide = counted
    return decided


def test_a_report_from_an_idle_worker_admits_even_on_stale_stats():
    """A worker whose last request just ended can look full in its last stats (its blocks are
    freed after them) and, idle, sends no more: woken by it, a queued request decides again (an
    idle pair is admitted whatever it predicts) instead of waiting out its deadline."""
    async def scenario():
        admission = make_cluster(random.Random(2), 1, 1, 0, conditional=False, identical=True)
        worker = admission.registry.decode[0]
        worker.observe_stats(dataclasses.replace(worker.stats, num_free_blocks=0, num_running=1))
        spec = RequestSpec("q", tuple(range(3, 40)), SamplingParams(max_tokens=16), SLOTarget(1e6, 1.0))
        waiter = asyncio.create_task(admission.acquire(spec))
        while admission.num_queued < 1:
            await asyncio.sleep(0)
        worker.observe_stats(dataclasses.replace(worker.stats, num_running=0))   # idle, blocks not yet freed
        admission.notify(worker)
        prediction = await asyncio.wait_for(waiter, 5.0)
        assert prediction.decode is worker and admission.num_queued == 0

    asyncio.run(scenario())
