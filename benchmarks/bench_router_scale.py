"""The router at scale, simulated: 16 prefill + 48 decode workers and 5,000 concurrent streams
through the real router (admission, pair choice, orchestration, decode-stream demux, metrics,
grpc.aio), the workers simulated (``benchmarks/sim_workers.py``: steps as long as the real
engine's fitted step-time model says, ``benchmarks/step_timings.py``).

Load: a CLIENT PROCESS (spawned: it shares nothing of the router's CPU accounting) keeps
``--streams`` users busy, each sending a request (``--prompt-len`` random token ids,
``--max-tokens`` output tokens, SLO targets so admission does its full work) and sending the
next as soon as its stream ends; the users start evenly over ``--ramp-s``. After ``--warmup-s``
more, the router is measured for ``--measure-s``; then the users stop (their live streams are
cancelled) and the run ends with the leak check (no request left on the router or any
simulated worker, every block free).

Measured, in the router process:
  - admission decision latency: every ``Admission.decide`` call timed (wall and thread CPU);
  - router CPU per streamed token: getrusage(RUSAGE_SELF) of this process over the window,
    minus the simulated workers' thread (its own CPU clock), divided by the tokens the client
    received in that window (both read CLOCK_MONOTONIC); the event loop thread's share too;
  - per-report cost vs queue length: the launcher's handler of a decode worker's report
    (``Cluster._on_worker_stats``: metrics, step-model update, waking queued requests, their
    check of that worker or re-decisions) timed with 100 and with 5,000 requests queued in
    admission, every decode worker full, in alternating rounds, with the number of decisions each
    report caused; and the same for a wake that names no worker (every woken request decides);
  - with ``--profile``: py-spy samples this process over the window (a separate run from the
    measured one, py-spy slows it); ``--profile-out`` keeps the raw stacks.

Run: ``python benchmarks/bench_router_scale.py`` (~3 min), writes
benchmarks/results/router_scale.txt; ``--quick`` (4 + 8 workers, 400 streams, short) checks
the script and prints only; ``--report-cost-only`` (~30 s) measures and prints the per-report
section alone (no client, no grpc: for A/B of admission's wake and decision costs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime
import gc
import logging
import multiprocessing as mp
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

logger = logging.getLogger("bench_router_scale")

BIN_S = 0.1
QUEUED_SIZES = (100, 5000)


# ---------------------------------------------------------------- the client process


def client_main(address: str, args: dict, conn) -> None:
    """Runs in the spawned process: imports, says ready, takes (start_at, stop_at) on
    CLOCK_MONOTONIC, runs the users, reports. (No torch here: nothing to set its threads for.)"""
    try:
        import grpc  # noqa: F401  (imported before "ready": the start is not held up by imports)

        from router.client import AsyncPdserveClient  # noqa: F401

        conn.send(("ready", None))
        start_at, stop_at = conn.recv()
        cpu0 = _cpu_s()
        result = asyncio.run(_users(address, args, start_at, stop_at))
        result["client_cpu_s"] = _cpu_s() - cpu0
        conn.send(("done", result))
    except BaseException as exc:  # the parent must hear about it rather than wait forever
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _users(address: str, args: dict, start_at: float, stop_at: float) -> dict:
    from router.client import AsyncPdserveClient

    # A connection each (grpc shares one TCP connection among channels to one address otherwise).
    clients = [AsyncPdserveClient(address, options=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(args["channels"])]
    out = {"bins": collections.Counter(), "messages": 0, "finished": 0, "rejected": 0, "errors": 0,
           "error_samples": [], "ttft_s": [], "wrong_tokens": 0}
    n = args["streams"]
    tasks = [asyncio.create_task(_user(i, clients[i % len(clients)], args, start_at + i * args["ramp_s"] / n,
                                       stop_at, out)) for i in range(n)]
    await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients:
        await client.close()
    out["bins"] = dict(out["bins"])
    return out


async def _user(i: int, client, args: dict, begin: float, stop_at: float, out: dict) -> None:
    import grpc

    rng = random.Random(i)
    await asyncio.sleep(max(0.0, begin - time.monotonic()))
    k = 0
    while time.monotonic() < stop_at:
        k += 1
        rid = f"u{i}-{k}"
        prompt = [rng.randrange(1000, 40000) for _ in range(args["prompt_len"])]
        sent, tokens = time.monotonic(), 0
        try:
            async for resp in client.generate(token_ids=prompt, request_id=rid, max_tokens=args["max_tokens"],
                                              ignore_eos=True, ttft_ms=args["ttft_ms"], tpot_ms=args["tpot_ms"]):
                now = time.monotonic()
                if resp.token_ids:
                    if not tokens:
                        out["ttft_s"].append(now - sent)
                    tokens += len(resp.token_ids)
                    out["bins"][int(now / BIN_S)] += len(resp.token_ids)
                out["messages"] += 1
            out["finished"] += 1
            out["wrong_tokens"] += tokens != args["max_tokens"]
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                out["rejected"] += 1
                await asyncio.sleep(0.5)   # a refused user backs off a little
            else:
                out["errors"] += 1
                if len(out["error_samples"]) < 5:
                    out["error_samples"].append(f"{rid} {exc.code().name}: {exc.details()} after"
                                                f" {time.monotonic() - sent:.1f} s, {tokens} tokens,"
                                                f" {stop_at - time.monotonic():.1f} s before the end;"
                                                f" {exc.debug_error_string()}")
                await asyncio.sleep(0.5)   # a failed user too (a retry storm would measure itself)


# ---------------------------------------------------------------- the router process


class GCTimer:
    """Every garbage collection in this process: its generation and pause (CPU time of the
    thread it ran in: wall time on a loaded machine counts the waits for a core too)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []   # (generation, seconds)
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.pauses.append((info["generation"], time.thread_time() - self._start))

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


class StallWatch:
    """A thread that wakes every 50 ms and keeps the gaps it sees over 0.5 s: the process was
    stopped (SIGSTOP: a shared machine pausing niced work) or starved of a core that long. A
    stopped router keeps grpc core's clocks running: calls then time out unrequested (30 s) and
    the run measures the pause, not the router."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.05):
            now = time.monotonic()
            if now - last > 0.5:
                self.gaps.append(now - last)
            last = now

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


async def loop_lag(out: list[float], period_s: float = 0.01) -> None:
    """On the router's loop: how late a 10 ms sleep wakes (about one loop iteration's length:
    grpc.aio picks a new call up only every few iterations, so long ones slow admission of calls)."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        out.append(time.perf_counter() - t - period_s)


class DecisionTimer:
    """Times every call of ``admission.decide`` (the decision itself: predictions, pair choice),
    and notes the decisions a garbage collection ran inside (``gc_timer``)."""

    def __init__(self, admission, gc_timer: GCTimer | None = None) -> None:
        self.wall_s: list[float] = []
        self.cpu_s: list[float] = []
        self.with_gc: list[bool] = []
        self.calls = 0
        decide = admission.decide

        def timed(*args, **kwargs):
            n = len(gc_timer.pauses) if gc_timer else 0
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return decide(*args, **kwargs)
            finally:
                self.cpu_s.append(time.thread_time() - c0)
                self.wall_s.append(time.perf_counter() - t0)
                self.with_gc.append(bool(gc_timer) and len(gc_timer.pauses) > n)
                self.calls += 1

        admission.decide = timed

    def reset(self) -> None:
        self.wall_s.clear()
        self.cpu_s.clear()
        self.with_gc.clear()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


@dataclasses.dataclass
class Window:
    t0: float
    t1: float
    process_cpu_s: float
    sim_cpu_s: float
    loop_cpu_s: float
    decisions: int

    @property
    def router_cpu_s(self) -> float:
        return self.process_cpu_s - self.sim_cpu_s


ANCHOR_SHAPE = (64, 21062)   # results/engine_w64.txt: decode step at batch 64, KV 21,062 tokens


def speed_from(args):
    """The step model fitted to the recorded real steps, scaled so its decode step at
    ``ANCHOR_SHAPE`` takes ``--anchor-ms`` (the steps were recorded on a shared machine: their
    level says how loaded it was, their shape what a step costs; the anchor is a quiet run's)."""
    from benchmarks.sim_workers import SimSpeed
    from benchmarks.step_timings import load

    steps = load(args.steps)
    if args.anchor_ms:
        args.time_scale = SimSpeed.fitted(steps).step_s(*ANCHOR_SHAPE) / (args.anchor_ms / 1e3)
    return SimSpeed.fitted([dataclasses.replace(s, duration_s=s.duration_s / args.time_scale) for s in steps])


def start_cluster(args, speed):
    from benchmarks.sim_cluster import SimCluster
    from benchmarks.sim_workers import SimConfig
    from deploy.launcher import ClusterConfig, ClusterThread
    from router.limits import ServerLimits

    per_decode = -(-args.streams // args.decode)
    blocks = per_decode * -(-(args.prompt_len + args.max_tokens) // 16) * 2
    limits = ServerLimits(max_concurrent_streams=args.streams + 64, max_queued_requests=args.streams,
                          stream_interval=args.stream_interval)
    config = ClusterConfig(num_prefill=args.prefill, num_decode=args.decode, port=0, metrics_port=0,
                           defaults={"limits": limits}, event_loop=args.event_loop)
    sim = SimConfig(num_blocks=blocks, max_num_seqs=2 * per_decode, max_num_batched_tokens=2048)
    thread = ClusterThread(config, SimCluster(config, speed, sim))
    thread.start(120)
    if not args.no_gc_freeze:   # as ``pdserve serve`` does once started (router/gc_policy.py)
        from router.gc_policy import apply_serving_gc_policy

        apply_serving_gc_policy(thresholds=not args.gc_default_thresholds)
    return thread


def slo_targets(args, speed) -> tuple[float, float]:
    """TPOT: the decode step at the full batch (streams / decode workers) with headroom; TTFT: a
    queue of prompts at each prefill worker, with headroom (admission is to admit most)."""
    per_decode = -(-args.streams // args.decode)
    step = speed.step_s(per_decode, per_decode * (args.prompt_len + args.max_tokens // 2))
    tpot_ms = args.tpot_ms or 1.5 * step * 1e3
    ttft_ms = args.ttft_ms or max(2000.0, 40 * args.prompt_len * speed.prefill_s_per_token * 1e3)
    return ttft_ms, tpot_ms


def measure(args, speed, address_holder: dict) -> dict:
    """One run: cluster, client process, the measured window, leak check."""
    thread = start_cluster(args, speed)
    cluster = thread.cluster
    address = f"127.0.0.1:{cluster.port}"
    gc_timer = GCTimer()
    stalls = StallWatch()
    timer = DecisionTimer(cluster.admission, gc_timer)
    ttft_ms, tpot_ms = slo_targets(args, speed)
    client_args = {"streams": args.streams, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                   "channels": args.channels, "ramp_s": args.ramp_s, "ttft_ms": ttft_ms, "tpot_ms": tpot_ms}
    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    child = ctx.Process(target=client_main, args=(address, client_args, child_conn), daemon=True)
    child.start()
    profiler = None
    try:
        kind, detail = parent.recv()
        if kind != "ready":
            raise RuntimeError(f"client failed: {detail}")
        start_at = time.monotonic() + 0.5
        t0 = start_at + args.ramp_s + args.warmup_s
        t1 = t0 + args.measure_s
        parent.send((start_at, t1 + 0.5))
        time.sleep(max(0.0, t0 - time.monotonic()))
        if args.profile:
            profiler = start_py_spy(args)
        w0 = (time.monotonic(), process_cpu_s(), cluster.host.cpu_s(), thread_cpu_s(thread._thread), timer.calls)
        gc0 = len(gc_timer.pauses)
        lags: list[float] = []
        lag_probe = asyncio.run_coroutine_threadsafe(loop_lag(lags), thread.loop)
        queued_max = 0
        live: list[int] = []   # Generate calls the router's handlers hold (the rest wait in gRPC core)
        while time.monotonic() < t1:
            time.sleep(0.05)
            queued_max = max(queued_max, cluster.admission.num_queued)
            live.append(len(cluster.servicer.core.live))
        w1 = (time.monotonic(), process_cpu_s(), cluster.host.cpu_s(), thread_cpu_s(thread._thread), timer.calls)
        lag_probe.cancel()
        decisions = (list(timer.wall_s), list(timer.cpu_s), list(timer.with_gc))
        gc_window = gc_timer.pauses[gc0:]
        window = Window(w0[0], w1[0], w1[1] - w0[1], w1[2] - w0[2], w1[3] - w0[3], w1[4] - w0[4])
        kind, result = parent.recv()
        if kind != "done":
            raise RuntimeError(f"client failed: {result}")
        profile = finish_py_spy(profiler, args) if profiler else None
        leaks = leak_check(thread)
        steps = decode_steps(cluster)
        metrics = cluster.metrics.exposition()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        thread.stop()
        gc_timer.close()
        stalls.close()
    return {"window": window, "gc": gc_window, "stalls": stalls.gaps, "lags": lags, "client": result, "decisions": decisions, "queued_max": queued_max,
            "live": live, "router_ttft_p50_s": histogram_quantile(metrics, "pdserve_time_to_first_token_seconds", 0.5),
            "leaks": leaks, "steps": steps, "profile": profile, "targets": (ttft_ms, tpot_ms),
            "metrics_bytes": len(metrics)}


def histogram_quantile(exposition: bytes, name: str, q: float) -> float:
    """The q-quantile of a Prometheus histogram in ``exposition`` (all label sets summed), read
    as PromQL's histogram_quantile does: linear within the bucket that crosses it."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(exposition.decode()):
        if family.name == name:
            for sample in family.samples:
                if sample.name == name + "_bucket":
                    buckets[float(sample.labels["le"])] += sample.value
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return float("nan")
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for upper in bounds:
        if buckets[upper] >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(buckets[upper] - below, 1e-12)
        lower, below = upper, buckets[upper]
    return lower


def leak_check(thread) -> dict:
    """Requests or blocks left on any simulated worker, or anything the router still counts."""
    from deploy.launcher import holds_anything

    cluster = thread.cluster
    deadline = time.monotonic() + 30
    while True:
        reports = thread.run(cluster.leak_reports())
        leaks = {w: r for w, r in reports.items() if holds_anything(r)}
        router = {"streams_registered": cluster.streams.num_registered, "queued": cluster.admission.num_queued,
                  "cleanups": len(cluster.orchestrator._cleanups), "live_calls": len(cluster.servicer.live)}
        router = {k: v for k, v in router.items() if v}
        if (not leaks and not router) or time.monotonic() > deadline:
            return {**leaks, **({"router": router} if router else {})}
        time.sleep(0.2)


def decode_steps(cluster) -> dict:
    sims = [w for w in cluster.sim_workers() if w.role == "decode"]
    recent = [s for w in sims for s in w.recent_steps if s.num_prefill_tokens == 0]
    return {"steps": sum(w.num_steps for w in sims),
            "batch_mean": statistics.fmean(s.num_seqs for s in recent) if recent else 0.0,
            "step_ms_mean": statistics.fmean(s.duration_s for s in recent) * 1e3 if recent else 0.0}


# ---------------------------------------------------------------- per-report cost vs queue length


def report_cost(speed, args) -> dict[int, dict]:
    """The launcher's per-report handler with ``n`` requests queued in admission, for each ``n``
    in ``QUEUED_SIZES``, rounds alternating; CPU per report and decisions per report."""
    return asyncio.run(_report_cost(speed, args))


async def _report_cost(speed, args) -> dict[int, dict]:
    results = {n: {"cpu_us": [], "decisions": [], "finish_cpu_us": [], "finish_decisions": [], "decision_us": []}
               for n in QUEUED_SIZES}
    benches = {n: await _QueuedBench.make(speed, args, n) for n in QUEUED_SIZES}
    try:
        for _ in range(args.report_rounds):
            for n, bench in benches.items():
                cpu_us, decisions = await bench.round(args.reports_per_round)
                results[n]["cpu_us"].append(cpu_us)
                results[n]["decisions"].append(decisions)
                bench.timer.reset()
                cpu_us, decisions = await bench.round(args.reports_per_round, finishes=True)
                results[n]["finish_cpu_us"].append(cpu_us)
                results[n]["finish_decisions"].append(decisions)
                results[n]["decision_us"].extend(c * 1e6 for c in bench.timer.cpu_s)
    finally:
        for bench in benches.values():
            await bench.close()
    return results


class _QueuedBench:
    """A router (registry, admission, metrics, the launcher's report handler) over 16 + 48
    simulated workers' stats, every decode worker full, ``n`` requests queued for room."""

    @classmethod
    async def make(cls, speed, args, n: int) -> _QueuedBench:
        self = cls()
        from benchmarks.sim_cluster import SimCluster
        from benchmarks.sim_workers import SimConfig
        from deploy.launcher import ClusterConfig
        from engine.types import RequestSpec, SamplingParams, SLOTarget, StepTiming, WorkerStats
        from router.admission import Admission
        from router.metrics import RouterMetrics
        from router.registry import DecodeProgress, WorkerHandle

        config = ClusterConfig(num_prefill=args.prefill, num_decode=args.decode)
        self.cluster = cluster = SimCluster(config, speed, SimConfig())   # its registry and handler only
        cluster.metrics = RouterMetrics()
        cluster.admission = Admission(cluster.registry, max_queued=None)
        self.timer = DecisionTimer(cluster.admission)
        per_decode = -(-args.streams // args.decode)
        steps = tuple(StepTiming(k, k, 0, k * 150, speed.step_s(k, k * 150)) for k in range(per_decode - 63, per_decode + 1))
        prefill_steps = tuple(StepTiming(4, 512, 512, 512, 512 * speed.prefill_s_per_token) for _ in range(4))
        for i in range(args.prefill):
            w = WorkerHandle(f"prefill-{i}", "prefill", None, "sim", "cpu",
                             stats=WorkerStats(f"prefill-{i}", "prefill", 0, 0, 0, 4096, 4096, 16,
                                               recent_steps=prefill_steps))
            cluster.registry.add(w)
        for i in range(args.decode):   # full: no KV room left, a batch decoding
            w = WorkerHandle(f"decode-{i}", "decode", None, "sim", "cpu",
                             stats=WorkerStats(f"decode-{i}", "decode", 0, per_decode, 0, 0, 4096, 16,
                                               recent_steps=steps))
            for j in range(per_decode):
                w.track(f"d{i}-{j}", DecodeProgress(args.max_tokens, 1.0, first_token_s=time.perf_counter()))
            cluster.registry.add(w)
        for w in cluster.registry.all:
            cluster.admission.observe_stats(w)
        spec = RequestSpec("q", tuple(range(args.prompt_len)), SamplingParams(max_tokens=args.max_tokens),
                           SLOTarget(ttft_s=1e6, tpot_s=1.0))
        self.waiters = [asyncio.create_task(cluster.admission.acquire(dataclasses.replace(spec, req_id=f"q{k}")))
                        for k in range(n)]
        while cluster.admission.num_queued < n:
            await asyncio.sleep(0)
        self.reports = 0
        return self

    async def round(self, num_reports: int, finishes: bool = False) -> tuple[float, float]:
        """Mean CPU microseconds and decisions per report over ``num_reports`` reports (the
        reporting workers stay full); ``finishes``: per wake that names no worker instead (a
        worker back up: anything may have changed, every woken request decides again)."""
        cluster = self.cluster
        decode = cluster.registry.decode
        calls0, cpu0 = self.timer.calls, time.thread_time()
        for k in range(num_reports):
            worker = decode[(self.reports + k) % len(decode)]
            if finishes:
                cluster.admission.notify()
            else:
                cluster._on_worker_stats(worker)
            for _ in range(4):     # the woken waiters' re-decisions (and their own wake-ups)
                await asyncio.sleep(0)
        self.reports += num_reports
        cpu = time.thread_time() - cpu0
        return cpu / num_reports * 1e6, (self.timer.calls - calls0) / num_reports

    async def close(self) -> None:
        for task in self.waiters:
            task.cancel()
        await asyncio.gather(*self.waiters, return_exceptions=True)


# ---------------------------------------------------------------- py-spy


def start_py_spy(args):
    exe = Path(sys.executable).with_name("py-spy")
    out = tempfile.NamedTemporaryFile(prefix="router-scale-", suffix=".txt", delete=False).name
    cmd = [str(exe), "record", "--pid", str(os.getpid()), "--duration", str(int(args.measure_s)), "--rate", "200",
           "--format", "raw", "--threads", "--output", out]
    # --native (C frames: grpc's Cython, uvloop) needs py-spy to stop the process per sample
    cmd += ["--native"] if args.profile_native else ["--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out


def finish_py_spy(profiler, args) -> dict | None:
    proc, path = profiler
    try:
        proc.wait(timeout=args.measure_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
    text = Path(path).read_text() if Path(path).exists() else ""
    if args.profile_out:
        Path(args.profile_out).write_text(text)
    if not text:
        return {"error": proc.stderr.read().decode()[-500:] if proc.stderr else "no output"}
    return summarize_stacks(text)


def summarize_stacks(text: str) -> dict:
    """py-spy's collapsed stacks -> samples per thread, and on the router's loop thread: self
    samples per function and inclusive samples per area of the router."""
    threads, self_counts, areas = collections.Counter(), collections.Counter(), collections.Counter()
    loop_total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        n = int(count)
        thread = frames[0]
        threads[thread] += n
        if "pdserve-cluster" not in thread:
            continue
        loop_total += n
        self_counts[_short(frames[-1])] += n
        areas[_area(frames)] += n
    return {"threads": threads.most_common(8), "loop_total": loop_total,
            "self": self_counts.most_common(25), "areas": areas.most_common()}


def _short(frame: str) -> str:
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, _line = where.rpartition(":")
    for marker in ("/site-packages/", "/wt-sim/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"


AREAS = (  # the innermost match names the area a sample is charged to
    ("router/admission.py", "admission (decisions, predictions)"),
    ("router/step_model.py", "admission (step-time model fits)"),
    ("router/prefix_index.py", "admission (prefix index)"),
    ("router/metrics.py", "metrics"),
    ("prometheus_client", "metrics"),
    ("router/streams.py", "decode-stream demux"),
    ("router/delta_queue.py", "per-request delta queues"),
    ("router/orchestrator.py", "orchestrator"),
    ("router/worker_calls.py", "orchestrator (worker calls)"),
    ("benchmarks/sim_cluster.py", "simulated actor handles (Ray's driver-side part)"),
    ("router/convert.py", "protobuf responses"),
    ("router/generation.py", "request path (generation core)"),
    ("router/server.py", "gRPC handler"),
    ("grpc", "grpc.aio (C core, writes, reads)"),
    ("asyncio", "asyncio event loop"),
)


def _area(frames: list[str]) -> str:
    for frame in reversed(frames[1:]):
        for marker, area in AREAS:
            if marker in frame:
                return area
    return "other"


# ---------------------------------------------------------------- the report


def _loop_name(kind: str) -> str:
    from router import event_loop

    chosen = event_loop.resolve(kind)
    if chosen is event_loop.LoopKind.UVLOOP:
        import uvloop

        return f"uvloop {uvloop.__version__}"
    return "asyncio"


def header(args, speed) -> list[str]:
    import grpc

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    a, b, c = speed.model.coefficients()
    return [
        f"bench_router_scale  {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"machine: {platform.node()}, {os.cpu_count()} cores ({cpu}), load avg at start {load}",
        f"python {platform.python_version()}, grpc {grpc.__version__}, router loop {_loop_name(args.event_loop)}",
        f"cluster: the real router (launcher's Cluster.start: admission with SLO targets, conditional disaggregation,"
        f" supervisor, metrics, grpc.aio) over {args.prefill} prefill + {args.decode} decode SIMULATED workers"
        f" (benchmarks/sim_workers.py, their own thread)",
        f"step model: fitted to {args.steps.name} (real SmolLM2 engine steps), durations / {args.time_scale:.3g}"
        f"{f' (decode step at batch 64, KV 21,062 = {args.anchor_ms:g} ms)' if args.anchor_ms else ''}:"
        f" decode step = {a * 1e3:.2f} ms + {b * 1e3:.3f} ms x seqs + {c * 1e6:.3f} us x KV tokens;"
        f" prefill {speed.prefill_s_per_token * 1e6:.1f} us/token",
        f"load: {args.streams} concurrent streams (closed loop, ramp {args.ramp_s:g} s, warm-up {args.warmup_s:g} s,"
        f" measured {args.measure_s:g} s) x ({args.prompt_len} prompt + {args.max_tokens} output tokens),"
        f" {args.channels} gRPC channels from a separate client process; router --stream-interval {args.stream_interval}"
        f"{'; start-up heap NOT frozen (--no-gc-freeze)' if args.no_gc_freeze else '; start-up heap frozen (as serve does)'}"
        f"{'; Python default GC thresholds (--gc-default-thresholds)' if args.gc_default_thresholds or args.no_gc_freeze else '; GC generation 0 every 50,000 allocations (as serve does)'}",
    ]


def report(args, speed, run: dict, queued: dict[int, dict]) -> str:
    w, res = run["window"], run["client"]
    bins = {int(k): v for k, v in res["bins"].items()}
    tokens = sum(v for k, v in bins.items() if w.t0 <= k * BIN_S and (k + 1) * BIN_S <= w.t1)
    span = (int(w.t1 / BIN_S) - int(w.t0 / BIN_S) - 1) * BIN_S   # whole bins inside the window
    rate = tokens / span if span > 0 else float("nan")
    per_token_us = w.router_cpu_s / (rate * (w.t1 - w.t0)) * 1e6 if tokens else float("nan")
    loop_us = w.loop_cpu_s / (rate * (w.t1 - w.t0)) * 1e6 if tokens else float("nan")
    wall, cpu, with_gc = run["decisions"]
    no_gc = [c for c, g in zip(cpu, with_gc) if not g]
    gcs = collections.Counter(g for g, _ in run["gc"])
    gc2 = [d for g, d in run["gc"] if g == 2]
    ttft_ms, tpot_ms = run["targets"]
    lines = header(args, speed) + [
        f"SLO targets sent with every request: TTFT {ttft_ms:.0f} ms, TPOT {tpot_ms:.0f} ms",
        "",
        "the run",
        f"  streams finished / refused by admission / errors / wrong token counts: {res['finished']:,} / "
        f"{res['rejected']:,} / {res['errors']} / {res['wrong_tokens']}"
        + (f"  {res['error_samples']}" if res["errors"] else ""),
        f"  tokens/s streamed in the window: {rate:,.0f} ({res['messages']:,} messages over the run,"
        f" {sum(bins.values()) / max(1, res['messages']):.2f} tokens/message)",
        f"  TTFT p50 / p99 (ms, client): {pct(res['ttft_s'], .5) * 1e3:.0f} / {pct(res['ttft_s'], .99) * 1e3:.0f};"
        f" p50 from the router's handler (its TTFT histogram, whole run): {run['router_ttft_p50_s'] * 1e3:.0f} ms",
        f"  Generate calls the router's handlers held in the window, mean / max: {statistics.fmean(run['live'] or [0]):,.0f} /"
        f" {max(run['live'], default=0):,} of {args.streams:,} open streams (the others wait in gRPC core until grpc.aio's"
        f" server accepts them: one call at a time, as its event loop gets round to it)",
        f"  decode steps (all workers): {run['steps']['steps']:,}; recent batch mean {run['steps']['batch_mean']:.0f}"
        f" seqs, step {run['steps']['step_ms_mean']:.0f} ms",
        f"  admission queue, max seen in the window: {run['queued_max']}",
        f"  client process CPU: {res['client_cpu_s']:.1f} s",
        f"  leak check after the run: {'none' if not run['leaks'] else run['leaks']}",
        f"  router loop lag in the window (a 10 ms sleep wakes late by) p50 / p99 / max:"
        f" {pct(run['lags'], .5) * 1e3:.1f} / {pct(run['lags'], .99) * 1e3:.1f} / {max(run['lags'], default=0) * 1e3:.1f} ms",
        f"  router process stopped or starved over 0.5 s: {len(run['stalls'])} times, longest"
        f" {max(run['stalls'], default=0):.1f} s" + ("  (RUN NOT VALID: it measured the pauses)" if max(run['stalls'], default=0) > 2 else ""),
        "",
        "targets",
        f"  ADMISSION DECISION p50 / p99 / max (ms, wall): {pct(wall, .5) * 1e3:.3f} / {pct(wall, .99) * 1e3:.3f} /"
        f" {max(wall, default=float('nan')) * 1e3:.3f}  over {len(wall):,} decisions (ramp, warm-up and window)   target p99 <= 1 ms:"
        f" {'MET' if pct(wall, .99) <= 1e-3 else 'MISSED'}",
        f"    same, thread CPU time: {pct(cpu, .5) * 1e3:.3f} / {pct(cpu, .99) * 1e3:.3f} ms; {sum(with_gc)} decisions had a"
        f" garbage collection inside, the others' thread CPU p99 {pct(no_gc, .99) * 1e3:.3f} ms",
        f"    garbage collections in the window (gen 0 / 1 / 2): {gcs[0]} / {gcs[1]} / {gcs[2]}; gen 2 pauses max"
        f" {max(gc2, default=0) * 1e3:.0f} ms, all {sum(d for _, d in run['gc']) * 1e3:.0f} ms (thread CPU)",
        f"  ROUTER CPU PER STREAMED TOKEN: {per_token_us:.1f} us  (process {w.process_cpu_s:.2f} s - simulated workers'"
        f" thread {w.sim_cpu_s:.2f} s = {w.router_cpu_s:.2f} s over {w.t1 - w.t0:.1f} s, {w.router_cpu_s / (w.t1 - w.t0):.0%}"
        f" of a core)   target <= 20 us: {'MET' if per_token_us <= 20 else 'MISSED'}",
        f"    of which the router's event loop thread: {loop_us:.1f} us/token",
    ]
    lines += queued_lines(args, queued) if queued else []
    if run["profile"]:
        lines += ["", *profile_lines(run["profile"])]
    return "\n".join(lines) + "\n"


def queued_lines(args, queued: dict[int, dict]) -> list[str]:
    lines = ["  PER-REPORT COST vs QUEUED REQUESTS (the launcher's handler of one report of a decode worker that stays full; "
              f"{args.report_rounds} alternating rounds of {args.reports_per_round} reports, median of rounds):"]
    med = {n: statistics.median(q["cpu_us"]) for n, q in queued.items()}
    for n, q in queued.items():
        lines.append(f"    {n:>5} queued: {med[n]:.1f} us CPU per report, {statistics.fmean(q['decisions']):.1f}"
                     f" decisions per report  (rounds: {', '.join(f'{x:.0f}' for x in q['cpu_us'])})")
    for n, q in queued.items():
        lines.append(f"    {n:>5} queued, per wake naming no worker (a worker back up: every woken request decides):"
                     f" {statistics.median(q['finish_cpu_us']):.1f} us CPU, {statistics.fmean(q['finish_decisions']):.1f}"
                     f" decisions (each {statistics.median(q['decision_us']):.0f} us thread CPU, median)")
    small, large = QUEUED_SIZES
    ratio = med[large] / med[small]
    flat = statistics.fmean(queued[large]["decisions"]) <= statistics.fmean(queued[small]["decisions"])
    lines.append(f"    {large} vs {small} queued: {ratio:.2f}x CPU, decisions per report "
                 f"{'equal' if flat else 'GROW'}   target: no growth: {'MET' if flat and ratio < 1.5 else 'MISSED'}")
    return lines


def profile_lines(profile: dict) -> list[str]:
    if "error" in profile:
        return [f"profile: py-spy failed: {profile['error']}"]
    total = max(1, profile["loop_total"])
    lines = ["profile (py-spy, 200 Hz, separate run; samples of the router's loop thread 'pdserve-cluster')",
             "  samples per thread: " + ", ".join(f"{t.split(': ')[-1]} {n}" for t, n in profile["threads"]),
             "  where the loop thread's time goes (innermost router/library area of each sample):"]
    lines += [f"    {n / total:6.1%}  {area}" for area, n in profile["areas"]]
    lines += ["  top functions by self time:"]
    lines += [f"    {n / total:6.1%}  {fn}" for fn, n in profile["self"][:20]]
    return lines


def main() -> None:
    from benchmarks.step_timings import DEFAULT_PATH

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prefill", type=int, default=16)
    p.add_argument("--decode", type=int, default=48)
    p.add_argument("--streams", type=int, default=5000)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--stream-interval", type=int, default=1,
                   help="the router's --stream-interval: tokens per stream message (1: every token as it comes)")
    p.add_argument("--ramp-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=15.0)
    p.add_argument("--measure-s", type=float, default=30.0)
    p.add_argument("--ttft-ms", type=float, default=None)
    p.add_argument("--tpot-ms", type=float, default=None)
    p.add_argument("--steps", type=Path, default=DEFAULT_PATH, help="real step timings to fit (step_timings.py)")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide every step time by this (no --anchor-ms)")
    p.add_argument("--anchor-ms", type=float, default=298.0,
                   help="scale the steps so a decode step at batch 64, KV 21,062 takes this (results/engine_w64.txt:"
                        " 298 ms, SmolLM2 fp32 on this VM quiet; the H100's was 27.24); 0: use --time-scale")
    p.add_argument("--report-rounds", type=int, default=5)
    p.add_argument("--reports-per-round", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="py-spy the window (slows the router: separate run)")
    p.add_argument("--profile-out", type=Path, default=None)
    p.add_argument("--profile-native", action="store_true", help="with --profile: C frames too (slower still)")
    p.add_argument("--skip-report-cost", action="store_true")
    p.add_argument("--report-cost-only", action="store_true", help="the per-report section alone, printed")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave start-up's heap in the collector's scans and Python's GC thresholds (router/gc_policy.py)")
    p.add_argument("--gc-default-thresholds", action="store_true",
                   help="freeze start-up's heap but keep Python's GC thresholds (700, 10, 10): the A/B of router/gc_policy.py")
    p.add_argument("--event-loop", default="auto", choices=("auto", "uvloop", "asyncio"),
                   help="the router's loop (router/event_loop.py; auto: uvloop when installed): the A/B of uvloop")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.prefill, args.decode, args.streams = 4, 8, 400
        args.ramp_s, args.warmup_s, args.measure_s, args.report_rounds, args.reports_per_round = 3, 2, 5, 2, 50
    out = args.out or (None if args.quick else ROOT / "benchmarks" / "results" / "router_scale.txt")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    speed = speed_from(args)
    queued = {} if args.skip_report_cost else report_cost(speed, args)
    if args.report_cost_only:
        sys.stdout.write("\n".join(header(args, speed)[:2] + queued_lines(args, queued)) + "\n")
        return
    run = measure(args, speed, {})
    text = report(args, speed, run, queued)
    sys.stdout.write(text)
    if out is not None:
        write_run(out, text)


if __name__ == "__main__":
    main()
