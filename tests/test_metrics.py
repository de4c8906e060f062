"""RouterMetrics: what the router feeds in comes out of a real scrape, in valid exposition format.

Synthetic finished requests, rejections and worker stats go into a ``RouterMetrics``; its HTTP
endpoint is scraped with urllib and parsed with prometheus-client's parser. ``promtool check
metrics`` lints the exposition when promtool is installed (Debian's ``prometheus`` package);
under ``CI=true`` a missing promtool fails the test rather than silently skipping it.
"""

from __future__ import annotations

import math
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.types import FinishReason, StepTiming, WorkerStats
from router.convert import RequestTimings
from router.metrics import RouterMetrics, SloWindow, outcome_name, slo_met
from tests.conftest import require_promtool

REPO = Path(__file__).resolve().parents[1]


def timings(ttft_s: float = 0.2, tpot_s: float = 0.05, kv_bytes: int = 1 << 20) -> RequestTimings:
    return RequestTimings(queue_s=0.01, prefill_s=0.1, kv_transfer_s=0.02, decode_s=0.5, ttft_s=ttft_s,
                          tpot_s=tpot_s, e2e_s=ttft_s + 4 * tpot_s, kv_transfer_bytes=kv_bytes,
                          prefill_worker_id="p0", decode_worker_id="d0")


def worker_stats(worker_id: str = "d0", role: str = "decode", preemptions: int = 0,
                 steps: tuple[float, ...] = (0.02, 0.04)) -> WorkerStats:
    return WorkerStats(worker_id=worker_id, role=role, num_waiting=3, num_running=5, num_waiting_tokens=120,
                       num_free_blocks=75, num_total_blocks=100, block_size=16, num_preemptions=preemptions,
                       recent_steps=tuple(StepTiming(4, 4, 0, 64, d) for d in steps))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scrape(port: int) -> dict[str, float]:
    """Every sample of a real HTTP scrape, keyed ``name{label="v",...}`` (labels sorted)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def feed(m: RouterMetrics, num_ok: int) -> None:
    """``num_ok`` successful requests (one misses its TTFT target), one abort before the first
    token, two rejections, one invalid request, two workers."""
    for i in range(num_ok):
        reason = FinishReason.STOP if i % 2 else FinishReason.LENGTH
        m.request_finished(reason, timings(ttft_s=0.9 if i == 0 else 0.2), 10, 5, [0.05] * 4,
                           ttft_target_s=0.5, tpot_target_s=0.1)
    m.request_finished(FinishReason.ABORT, RequestTimings(queue_s=0.3, e2e_s=0.3), 10, 0, [], 0.5, 0.1)
    m.request_rejected("ttft_slo")
    m.request_rejected("kv_full")
    m.request_invalid()
    m.admission("admit", "slo_ok")
    m.prediction("ttft", 0.25, 0.2)
    m.prediction("tpot", 0.04, 0.05)
    m.prediction("tpot", float("inf"), 0.05)   # a saturated prediction has no ratio
    m.update_worker(worker_stats("p0", "prefill", preemptions=0))
    m.update_worker(worker_stats("d0", "decode", preemptions=2))


@pytest.fixture
def metrics():
    m = RouterMetrics(kv_transport="shm")
    yield m
    m.close()


def test_scrape_counts_what_was_fed(metrics):
    feed(metrics, num_ok=7)
    port = metrics.start_http_server(0)
    assert port > 0
    s = scrape(port)
    # The abort never produced a token: it counts in e2e but has no TTFT.
    assert s['pdserve_time_to_first_token_seconds_count{mode="disaggregated"}'] == 7
    assert s['pdserve_e2e_request_latency_seconds_count{mode="disaggregated"}'] == 8
    assert s['pdserve_inter_token_latency_seconds_count{mode="disaggregated"}'] == 28
    assert s['pdserve_kv_transfer_bytes_sum{transport="shm"}'] == 7 * (1 << 20)
    assert s['pdserve_requests_total{outcome="finished_stop"}'] == 3
    assert s['pdserve_requests_total{outcome="finished_length"}'] == 4
    assert s['pdserve_requests_total{outcome="aborted"}'] == 1
    assert s['pdserve_requests_total{outcome="rejected"}'] == 2
    assert s['pdserve_requests_total{outcome="invalid"}'] == 1
    assert s['pdserve_requests_total{outcome="error"}'] == 0
    assert s['pdserve_admission_decisions_total{decision="reject",reason="kv_full"}'] == 1
    assert s['pdserve_admission_decisions_total{decision="admit",reason="slo_ok"}'] == 1
    assert s["pdserve_prompt_tokens_total"] == 80 and s["pdserve_generation_tokens_total"] == 35
    assert s["pdserve_slo_met_requests_total"] == 6
    assert s['pdserve_admission_prediction_ratio_sum{target="ttft"}'] == pytest.approx(0.8)
    assert s['pdserve_admission_prediction_ratio_count{target="tpot"}'] == 1
    assert s['pdserve_admission_prediction_ratio_bucket{le="1.25",target="tpot"}'] == 1
    assert s['pdserve_admission_prediction_ratio_bucket{le="1.1",target="tpot"}'] == 0
    assert s["pdserve_slo_attainment_ratio"] == pytest.approx(6 / 8)
    assert s["pdserve_goodput_requests_per_second"] == pytest.approx(6 / 60)


def test_worker_gauges_and_preemption_deltas(metrics):
    metrics.update_worker(worker_stats("d0", preemptions=2))
    metrics.update_worker(worker_stats("d0", preemptions=5, steps=()))   # idle: step time kept
    metrics.update_worker(worker_stats("d0", preemptions=1))             # restarted: counts from 0
    port = metrics.start_http_server(0)
    s = scrape(port)
    d0 = '{role="decode",worker="d0"}'
    assert s[f"pdserve_worker_running_requests{d0}"] == 5
    assert s[f"pdserve_worker_waiting_requests{d0}"] == 3
    assert s[f"pdserve_worker_waiting_tokens{d0}"] == 120
    assert s[f"pdserve_worker_kv_usage_ratio{d0}"] == pytest.approx(0.25)
    assert s[f"pdserve_worker_free_blocks{d0}"] == 75
    assert s[f"pdserve_worker_step_time_seconds{d0}"] == pytest.approx(0.03)
    assert s['pdserve_preemptions_total{worker="d0"}'] == 6
    metrics.remove_worker("d0")
    assert f"pdserve_worker_running_requests{d0}" not in scrape(port)


def test_worker_gauges_scraped_while_workers_report(metrics):
    """The gauges are built at scrape time from stats the event loop keeps replacing (and
    workers joining and leaving): every scrape parses and shows each worker's whole last report."""
    import threading

    stop = threading.Event()

    def report() -> None:   # stands in for the event loop: a report per step, workers coming and going
        k = 0
        while not stop.is_set():
            metrics.update_worker(worker_stats(f"d{k % 7}"))
            if k % 50 == 49:
                metrics.remove_worker(f"d{(k // 50) % 7}")
            k += 1

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        for _ in range(200):
            families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
            running = {s.labels["worker"]: s.value for s in families["pdserve_worker_running_requests"].samples}
            free = {s.labels["worker"]: s.value for s in families["pdserve_worker_free_blocks"].samples}
            assert set(running.values()) <= {5.0} and set(free.values()) <= {75.0}
    finally:
        stop.set()
        reporter.join(5)
    assert not reporter.is_alive()


def test_prefix_cache_counters_and_saved_bytes(metrics):
    import dataclasses

    base = worker_stats("p0", "prefill")
    metrics.update_worker(dataclasses.replace(base, prefix_cache_query_tokens=1000, prefix_cache_hit_tokens=600))
    metrics.update_worker(dataclasses.replace(base, prefix_cache_query_tokens=1500, prefix_cache_hit_tokens=800))
    metrics.update_worker(dataclasses.replace(base, prefix_cache_query_tokens=100, prefix_cache_hit_tokens=0))  # restarted
    metrics.request_finished(FinishReason.STOP, dataclasses.replace(timings(), kv_transfer_saved_bytes=4096),
                             10, 5, [0.05] * 4, None, None)
    s = scrape(metrics.start_http_server(0))
    assert s['pdserve_prefix_cache_query_tokens_total{worker="p0"}'] == 1600
    assert s['pdserve_prefix_cache_hit_tokens_total{worker="p0"}'] == 800
    assert s["pdserve_kv_transfer_saved_bytes_total"] == 4096


def test_registries_are_independent():
    a, b = RouterMetrics(), RouterMetrics()
    a.request_rejected("queue_full")
    assert b'outcome="rejected"} 1.0' in a.exposition()
    assert b'outcome="rejected"} 0.0' in b.exposition()


def test_mode_and_transport_labels():
    m = RouterMetrics(mode="colocated")
    m.request_finished("stop", timings(kv_bytes=0), 4, 2, [0.01], None, None)
    m.request_finished("stop", timings(), 4, 2, [0.01], None, None, mode="disaggregated", transport="p2p")
    text = m.exposition().decode()
    assert 'pdserve_time_to_first_token_seconds_count{mode="colocated"} 1.0' in text
    assert 'pdserve_time_to_first_token_seconds_count{mode="disaggregated"} 1.0' in text
    assert 'pdserve_kv_transfer_time_seconds_count{transport="p2p"} 1.0' in text
    assert 'transport="unknown"' not in text  # a request that moved no KV adds no transfer sample


def test_bad_labels_are_refused():
    m = RouterMetrics()
    with pytest.raises(ValueError):
        m.request_finished("rejected", timings(), 1, 1, [], None, None)   # not a served outcome
    with pytest.raises(ValueError):
        m.request_finished("stop", timings(), 1, 1, [], None, None, mode="hybrid")
    with pytest.raises(ValueError):
        m.admission("reject", "kv_full")   # request_rejected counts decision and outcome together
    with pytest.raises(ValueError):
        m.prediction("e2e", 1.0, 1.0)
    assert outcome_name(FinishReason.ERROR) == "error" and outcome_name("length") == "finished_length"


def test_slo_met_rules():
    t = timings(ttft_s=0.3, tpot_s=0.08)
    assert slo_met(t, 5, None, None)
    assert slo_met(t, 5, 0.3, 0.08)            # on the target is within it
    assert not slo_met(t, 5, 0.2, None)
    assert not slo_met(t, 5, None, 0.05)
    assert slo_met(t, 1, 0.5, 0.05)            # one token: TPOT undefined, cannot miss


def test_slo_window_slides():
    clock = FakeClock()
    w = SloWindow(window_s=10.0, clock=clock)
    assert math.isnan(w.attainment()) and w.goodput() == 0.0
    w.record(True)
    w.record(False)
    clock.now += 5
    w.record(True)
    assert w.attainment() == pytest.approx(2 / 3) and w.goodput() == pytest.approx(0.2)
    clock.now += 6                             # the first two fall out of the window
    assert w.attainment() == 1.0 and w.goodput() == pytest.approx(0.1)
    clock.now += 10
    assert math.isnan(w.attainment()) and w.goodput() == 0.0


def test_what_admission_learned_is_read_at_scrape_time(metrics):
    """NaN until an admission is watched; then its current values, whatever changed since."""
    from tests.test_admission import colocated_worker

    port = metrics.start_http_server(0)
    names = ("pdserve_admission_ttft_correction", "pdserve_admission_tpot_correction",
             "pdserve_admission_ttft_margin_ratio", "pdserve_admission_ttft_overhead_seconds")
    assert all(math.isnan(scrape(port)[n]) for n in names)
    admission, _ = colocated_worker()
    metrics.watch_admission(admission.learned)
    first = scrape(port)
    assert [first[n] for n in names] == [1.0, 1.0, admission.ttft_margin.share, 0.0]
    admission.ttft_correction, admission.tpot_correction, admission.ttft_overhead_s = 0.8, 1.3, 0.004
    admission.ttft_margin.share = 0.6
    assert [scrape(port)[n] for n in names] == [0.8, 1.3, 0.6, 0.004]


def test_metrics_module_is_torch_free():
    code = "import sys, router.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0




def test_promtool_accepts_exposition(metrics):
    promtool = require_promtool()
    feed(metrics, num_ok=3)
    proc = subprocess.run([promtool, "check", "metrics"], input=metrics.exposition(),
                          capture_output=True, timeout=30)
    # promtool exits 3 on lint problems (naming, units, missing HELP) and prints them.
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()


class _BlockingTokenizer:
    """encode() waits until the test lets it go: a long prompt being tokenized."""

    def __init__(self) -> None:
        import threading

        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        self.release.wait(10)
        return [3 + b for b in text.encode("utf-8")]


def test_a_request_cancelled_while_its_prompt_is_tokenized_is_counted_aborted(metrics):
    """Every request that got past the door's cheap checks ends as one outcome: one whose client
    leaves while its prompt is still being tokenized (off the event loop) is ``aborted`` too, as
    it is once a worker has it; it was counted nowhere."""
    import asyncio

    from protos import pdserve_pb2 as pb
    from router.convert import ServerDefaults
    from router.generation import GenerationCore

    tokenizer = _BlockingTokenizer()
    core = GenerationCore(orchestrator=None, tokenizer=tokenizer,
                          defaults=ServerDefaults(max_model_len=64, vocab_size=300), metrics=metrics)
    request = pb.GenerateRequest(text="a long prompt")

    async def cancel_while_tokenizing():
        identity = await core.claim(request)

        async def drain():
            async for _ in core.stream(request, identity):
                pass

        task = asyncio.ensure_future(drain())
        await asyncio.get_running_loop().run_in_executor(None, tokenizer.entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        tokenizer.release.set()
        core.release(identity)

    try:
        asyncio.run(cancel_while_tokenizing())
    finally:
        tokenizer.release.set()
        core.close()
    assert metrics._outcome["aborted"]._value.get() == 1
    assert sum(c._value.get() for c in metrics._outcome.values()) == 1
