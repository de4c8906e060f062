"""Chaos benchmark: Poisson load on a live cluster while its workers are killed with SIGKILL.

What it does (one run, one cluster, defaults in brackets):
  - starts pdserve (``--workers`` prefill,decode [1,1], the embedded SmolLM2-135M; ``--quick``: a tiny
    random model) and sends seeded requests (dataset ``random``: prompt ``--input-len`` [192]
    and output ``--output-len`` [48] tokens, +-50%, EOS ignored, greedy; ``--shared-prefix N``: each
    prompt opens with one of 4 shared N-token prefixes) as Poisson arrivals at
    ``--rate`` req/s [0.6, ~70% of this machine's capacity at the goodput benchmark's SLO; ``--guided
    REGEX``: every output held to that regular expression, a structured output] for
    ``--duration`` seconds [330], through SLO admission as a deployment runs (``--no-admission``:
    everything admitted);
  - every ``--kill-every`` seconds [60] it sends SIGKILL to a worker's process, alternating decode
    and prefill (decode first), round the workers (decode-0, prefill-0, decode-1, ...);
    ``--freeze``: SIGSTOP instead, and the process is left stopped (a hung worker: the router's
    stall watch, ``--stall-timeout`` seconds [60], must kill and replace it);
  - records, per request: submitted / completed / failed (and the gRPC status) / refused by
    admission at arrival (load shedding, not a lost request), TTFT, TPOT,
    migrations; per kill: time to the replacement being ready and to the first token the
    replacement served; TTFT/TPOT p50/p99 inside recovery windows (kill -> ready + 5 s) and
    outside them; goodput (requests meeting ``--slo`` TTFT,TPOT ms [6400,390]: the goodput
    benchmark's run-7 SLO) per 30 s bucket; whether every completed request's tokens equal the
    in-process engine's greedy output on the same model (migrated ones included);
  - ends with the leak check (every block free, no request left) and /dev/shm: only the live
    workers' KV pools, no stale segment.
Writes the report to ``--out`` [benchmarks/results/chaos.txt] and prints it.

  python benchmarks/bench_chaos.py                # ~7 min on a 2-core machine
  python benchmarks/bench_chaos.py --quick --duration 90 --kill-every 30
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import itertools
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_file import write_run  # noqa: E402

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import grpc  # noqa: E402

from deploy.bench.dataset import arrival_offsets, make_requests  # noqa: E402
from deploy.launcher import ClusterConfig, ClusterThread, holds_anything  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from protos import pdserve_pb2 as pb  # noqa: E402
from router.client import AsyncPdserveClient  # noqa: E402

RECOVERY_TAIL_S = 5.0   # a recovery window lasts from the kill until 5 s after the replacement is ready


@dataclass(slots=True)
class Outcome:
    sent_s: float
    ok: bool = False
    status: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    end_s: float | None = None
    migrations: int = 0
    prompt: tuple[int, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    decode_worker: str = ""
    prefill_worker: str = ""
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Kill:
    at_s: float
    worker_id: str
    generation: int
    pid: int
    ready_s: float | None = None
    first_token_s: float | None = None


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.6)
    p.add_argument("--duration", type=float, default=330.0)
    p.add_argument("--kill-every", type=float, default=60.0)
    p.add_argument("--input-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--slo", default="6400,390", help="TTFT,TPOT targets in ms for the goodput figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny random model (no SmolLM2)")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every prompt opens with one of 4 shared N-token prefixes (prefix caching under kills)")
    p.add_argument("--mode", default="disaggregated", choices=("disaggregated", "colocated"),
                   help="colocated: --workers' decode count of colocated workers (no prefill worker)")
    p.add_argument("--workers", default="1,1", help="prefill,decode workers; kills go round them (decode-0, "
                   "prefill-0, decode-1, prefill-1, ...)")
    p.add_argument("--guided", default=None, metavar="REGEX",
                   help="every request's output held to this regular expression (structured output; SmolLM2 only)")
    p.add_argument("--no-admission", action="store_true",
                   help="admit everything (default: SLO admission at --slo, as a deployment runs)")
    p.add_argument("--freeze", action="store_true", help="SIGSTOP the worker and leave it stopped (a hung worker)")
    p.add_argument("--stall-timeout", type=float, default=60.0, help="the cluster's --worker-stall-timeout")
    p.add_argument("--out", default="benchmarks/results/chaos.txt")
    args = p.parse_args()
    if args.guided and args.quick:
        p.error("--guided needs a model with a tokenizer (the tiny random model has none)")
    return args


def start(args) -> ClusterThread:
    num_prefill, num_decode = (int(n) for n in args.workers.split(","))
    if args.mode == "colocated":
        num_prefill = 0
    config = ClusterConfig(mode=args.mode, num_prefill=num_prefill, num_decode=num_decode,
                           cpus_per_worker=2.0 / (num_prefill + num_decode), threads_per_worker=1,
                           random_model={"seed": 0} if args.quick else None, port=0,
                           prefill_engine=EngineConfig(max_num_batched_tokens=512, num_kv_blocks=1024),
                           decode_engine=EngineConfig(max_num_batched_tokens=512, num_kv_blocks=1024),
                           admission=not args.no_admission, worker_stall_timeout_s=args.stall_timeout,
                           defaults=dict(zip(("ttft_s", "tpot_s"), (float(x) / 1e3 for x in args.slo.split(",")))))
    cluster = ClusterThread(config)
    cluster.start()
    return cluster


async def one_request(client, req, out: Outcome, t0: float, guided: str | None) -> None:
    try:
        async for msg in client.generate(token_ids=req.prompt_token_ids, max_tokens=req.output_len, ignore_eos=True,
                                         structured_output=pb.StructuredOutput(regex=guided) if guided else None):
            now = time.monotonic() - t0
            out.token_times.extend([now] * len(msg.token_ids))
            out.token_ids.extend(msg.token_ids)
            if msg.HasField("timings"):
                out.migrations = msg.timings.migrations
                out.decode_worker, out.prefill_worker = msg.timings.decode_worker_id, msg.timings.prefill_worker_id
        out.ok = True
    except grpc.aio.AioRpcError as exc:
        out.status = f"{exc.code().name}: {exc.details()[:160]}"
    times = out.token_times
    out.end_s = times[-1] if times else None
    if times:
        out.ttft_s = times[0] - out.sent_s
        out.tpot_s = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0


async def drive(args, cluster: ClusterThread, outcomes: list[Outcome], kills: list[Kill], t0: float) -> None:
    num = int(args.rate * args.duration) + 1
    vocab = (3, 500) if args.quick else (1000, 40000)
    requests = make_requests("random", num, args.input_len, args.output_len, range_ratio=0.5, seed=args.seed,
                             vocab=vocab)
    if args.shared_prefix:   # 4 system prompts, each request opening with one: prefix-cache hits on every worker
        rng = random.Random(args.seed)
        prefixes = [[rng.randrange(*vocab) for _ in range(args.shared_prefix)] for _ in range(4)]
        for i, req in enumerate(requests):
            req.prompt_token_ids[:0] = prefixes[i % 4]
    offsets = [o for o in arrival_offsets(num, args.rate, seed=args.seed) if o < args.duration]
    killer = threading.Thread(target=kill_loop, args=(args, cluster, kills, t0), daemon=True)
    killer.start()
    async with AsyncPdserveClient(f"127.0.0.1:{cluster.cluster.port}", timeout_s=600) as client:
        tasks = []
        for req, offset in zip(requests, offsets):
            await asyncio.sleep(max(0.0, offset - (time.monotonic() - t0)))
            out = Outcome(sent_s=time.monotonic() - t0, prompt=tuple(req.prompt_token_ids))
            outcomes.append(out)
            tasks.append(asyncio.create_task(one_request(client, req, out, t0, args.guided)))
        await asyncio.gather(*tasks)
    killer.join()


def kill_loop(args, cluster: ClusterThread, kills: list[Kill], t0: float) -> None:
    """Kills (SIGKILL, or SIGSTOP with --freeze) the workers in turn, decode and prefill alternately;
    waits for each replacement."""
    registry = cluster.cluster.registry
    decoding = [w.worker_id for w in registry.all if w.role != "prefill"]
    prefilling = [w.worker_id for w in registry.all if w.role == "prefill"]
    roles = [w for pair in itertools.zip_longest(decoding, prefilling) for w in pair if w is not None]
    at = args.kill_every
    while at < args.duration:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        worker = registry.get(roles[len(kills) % len(roles)])
        kill = Kill(time.monotonic() - t0, worker.worker_id, worker.generation, worker.pid)
        os.kill(worker.pid, signal.SIGSTOP if args.freeze else signal.SIGKILL)
        kills.append(kill)
        while not (worker.alive and worker.generation > kill.generation):
            time.sleep(0.02)
        kill.ready_s = time.monotonic() - t0
        logging.warning("killed %s at %.1f s, replacement ready %.1f s later", worker.worker_id, kill.at_s,
                        kill.ready_s - kill.at_s)
        at += args.kill_every


def _overlaps(o: Outcome, start: float, end: float) -> bool:
    """The request was in flight at some point of [start, end]."""
    return o.sent_s <= end and (o.end_s or o.sent_s) >= start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def mismatches(args, outcomes: list[Outcome]) -> list[Outcome]:
    """The completed requests whose tokens differ from the in-process engine's greedy output on the
    same model (the engine equals HF's generate: tests), a kill or a migration notwithstanding."""
    from engine.engine import LLMEngine
    from engine.model_loader import load_model, random_model
    from engine.types import GuideKind, RequestSpec, SamplingParams, StructuredOutput

    done = [o for o in outcomes if o.ok]
    engine = LLMEngine(random_model(seed=0) if args.quick else load_model(None))
    guide = StructuredOutput(GuideKind.REGEX, args.guided) if args.guided else None
    specs = [RequestSpec(f"ref{i}", o.prompt, SamplingParams(max_tokens=len(o.token_ids), ignore_eos=True,
                                                             structured_output=guide))
             for i, o in enumerate(done)]
    reference = engine.generate(specs)
    return [o for i, o in enumerate(done) if reference[f"ref{i}"] != o.token_ids]


def report(args, outcomes: list[Outcome], kills: list[Kill], leaks: dict, stale: list[str], wall_s: float,
           wrong: list[Outcome]) -> str:
    ttft_t, tpot_t = (float(x) / 1e3 for x in args.slo.split(","))
    windows = [(k.at_s, (k.ready_s or k.at_s) + RECOVERY_TAIL_S) for k in kills]
    for k in kills:   # the first token the replacement served: a request it finished, tokens after ready
        served = [t for o in outcomes if k.worker_id in (o.decode_worker, o.prefill_worker)
                  for t in o.token_times if k.ready_s is not None and t >= k.ready_s]
        k.first_token_s = min(served) if served else None
    done = [o for o in outcomes if o.ok]
    # Refused at arrival by admission (no token sent): load shedding, not a lost request.
    rejected = [o for o in outcomes if not o.ok and not o.token_times and o.status.startswith("RESOURCE_EXHAUSTED")]
    failed = [o for o in outcomes if not o.ok and o not in rejected]
    inside = [o for o in done if any(_overlaps(o, a, b) for a, b in windows)]
    outside = [o for o in done if o not in inside]
    met = [o for o in done if o.ttft_s <= ttft_t and o.tpot_s <= tpot_t]
    shared = f" after one of 4 shared {args.shared_prefix}-token prefixes" if args.shared_prefix else ""
    shared += f", every output held to the regex {args.guided!r}" if args.guided else ""
    num_prefill, num_decode = args.workers.split(",")
    workers = f"{num_prefill} prefill + {num_decode} decode" if args.mode == "disaggregated" else f"{num_decode} colocated"
    lines = [
        f"# bench_chaos: {'tiny random model' if args.quick else 'SmolLM2-135M-Instruct'}, "
        f"{workers} worker(s) "
        f"(2 CPUs shared, 1 thread each), Poisson {args.rate} req/s for {args.duration:.0f} s, prompt {args.input_len} / "
        f"output {args.output_len} tokens +-50%{shared}, "
        + (f"SIGSTOP (left stopped; stall timeout {args.stall_timeout:.0f} s)" if args.freeze else "SIGKILL")
        + f" every {args.kill_every:.0f} s (decode, prefill, ...)",
        f"# date {time.strftime('%Y-%m-%d %H:%M')}, wall {wall_s:.0f} s, SLO TTFT <= {ttft_t * 1e3:.0f} ms, "
        f"TPOT <= {tpot_t * 1e3:.0f} ms, admission {'off' if args.no_admission else 'on'}, "
        f"load average at start {args.load_at_start:.1f}",
        "",
        f"requests: submitted {len(outcomes)}, completed {len(done)}, failed {len(failed)}, rejected by admission "
        f"at arrival {len(rejected)}, migrated {sum(1 for o in done if o.migrations)} "
        f"(migrations {sum(o.migrations for o in done)})",
        f"tokens of the completed requests equal to the in-process engine's greedy output on the same model: "
        f"{len(done) - len(wrong)} of {len(done)}"
        + "".join(f"; DIFFERENT: sent at {o.sent_s:.1f} s, {o.migrations} migration(s)" for o in wrong[:5]),
    ]
    lines += [f"  failed: {o.status}" for o in failed[:10]]
    lines += ["", "kills:  worker      at (s)  ready after (s)  first token by the replacement after (s)"]
    for k in kills:
        ready = f"{k.ready_s - k.at_s:.2f}" if k.ready_s else "never"
        first = f"{k.first_token_s - k.at_s:.2f}" if k.first_token_s else "-"
        lines.append(f"        {k.worker_id:<10} {k.at_s:7.1f}  {ready:>15}  {first:>40}")
    recov = [k.ready_s - k.at_s for k in kills if k.ready_s]
    lines.append(f"recovery (kill -> replacement ready): max {max(recov):.2f} s, mean {statistics.mean(recov):.2f} s"
                 if recov else "recovery: no kill")
    lines += ["", "latency            n    TTFT p50   TTFT p99   TPOT p50   TPOT p99"]
    for name, group in (("outside recovery", outside), ("inside recovery", inside), ("all", done)):
        t1, t2 = [o.ttft_s for o in group], [o.tpot_s for o in group]
        lines.append(f"{name:<17}{len(group):4d} {pct(t1, 50):9.2f}s {pct(t1, 99):9.2f}s "
                     f"{pct(t2, 50) * 1e3:8.1f}ms {pct(t2, 99) * 1e3:8.1f}ms")
    lines += ["", f"goodput (met SLO / s) per 30 s bucket of arrival; overall {len(met) / max(1.0, args.duration):.3f} req/s"]
    bucket = 30.0
    for b in range(int(args.duration // bucket) + 1):
        lo, hi = b * bucket, (b + 1) * bucket
        sent = [o for o in outcomes if lo <= o.sent_s < hi]
        if not sent:
            continue
        good = [o for o in sent if o in met]
        mark = " <- kill" if any(lo <= k.at_s < hi for k in kills) else ""
        lines.append(f"  {lo:5.0f}-{hi:<5.0f} s  sent {len(sent):3d}  met {len(good):3d}  goodput "
                     f"{len(good) / bucket:.3f}{mark}")
    lines += ["", f"leak check: {'clean' if not leaks else leaks}",
              f"/dev/shm: {'no stale pdserve segment' if not stale else 'STALE: ' + ', '.join(stale)}"]
    return "\n".join(lines) + "\n"


def _owner(path: str) -> int | None:
    """A KV pool file is named /dev/shm/pdserve-<owner pid>-<worker>-<id>.kv."""
    try:
        return int(Path(path).name.split("-")[1])
    except (ValueError, IndexError):
        return None


def _owner_alive(path: str) -> bool:
    try:
        os.kill(_owner(path), 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse()
    args.load_at_start = os.getloadavg()[0]   # the machine may be shared: say how busy it was
    cluster = start(args)
    outcomes: list[Outcome] = []
    kills: list[Kill] = []
    t0 = time.monotonic()
    try:
        asyncio.run(drive(args, cluster, outcomes, kills, t0))
        wall = time.monotonic() - t0
        time.sleep(2.0)   # aborts and releases land
        leaks = {w: r for w, r in cluster.run(cluster.cluster.leak_reports()).items() if holds_anything(r)}
        # This run's pools only (other clusters may share the machine): owners it killed or runs.
        pids = {k.pid for k in kills} | {w.pid for w in cluster.cluster.registry.all}
        stale = [p for p in glob.glob("/dev/shm/pdserve-*.kv") if _owner(p) in pids and not _owner_alive(p)]
    finally:
        cluster.stop()
    text = report(args, outcomes, kills, leaks, stale, wall, mismatches(args, outcomes))
    write_run(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
