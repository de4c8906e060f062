"""Tracing on vs off as a deployment runs it, for ``bench_http.py``: two ``pdserve serve``
processes side by side on this machine, ``off`` without tracing and ``on`` with
``--otlp-traces-endpoint`` pointed at a local ``OtlpSinkProcess`` (the OTLP exporter behind a
``BatchSpanProcessor`` in the router and in every worker); the same load (N concurrent gRPC
streams, token-id prompts, ``ignore_eos``) alternates between them round by round, so the
machine's drift (a shared 2-core box) hits both alike.

Per round: the streams' median TPOT, and the CPU seconds the cluster's router and worker
processes (not Ray's own services) spent, per request. The verdict compares the medians over
rounds and the median of the paired ratios (each ``on`` round against the ``off`` round just
before it).

A server instance has a speed of its own (measured: one pair's arms differed by 7-12 % in TPOT
with tracing on in neither's favour, the sign flipping between runs: page placement, which
core each process lands on), so the rounds are spread over ``pairs`` fresh pairs of servers,
started in swapped order, and the per-pair ratios are printed beside the pooled verdict.

Life cycle: ``run(model, quick)`` starts the sink; per pair, starts both servers, waits for
their ready lines, warms each, runs the rounds, stops both (SIGTERM: a graceful stop, then the
session is killed if anything is left); returns the result lines.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.otlp_sink import OtlpSinkProcess
from router.client import AsyncPdserveClient

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"pdserve ready: gRPC on ([\d.]+):(\d+)")
START_TIMEOUT_S = 600
WORKER_TITLES = ("ray::PrefillActor", "ray::DecodeActor")


@dataclass(frozen=True)
class Load:
    streams: int
    max_tokens: int
    prompt_len: int
    rounds: int          # per arm and pair of servers
    pairs: int           # fresh pairs of servers: a server instance's own speed is not the arm's
    id_range: tuple[int, int]


MODELS = {   # serve flags, the load
    "smollm2": (["--kv-cache-gib", "0.5"], Load(64, 32, 32, 4, 3, (1000, 40000))),
    "tiny": (["--random-model", "--kv-cache-gib", "0.1"], Load(64, 64, 32, 4, 3, (3, 500))),
}
QUICK = {"smollm2": Load(8, 8, 16, 1, 1, (1000, 40000)), "tiny": Load(8, 8, 16, 1, 1, (3, 500))}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Server:
    """One ``pdserve serve`` in its own session (every Ray process it starts stays in it)."""

    def __init__(self, name: str, flags: list[str]) -> None:
        self.name = name
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--port", "0", "--http-port", "0", "--metrics-port", "0",
               "--cpus-per-worker", "0.5", "--threads-per-worker", "1", "--no-standby", "--no-admission", *flags]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.output: list[str] = []
        self._ready = threading.Event()
        self.address: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            m = READY.search(line)
            if m:
                self.address = f"{m.group(1)}:{m.group(2)}"
                self._ready.set()
        self._ready.set()

    def wait_ready(self) -> str:
        if not self._ready.wait(START_TIMEOUT_S) or self.address is None:
            raise RuntimeError(f"{self.name} did not start (rc {self.proc.poll()}):\n{''.join(self.output[-40:])}")
        return self.address

    def serving_processes(self) -> list[psutil.Process]:
        """The router (the CLI process) and its worker actors (titled ``ray::PrefillActor`` /
        ``ray::DecodeActor``; not Ray's own agents, whose titles start ``ray::`` too)."""
        out = [psutil.Process(self.proc.pid)]
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                title = " ".join(p.cmdline()[:1]) or p.name()
                if title.startswith(WORKER_TITLES):
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def cpu_s(self) -> float:
        total = 0.0
        for p in self.serving_processes():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # whatever of the session is left
        except ProcessLookupError:
            pass
        self.proc.wait(30)


async def _one(client: AsyncPdserveClient, prompt: list[int], max_tokens: int) -> list[float]:
    times: list[float] = []
    async for resp in client.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True):
        times.extend([time.perf_counter()] * len(resp.token_ids))
    return times


def _tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


async def _round(address: str, load: Load, seed: int) -> list[list[float]]:
    lo, hi = load.id_range
    prompts = [[lo + (seed * 7919 + i * 131 + j * 17) % (hi - lo) for j in range(load.prompt_len)]
               for i in range(load.streams)]
    async with AsyncPdserveClient(address, timeout_s=600) as client:
        return await asyncio.gather(*(_one(client, p, load.max_tokens) for p in prompts))


def _measure(server: Server, load: Load, seed: int) -> dict:
    cpu = server.cpu_s()
    try:
        results = asyncio.run(_round(server.address, load, seed))
    except Exception:
        print(f"{server.name}'s output:\n{''.join(server.output[-60:])}", file=sys.stderr)
        raise
    cpu = server.cpu_s() - cpu
    return {"tpot_ms": 1e3 * statistics.median(_tpot(t) for t in results),
            "cpu_ms_per_request": 1e3 * cpu / load.streams}


def run(model: str, quick: bool) -> list[str]:
    flags, load = MODELS[model]
    load = QUICK[model] if quick else load
    sink = OtlpSinkProcess()   # its own process: it must not share the client's GIL
    arm_flags = {"off": flags, "on": [*flags, "--otlp-traces-endpoint", sink.url]}
    lines = [f"tracing on vs off, {model}: two `pdserve serve` (disaggregated, 1+1 workers, 1 thread each) side by "
             f"side, on: --otlp-traces-endpoint to a local OTLP sink; {load.streams} gRPC streams x {load.max_tokens} "
             f"tokens ({load.prompt_len}-token prompts) per round; {load.pairs} fresh pairs of servers (started in "
             f"swapped order) x {load.rounds} rounds each per arm, alternating ABBA; "
             f"load average at start {load_average()}"]
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    per_pair: list[float] = []
    try:
        for pair in range(load.pairs):
            start_order = ("off", "on") if pair % 2 == 0 else ("on", "off")
            got = _run_pair({arm: arm_flags[arm] for arm in start_order}, load, seed=pair * 1000)
            for arm in rounds:
                rounds[arm] += got[arm]
            per_pair.append(_paired(got))
        time.sleep(6)   # the batch processors' schedule delay (5 s): the last spans reach the sink
        lines += _verdict(rounds, sink, load)
        lines.append("  paired on/off TPOT ratio median per pair of servers: "
                     + " ".join(f"{100 * (r - 1):+.1f} %" for r in per_pair)
                     + " (the spread between pairs is what a server instance alone moves TPOT by)")
    finally:
        sink.close()
    lines.append(f"load average at the end: {load_average()}")
    return lines


def _run_pair(arm_flags: dict[str, list[str]], load: Load, seed: int) -> dict[str, list[dict]]:
    """One pair of fresh servers (started in ``arm_flags``' order): warm-up, then ``load.rounds``
    rounds per arm, ABBA, so neither always goes first."""
    servers = {arm: Server(arm, flags) for arm, flags in arm_flags.items()}
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for server in servers.values():
            server.wait_ready()
        for server in servers.values():   # warm-up: first-call costs (imports, buffers) out of the rounds
            _measure(server, load, seed=10_000 + seed)
        for i in range(load.rounds):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for arm in order:
                rounds[arm].append(_measure(servers[arm], load, seed=seed + i))
    finally:
        for server in servers.values():
            server.stop()
    return rounds


def _paired(rounds: dict[str, list[dict]]) -> float:
    """Median of on/off TPOT over the rounds paired in order."""
    return statistics.median(on["tpot_ms"] / off["tpot_ms"] for on, off in zip(rounds["on"], rounds["off"]))


def _verdict(rounds: dict[str, list[dict]], sink: OtlpSinkProcess, load: Load) -> list[str]:
    lines = []
    for arm in ("off", "on"):
        lines.append(f"  {arm:3}: TPOT p50 per round (ms) " + " ".join(f"{r['tpot_ms']:.1f}" for r in rounds[arm])
                     + "; router+workers CPU per request (ms) "
                     + " ".join(f"{r['cpu_ms_per_request']:.0f}" for r in rounds[arm]))
    t_off = statistics.median(r["tpot_ms"] for r in rounds["off"])
    t_on = statistics.median(r["tpot_ms"] for r in rounds["on"])
    paired = _paired(rounds)
    c_off = statistics.median(r["cpu_ms_per_request"] for r in rounds["off"])
    c_on = statistics.median(r["cpu_ms_per_request"] for r in rounds["on"])
    change = 100 * (t_on / t_off - 1)
    lines.append(f"  TPOT off {t_off:.2f} ms, on {t_on:.2f} ms ({change:+.1f} %; paired on/off ratio median "
                 f"{100 * (paired - 1):+.1f} %), target <= +2 %: {'PASS' if max(change, 100 * (paired - 1)) <= 2 else 'MISS'}")
    lines.append(f"  CPU per request (router + both workers): off {c_off:.0f} ms, on {c_on:.0f} ms "
                 f"({c_on - c_off:+.1f} ms = {(c_on - c_off) / load.max_tokens:+.2f} ms per output token, "
                 f"{100 * (c_on - c_off) / load.max_tokens / t_off:+.1f} % of TPOT)")
    by_service: dict[str, int] = {}
    for (service, _), n in sink.counts().items():
        by_service[service] = by_service.get(service, 0) + n
    traces = sink.traces()
    whole = sum(1 for services in traces.values() if len(services) == 3)
    lines.append(f"  sink: {sink.num_spans} spans in {sink.requests} OTLP exports, by service {by_service}; "
                 f"{len(traces)} traces, {whole} with spans from router, prefill and decode worker")
    return lines
