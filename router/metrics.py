"""The router's Prometheus exporter: one registry that covers the whole cluster.

Role: the router sees every request from arrival to its last token and polls every worker's
``WorkerStats``, so it is the one place that can export cluster-wide serving metrics. Workers
export nothing themselves; their numbers arrive here through ``update_worker``.

Life cycle: the router makes one ``RouterMetrics``, calls ``start_http_server(port)`` (Prometheus
scrapes it; ``deploy/prometheus.yml`` expects port 9400) and then, per request, exactly one of
``request_finished`` / ``request_rejected`` / ``request_invalid`` (a request is one generation: an
HTTP body's n choices, or its batch's prompts, that run are counted each; a body refused before
any of them ran, counted once); ``admission`` per admit or
queue decision; ``update_worker`` whenever fresh ``WorkerStats`` arrive. Each instance owns its
``CollectorRegistry``, so tests (and several routers in one process) never share state.

Metrics (every name starts with ``pdserve_``):

  histograms (per request unless noted)          labels
    time_to_first_token_seconds                  mode
    time_per_output_token_seconds                mode        (requests with >= 2 tokens)
    inter_token_latency_seconds  (per token gap) mode
    e2e_request_latency_seconds                  mode
    request_queue_time_seconds                   -
    request_prefill_time_seconds                 mode
    kv_transfer_time_seconds                     transport   (requests whose KV moved)
    kv_transfer_bytes                            transport
    admission_prediction_ratio (observed / predicted by admission)  target: ttft, tpot
  counters
    requests_total                               outcome: finished_stop, finished_length,
                                                 aborted, error, rejected, invalid
    admission_decisions_total                    decision: admit, queue, reject; reason (admission.Cause's,
                                                 or a refusal's: ttft, tpot_floor, queue_full, queue_deadline,
                                                 max_streams, duplicate_id, shutting_down, capacity)
    preemptions_total                            worker      (from WorkerStats deltas)
    prefix_cache_query_tokens_total,             worker      (from WorkerStats deltas: prompt
    prefix_cache_hit_tokens_total                             tokens looked up / found cached)
    kv_transfer_saved_bytes_total                -           (KV the decode worker held already)
    prompt_tokens_total, generation_tokens_total -
    slo_met_requests_total                       -           (goodput = its rate)
    worker_restarts_total, worker_stalls_total   worker, role (replaced after a death; killed as hung)
    request_migrations_total                     -           (moved to another worker after theirs died)
    kv_handoff_total                             outcome     (how each prefill reached its decode worker)
  gauges
    worker_up                                    worker, role (1 serving; 0 down or restarting)
    worker_running_requests, worker_waiting_requests, worker_waiting_tokens,
    worker_kv_usage_ratio (0-1), worker_free_blocks,
    worker_step_time_seconds (mean of the recent steps)   worker, role
    router_queued_requests                       -
    goodput_requests_per_second                  -           (last ``window_s``, default 60 s)
    slo_attainment_ratio                         -           (same window; NaN when empty)
    kv_group_up                                  -           (1 while the torch.distributed KV group
                                                              is formed; only where the cluster has one)
    admission_ttft_correction,                   -           (what admission has learned, read at
    admission_tpot_correction,                                scrape time: the corrections applied to
    admission_ttft_margin_ratio,                              every prediction, the share of a TTFT
    admission_ttft_overhead_seconds                           target a prediction may use, TTFT outside
                                                              the engines; NaN until ``watch_admission``)

Conventions: Prometheus base units (seconds, bytes, ratios in 0-1), counters end in ``_total``
(prometheus-client appends it), ``worker_*`` gauges carry ``{worker, role}``, and labels stay
few and bounded: never a request id. ``mode`` is ``disaggregated`` or ``colocated`` (conditional
disaggregation serves both from one router); ``transport`` names the KV connector.

SLO: a request meets its SLO when it finished normally (stop or length), its TTFT is within its
TTFT target and its TPOT within its TPOT target; an unset target cannot be missed, and TPOT is
undefined with fewer than two tokens. Attainment is over served requests (finished, aborted or
errored); rejected and invalid requests show in the rejection rate, and goodput (SLO-meeting
requests per second) is the number that both lower.

Hot path: label children are cached so an observation is a dict lookup plus prometheus-client's
own per-metric lock; the sliding window takes one lock per finished request (never per token)
and is evicted at scrape time; a worker's report (one per engine step) is stored and turned into
the ``worker_*`` gauges at scrape time (``WorkerGauges``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client import start_http_server as _start_http_server

from engine.types import FinishReason, HandoffOutcome, WorkerStats
from router.listen import cannot_listen

if TYPE_CHECKING:  # convert.py imports the generated protos; metrics only needs the types
    from router.admission import Learned
    from router.convert import RequestTimings

DEFAULT_METRICS_PORT = 9400
DEFAULT_WINDOW_S = 60.0

# 1-2.5-5 per decade: milliseconds for GPU inter-token gaps up to minutes for CPU e2e latency.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
# Observed / predicted: dense around 1, where admission is right.
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
PREDICTED_TARGETS = ("ttft", "tpot")
LEARNED_GAUGES = (   # (metric, Learned field, help)
    ("pdserve_admission_ttft_correction", "ttft_correction",
     "Admission's TTFT correction: observed / predicted engine time, applied to every TTFT prediction."),
    ("pdserve_admission_tpot_correction", "tpot_correction",
     "Admission's TPOT correction: observed / predicted TPOT, applied to every TPOT prediction."),
    ("pdserve_admission_ttft_margin_ratio", "ttft_margin",
     "The share of a TTFT target an admitted request's prediction may use (learned from misses)."),
    ("pdserve_admission_ttft_overhead_seconds", "ttft_overhead_s",
     "TTFT's part outside the workers' engines (dispatch, actor calls, the way back), as learned."),
)
# Powers of 4 from 1 KiB to 4 GiB: one token of SmolLM2's fp32 KV is 45 KiB, a long prompt GiBs.
BYTES_BUCKETS = tuple(float(1024 * 4**k) for k in range(12))

SERVED_OUTCOMES = ("finished_stop", "finished_length", "aborted", "error")
OUTCOMES = SERVED_OUTCOMES + ("rejected", "invalid")
SLO_OUTCOMES = ("finished_stop", "finished_length")   # only a normal finish can meet an SLO
DECISIONS = ("admit", "queue", "reject")
MODES = ("disaggregated", "colocated")
_FINISH_OUTCOME = {
    FinishReason.STOP.value: "finished_stop",
    FinishReason.LENGTH.value: "finished_length",
    FinishReason.ABORT.value: "aborted",
    FinishReason.ERROR.value: "error",
}


def outcome_name(outcome: FinishReason | str) -> str:
    """A served outcome's label: a ``FinishReason`` (or its value) or a name in SERVED_OUTCOMES."""
    key = outcome.value if isinstance(outcome, FinishReason) else outcome
    name = _FINISH_OUTCOME.get(key, key)
    if name not in SERVED_OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}; expected a FinishReason or one of {SERVED_OUTCOMES}")
    return name


def slo_met(timings: RequestTimings, completion_tokens: int,
            ttft_target_s: float | None, tpot_target_s: float | None) -> bool:
    """Whether a normally finished request met its targets (an unset target cannot be missed)."""
    if ttft_target_s is not None and timings.ttft_s > ttft_target_s:
        return False
    # One token has no time per output token; judging it would fail requests on a 0/0.
    if tpot_target_s is not None and completion_tokens > 1 and timings.tpot_s > tpot_target_s:
        return False
    return True


class SloWindow:
    """Finished requests of the last ``window_s`` seconds: SLO attainment and goodput.

    Appends on the request path, evicts when read (at scrape time), so the hot path pays one
    lock and one append per request.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, bool]] = deque()
        self._num_met = 0
        self._lock = threading.Lock()  # the scrape thread evicts while the event loop appends

    def record(self, met: bool) -> None:
        with self._lock:
            self._events.append((self._clock(), met))
            self._num_met += met

    def _evict(self) -> None:
        horizon = self._clock() - self.window_s
        while self._events and self._events[0][0] <= horizon:
            self._num_met -= self._events.popleft()[1]

    def attainment(self) -> float:
        """Share of served requests in the window that met their SLO; NaN when none were served
        (0 or 1 would both be a claim nobody measured)."""
        with self._lock:
            self._evict()
            return self._num_met / len(self._events) if self._events else math.nan

    def goodput(self) -> float:
        """SLO-meeting requests per second over the window. Like PromQL's rate() over a range
        longer than the uptime, it reads low during the first window."""
        with self._lock:
            self._evict()
            return self._num_met / self.window_s


@dataclass(slots=True)
class _RequestSeries:
    """One mode's histogram children, resolved once instead of per observation."""

    ttft: Histogram
    tpot: Histogram
    itl: Histogram
    e2e: Histogram
    prefill: Histogram


class RouterMetrics:
    """All of the router's metrics in a registry of its own; see the module docstring."""

    def __init__(self, *, mode: str = "disaggregated", kv_transport: str = "unknown",
                 window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        """``mode`` and ``kv_transport`` are the label values used when a call does not name
        its own; ``clock`` drives the SLO window (tests pass a fake one)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.mode = _check_mode(mode)
        self.kv_transport = kv_transport
        self.window = SloWindow(window_s, clock)
        self._server = None
        self._request_series: dict[str, _RequestSeries] = {}
        self._kv_series: dict[str, tuple[Histogram, Histogram]] = {}
        self._worker_counters: dict[str, tuple[Counter, Counter, Counter]] = {}
        self._totals_seen: dict[tuple[str, str], int] = {}   # (worker, WorkerStats field) -> last total
        self._define_request_metrics()
        self._define_counters()
        self._define_gauges()

    # ------------------------------------------------------------ definitions

    def _histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                   buckets: Sequence[float] = LATENCY_BUCKETS_S) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def _define_request_metrics(self) -> None:
        h = self._histogram
        self.ttft = h("pdserve_time_to_first_token_seconds", "Arrival to first token.", ["mode"])
        self.tpot = h("pdserve_time_per_output_token_seconds",
                      "Per request: (e2e - TTFT) / (output tokens - 1).", ["mode"])
        self.itl = h("pdserve_inter_token_latency_seconds", "Gap between consecutive tokens.", ["mode"])
        self.e2e = h("pdserve_e2e_request_latency_seconds", "Arrival to last token.", ["mode"])
        self.queue_time = h("pdserve_request_queue_time_seconds", "Arrival to the start of prefill.")
        self.prefill_time = h("pdserve_request_prefill_time_seconds", "Prefill compute time.", ["mode"])
        self.kv_time = h("pdserve_kv_transfer_time_seconds", "KV hand-off time, prefill to decode.",
                         ["transport"])
        self.kv_bytes = h("pdserve_kv_transfer_bytes", "KV bytes handed off per request.",
                          ["transport"], buckets=BYTES_BUCKETS)
        self.prediction_ratio = h("pdserve_admission_prediction_ratio",
                                  "Observed / predicted TTFT and TPOT of admitted requests (1 = exact).",
                                  ["target"], buckets=RATIO_BUCKETS)

    def _define_counters(self) -> None:
        r = self.registry
        self.requests = Counter("pdserve_requests_total", "Requests by how they ended.", ["outcome"], registry=r)
        self._outcome = {o: self.requests.labels(o) for o in OUTCOMES}  # every outcome visible at 0
        self.admissions = Counter("pdserve_admission_decisions_total", "Admission decisions.",
                                  ["decision", "reason"], registry=r)
        self.preemptions = Counter("pdserve_preemptions_total", "Requests preempted by a worker.",
                                   ["worker"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens of served requests.",
                                     registry=r)
        self.prefix_queries = Counter("pdserve_prefix_cache_query_tokens_total",
                                      "Prompt tokens a worker looked up in its prefix cache.", ["worker"], registry=r)
        self.prefix_hits = Counter("pdserve_prefix_cache_hit_tokens_total",
                                   "Prompt tokens a worker found in its prefix cache (not computed, or not moved).",
                                   ["worker"], registry=r)
        self.kv_saved_bytes = Counter("pdserve_kv_transfer_saved_bytes_total",
                                      "KV bytes not handed off: the decode worker's prefix cache held them.",
                                      registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens_total", "Tokens generated.", registry=r)
        self.slo_met_requests = Counter("pdserve_slo_met_requests_total",
                                        "Requests that finished within their SLO (goodput = rate).", registry=r)
        self.worker_restarts = Counter("pdserve_worker_restarts_total", "Workers replaced after their actor died.",
                                       ["worker", "role"], registry=r)
        self.worker_stalls = Counter("pdserve_worker_stalls_total",
                                     "Workers killed (then replaced) as hung: a step that never ended, or no heartbeat.",
                                     ["worker", "role"], registry=r)
        self.migrations = Counter("pdserve_request_migrations_total",
                                  "Requests moved to another worker after theirs died mid-request.", registry=r)
        self.handoffs = Counter("pdserve_kv_handoff_total",
                                "How each prefill reached its decode worker (ok, recomputed, peer_dead, ...).",
                                ["outcome"], registry=r)
        for outcome in HandoffOutcome:   # every outcome visible at 0: a silent fallback shows as a rate
            self.handoffs.labels(outcome.value)

    def _define_gauges(self) -> None:
        r, wl = self.registry, ["worker", "role"]
        self._worker_gauges = WorkerGauges()   # running, waiting, KV, step time: read at scrape time
        r.register(self._worker_gauges)
        self.router_queued = Gauge("pdserve_router_queued_requests", "Requests queued by admission.", registry=r)
        self.worker_up = Gauge("pdserve_worker_up", "1 while the worker serves; 0 while it is down or restarting.",
                               wl, registry=r)
        goodput = Gauge("pdserve_goodput_requests_per_second",
                        "SLO-meeting requests per second over the sliding window.", registry=r)
        goodput.set_function(self.window.goodput)  # computed at scrape time, free on the hot path
        attainment = Gauge("pdserve_slo_attainment_ratio",
                           "Share of served requests in the sliding window that met their SLO.", registry=r)
        attainment.set_function(self.window.attainment)
        # What admission has learned: why it admits what it admits (a correction pinned at its
        # clamp, a margin shrunk by misses), without a debugger on the router.
        self._learned: Callable[[], Learned] | None = None
        for name, field, doc in LEARNED_GAUGES:
            Gauge(name, doc, registry=r).set_function(lambda field=field: self._read_learned(field))

    def watch_admission(self, learned: Callable[[], Learned]) -> None:
        """Export what ``learned`` returns (``Admission.learned``), read at scrape time."""
        self._learned = learned

    def _read_learned(self, field: str) -> float:
        return math.nan if self._learned is None else float(getattr(self._learned(), field))

    # ------------------------------------------------------------ exposition

    def start_http_server(self, port: int = DEFAULT_METRICS_PORT, addr: str = "127.0.0.1") -> int:
        """Serve this registry at ``http://addr:port/metrics`` from a daemon thread; port 0 picks
        a free port. Returns the bound port."""
        if self._server is not None:
            raise RuntimeError("metrics HTTP server already started")
        # prometheus-client >= 0.19 returns (server, thread); the server knows its bound port.
        try:
            self._server, _ = _start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:   # said with the flag: a bare "[Errno 98] Address already in use" names no door
            raise cannot_listen("metrics_port", addr, port, exc.strerror, exc.errno) from None
        return self._server.server_port

    def close(self) -> None:
        """Stop the HTTP server, if any (the registry stays readable)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, exactly what a scrape returns."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------ requests

    def request_finished(
        self,
        outcome: FinishReason | str,
        timings: RequestTimings,
        prompt_tokens: int,
        completion_tokens: int,
        itls: Sequence[float],
        ttft_target_s: float | None,
        tpot_target_s: float | None,
        *,
        mode: str | None = None,
        transport: str | None = None,
    ) -> None:
        """A served request ended (normally, aborted or errored). ``itls`` are its gaps between
        consecutive tokens; ``mode``/``transport`` default to the constructor's."""
        name = outcome_name(outcome)
        series = self._series_for_mode(mode or self.mode)
        self._outcome[name].inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.queue_time.observe(timings.queue_s)
        series.e2e.observe(timings.e2e_s)
        self._observe_tokens(series, timings, completion_tokens, itls)
        if timings.kv_transfer_bytes > 0:  # colocated requests and early aborts moved no KV
            kv_time, kv_bytes = self._series_for_transport(transport or self.kv_transport)
            kv_time.observe(timings.kv_transfer_s)
            kv_bytes.observe(timings.kv_transfer_bytes)
        if timings.kv_transfer_saved_bytes > 0:
            self.kv_saved_bytes.inc(timings.kv_transfer_saved_bytes)
        met = name in SLO_OUTCOMES and slo_met(timings, completion_tokens, ttft_target_s, tpot_target_s)
        if met:
            self.slo_met_requests.inc()
        self.window.record(met)

    @staticmethod
    def _observe_tokens(series: _RequestSeries, timings: RequestTimings, completion_tokens: int,
                        itls: Sequence[float]) -> None:
        if completion_tokens < 1:  # aborted or failed before the first token: no TTFT exists
            return
        series.ttft.observe(timings.ttft_s)
        series.prefill.observe(timings.prefill_s)
        if completion_tokens > 1:
            series.tpot.observe(timings.tpot_s)
        observe = series.itl.observe
        for gap in itls:
            observe(gap)

    def request_left_early(self) -> None:
        """The client left before its request reached admission (while its prompt was being
        tokenized): ``aborted``, as any abort, with no latency to observe."""
        self._outcome["aborted"].inc()
        self.window.record(False)

    def request_rejected(self, reason: str) -> None:
        """Admission (or the router: shutting down, no workers) refused a request: counts the
        outcome ``rejected`` and the decision ``reject`` with ``reason``. Call this instead of
        ``admission("reject", ...)``."""
        self._outcome["rejected"].inc()
        self.admissions.labels("reject", reason).inc()

    def request_invalid(self) -> None:
        """Validation refused a request (INVALID_ARGUMENT) before admission saw it."""
        self._outcome["invalid"].inc()

    def admission(self, decision: str, reason: str) -> None:
        """An admit or queue decision (a queued request admitted later makes two). Rejections go
        through ``request_rejected`` so the decision and the outcome are counted together."""
        if decision not in ("admit", "queue"):
            raise ValueError(f"decision must be 'admit' or 'queue', got {decision!r} (rejections: request_rejected)")
        self.admissions.labels(decision, reason).inc()

    def prediction(self, target: str, predicted_s: float | None, observed_s: float) -> None:
        """How far admission's prediction for an admitted request was from what it saw."""
        if target not in PREDICTED_TARGETS:
            raise ValueError(f"target must be one of {PREDICTED_TARGETS}, got {target!r}")
        if predicted_s and math.isfinite(predicted_s) and observed_s > 0:
            self.prediction_ratio.labels(target).observe(observed_s / predicted_s)

    def set_queued(self, num_queued: int) -> None:
        """Requests the router holds in its admission queue right now."""
        self.router_queued.set(num_queued)

    def _series_for_mode(self, mode: str) -> _RequestSeries:
        series = self._request_series.get(mode)
        if series is None:
            m = _check_mode(mode)
            series = _RequestSeries(self.ttft.labels(m), self.tpot.labels(m), self.itl.labels(m),
                                    self.e2e.labels(m), self.prefill_time.labels(m))
            self._request_series[mode] = series
        return series

    def _series_for_transport(self, transport: str) -> tuple[Histogram, Histogram]:
        pair = self._kv_series.get(transport)
        if pair is None:
            pair = self._kv_series[transport] = (self.kv_time.labels(transport), self.kv_bytes.labels(transport))
        return pair

    def migration(self) -> None:
        """A request lost its worker mid-request and resumed on another."""
        self.migrations.inc()

    def handoff(self, outcome: str) -> None:
        """One prefill's hand-off ended with ``outcome`` (a ``HandoffOutcome`` value)."""
        self.handoffs.labels(outcome).inc()

    # ------------------------------------------------------------ workers

    def worker_state(self, worker_id: str, role: str, up: bool, restarted: bool = False) -> None:
        """A worker went down, or came (back) up; ``restarted``: as a replacement."""
        self.worker_up.labels(worker_id, role).set(1 if up else 0)
        restarts = self.worker_restarts.labels(worker_id, role)   # exported at 0 from the start: rate() needs a series
        self.worker_stalls.labels(worker_id, role)
        if restarted:
            restarts.inc()

    def kv_group(self, is_up: Callable[[], bool]) -> None:
        """Export whether the cluster's torch.distributed KV group is formed (read at scrape time)."""
        up = Gauge("pdserve_kv_group_up", "1 while the torch.distributed KV group is formed; 0 from a "
                   "member's loss until it is formed again.", registry=self.registry)
        up.set_function(lambda: 1.0 if is_up() else 0.0)

    def worker_stalled(self, worker_id: str, role: str) -> None:
        self.worker_stalls.labels(worker_id, role).inc()

    def update_worker(self, stats: WorkerStats) -> None:
        """Fresh stats from one worker: kept for the gauges (read at scrape time), running
        totals count the delta. Called per decode step of every worker, so it stores, and
        leaves the gauges' arithmetic and locks to the scrape."""
        self._worker_gauges.update(stats)
        counters = self._counters_for_worker(stats.worker_id)
        for counter, field in zip(counters, _TOTAL_FIELDS):
            self._count_total(counter, stats, field)

    def _count_total(self, counter: Counter, stats: WorkerStats, field: str) -> None:
        total = getattr(stats, field)
        key = (stats.worker_id, field)
        seen = self._totals_seen.get(key, 0)
        if total == seen:   # the common case: nothing new since the last report
            return
        # WorkerStats carries a running total; a smaller one means the worker restarted from 0.
        counter.inc(total - seen if total > seen else total)
        self._totals_seen[key] = total

    def remove_worker(self, worker_id: str) -> None:
        """Drop a departed worker's gauges (a stale gauge would read as a live, idle worker)."""
        self._worker_gauges.remove(worker_id)
        self._worker_counters.pop(worker_id, None)
        for key in [k for k in self._totals_seen if k[0] == worker_id]:
            del self._totals_seen[key]

    def _counters_for_worker(self, worker_id: str) -> tuple[Counter, Counter, Counter]:
        counters = self._worker_counters.get(worker_id)
        if counters is None:
            counters = self._worker_counters[worker_id] = (
                self.preemptions.labels(worker_id), self.prefix_queries.labels(worker_id),
                self.prefix_hits.labels(worker_id))
        return counters


# WorkerStats' running totals and the counters (in _counters_for_worker's order) they feed.
_TOTAL_FIELDS = ("num_preemptions", "prefix_cache_query_tokens", "prefix_cache_hit_tokens")

# The per-worker gauges: (name, help, how to read it from a worker's last stats).
_WORKER_GAUGES: tuple[tuple[str, str, Callable[[WorkerStats], float]], ...] = (
    ("pdserve_worker_running_requests", "Requests in the running batch.", lambda s: s.num_running),
    ("pdserve_worker_waiting_requests", "Requests waiting in the worker.", lambda s: s.num_waiting),
    ("pdserve_worker_waiting_tokens", "Prompt tokens waiting.", lambda s: s.num_waiting_tokens),
    ("pdserve_worker_kv_usage_ratio", "Used KV blocks / all (0-1).", lambda s: s.kv_usage),
    ("pdserve_worker_free_blocks", "Free KV blocks.", lambda s: s.num_free_blocks),
)
_STEP_TIME_GAUGE = ("pdserve_worker_step_time_seconds", "Mean recent engine step time.")


class WorkerGauges(Collector):
    """The ``worker_*`` gauges, computed from each worker's last stats when scraped.

    Workers report every engine step (hundreds of reports a second across a cluster), and
    Prometheus reads a few times a minute: storing the report and doing the gauges' work at
    scrape time makes a report one dict store instead of six locked gauge sets and a mean.
    The event loop stores, the scrape thread reads: each read takes a snapshot of the dicts
    (a C-level copy under the GIL) and never sees a half-written entry.
    """

    def __init__(self) -> None:
        self._stats: dict[tuple[str, str], WorkerStats] = {}     # (worker, role) -> last stats
        self._steps: dict[tuple[str, str], tuple] = {}           # last non-empty recent_steps

    def update(self, stats: WorkerStats) -> None:
        key = (stats.worker_id, stats.role)
        self._stats[key] = stats
        if stats.recent_steps:   # an idle worker reports no steps: keep its last known step time
            self._steps[key] = stats.recent_steps

    def remove(self, worker_id: str) -> None:
        for key in [k for k in self._stats if k[0] == worker_id]:
            del self._stats[key]
            self._steps.pop(key, None)

    def collect(self):
        stats, steps = dict(self._stats), dict(self._steps)
        labels = ["worker", "role"]
        for name, doc, read in _WORKER_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for (worker, role), s in stats.items():
                family.add_metric([worker, role], read(s))
            yield family
        family = GaugeMetricFamily(*_STEP_TIME_GAUGE, labels=labels)
        for (worker, role), recent in steps.items():
            if (worker, role) in stats:
                family.add_metric([worker, role], sum(t.duration_s for t in recent) / len(recent))
        yield family

    def describe(self):
        """Names known without data (the registry checks for clashes at registration)."""
        for name, doc, _ in _WORKER_GAUGES:
            yield GaugeMetricFamily(name, doc, labels=["worker", "role"])
        yield GaugeMetricFamily(*_STEP_TIME_GAUGE, labels=["worker", "role"])


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode
