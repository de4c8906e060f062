"""Streaming capacity of one router: many concurrent Generate streams, and the router's CPU per token.

Workload: ``--streams`` (256) concurrent streams, each a prompt of ``--prompt-len`` (16) seeded
random token ids and ``--max-tokens`` (64) output tokens, greedy, EOS ignored, all started at
once, through one router (``--channels`` gRPC channels, 1 by default) on the tiny random Llama
by default (``--model smollm2`` for the real one): the point is the router's and the stream's
capacity, not the model's speed, and the tiny model keeps a 256-sequence decode step at
milliseconds. Two clusters in turn (``--modes``), one column each: disaggregated (1 prefill +
1 decode worker; every request's KV is handed over) and colocated (1 worker, no hand-off, so
the router and its streams are all that stands between the client and the decode loop). The
decode worker runs with ``max_num_seqs`` = streams and a KV pool sized to hold every stream at
once; the prefill budget fits every prompt in one step.

How the router's CPU is isolated: the router (grpc.aio server, orchestrator, the per-worker
decode stream demux, and Ray's driver-side core worker that carries its actor calls) runs in
this process via ``ClusterThread``; the CLIENT runs in a separate process started with
``multiprocessing``'s spawn method (no fork after ``ray.init``). So ``getrusage(RUSAGE_SELF)``
of this process over the run is the router's CPU time, all of its threads included (the
event loop thread plus gRPC's and Ray's C++ threads); the main thread only blocks on a pipe.
The loop thread's own share is read from ``psutil`` per-thread times. The same process's CPU
over an idle interval of the same length before the run is reported for scale (Ray's
background chatter), and not subtracted. The client process reports its own CPU too. The run
ends with a cluster-wide leak check (every request gone, every KV block free).

Reported: errors (must be 0: an RPC error, an error finish, or a wrong token count), tokens
delivered, wall time (first request sent to last stream closed, client clock), tokens/s,
TTFT (with the server-side queue, prefill and hand-off behind it) and end-to-end percentiles,
stream messages per request, the decode worker's peak batch and its step time there, and
router CPU ms per 1,000 tokens delivered.

Run: ``python benchmarks/bench_streaming.py`` (~1 min on 2 cores), writes
benchmarks/results/streaming.txt; ``--quick`` (32 streams x 16 tokens) checks the script and
prints only, unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import multiprocessing as mp
import os
import platform
import random
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray workers and the spawned client must import the project's packages too.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

logger = logging.getLogger("bench_streaming")

RANDOM_MODEL = {"seed": 0}
BLOCK_SIZE = 16


# ---------------------------------------------------------------- the client process


def client_main(address: str, prompts: list[list[int]], max_tokens: int, num_channels: int, num_warmup: int,
                conn) -> None:
    """Runs in the spawned process: warm up, say ready, wait for go, run every stream, report."""
    try:
        conn.send(("ready", asyncio.run(_warmup(address, prompts[:num_warmup], max_tokens))))
        conn.recv()  # "go"
        cpu0 = _cpu_s()
        result = asyncio.run(_run_all(address, prompts, max_tokens, num_channels))
        result["client_cpu_s"] = _cpu_s() - cpu0
        conn.send(("done", result))
    except BaseException as exc:  # the parent must hear about it rather than wait forever
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _warmup(address: str, prompts: list[list[int]], max_tokens: int) -> int:
    from router.client import AsyncPdserveClient

    async with AsyncPdserveClient(address) as client:
        results = await asyncio.gather(*(
            client.generate_text(token_ids=p, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            for p in prompts))
    return sum(len(r.token_ids) for r in results)


async def _run_all(address: str, prompts: list[list[int]], max_tokens: int, num_channels: int) -> dict:
    from router.client import AsyncPdserveClient

    clients = [AsyncPdserveClient(address) for _ in range(num_channels)]
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(
        _one_stream(clients[i % num_channels], p, max_tokens, start) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    for client in clients:
        await client.close()
    errors = [o["error"] for o in outcomes if o["error"]]
    return {
        "wall_s": wall,
        "tokens": sum(o["tokens"] for o in outcomes),
        "messages": [o["messages"] for o in outcomes],
        "ttft_s": [o["ttft_s"] for o in outcomes if o["ttft_s"] is not None],
        "e2e_s": [o["e2e_s"] for o in outcomes],
        "max_gap_s": [o["max_gap_s"] for o in outcomes],
        "server_timings": [o["timings"] for o in outcomes if o["timings"]],
        "errors": len(errors),
        "error_samples": errors[:5],
    }


async def _one_stream(client, prompt: list[int], max_tokens: int, start: float) -> dict:
    import grpc

    from engine.types import FinishReason
    from router.convert import finish_reason_from_proto

    tokens, messages, first, last, max_gap, error, timings = 0, 0, None, None, 0.0, "", None
    try:
        async for resp in client.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                          temperature=0.0):
            now = time.perf_counter()
            messages += 1
            if resp.token_ids:
                first = first or now
                max_gap = max(max_gap, now - last) if last else 0.0
                last = now
            tokens += len(resp.token_ids)
            if resp.HasField("timings"):
                timings = (resp.timings.queue_s, resp.timings.prefill_s, resp.timings.kv_transfer_s)
            if finish_reason_from_proto(resp.finish_reason) is FinishReason.ERROR:
                error = f"finish ERROR: {resp.error}"
        if not error and tokens != max_tokens:
            error = f"{tokens} tokens, expected {max_tokens}"
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    end = time.perf_counter()
    return {"tokens": tokens, "messages": messages, "ttft_s": first - start if first else None,
            "e2e_s": end - start, "max_gap_s": max_gap, "error": error, "timings": timings}


# ---------------------------------------------------------------- the router process


def process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu_s(native_id: int) -> float:
    import psutil

    for t in psutil.Process().threads():
        if t.id == native_id:
            return t.user_time + t.system_time
    return 0.0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def report(args, runs: list[tuple[str, dict, dict]], header: list[str]) -> str:
    """One column per cluster mode; ``runs`` holds (mode, client results, router measurements)."""

    def rows(res: dict, router: dict) -> list[tuple[str, str]]:
        tokens = res["tokens"]
        per_k = lambda cpu: cpu / tokens * 1e6 if tokens else float("nan")  # noqa: E731  (ms per 1k tokens)
        return [
            ("errors", f"{res['errors']}" + (f"  {res['error_samples']}" if res["errors"] else "")),
            ("tokens delivered", f"{tokens:,} of {args.streams * args.max_tokens:,}"),
            ("wall time", f"{res['wall_s']:.2f} s"),
            ("tokens/s delivered", f"{tokens / res['wall_s']:,.0f}"),
            ("TTFT p50 / p99 / max (ms)", f"{pct(res['ttft_s'], .5) * 1e3:.0f} / {pct(res['ttft_s'], .99) * 1e3:.0f}"
                                          f" / {max(res['ttft_s']) * 1e3:.0f}"),
            ("  server: prefill-worker queue p50 / max (ms)", _server(res, 0)),
            ("  server: prefill compute p50 / max (ms)", _server(res, 1)),
            ("  server: KV hand-off incl. commit p50 / max (ms)", _server(res, 2)),
            ("end-to-end p50 / max (ms)", f"{pct(res['e2e_s'], .5) * 1e3:.0f} / {max(res['e2e_s']) * 1e3:.0f}"),
            ("a stream's largest token gap p50 / max (ms)",
             f"{pct(res['max_gap_s'], .5) * 1e3:.0f} / {max(res['max_gap_s']) * 1e3:.0f}"),
            ("stream messages per request (tokens/message)", f"{statistics.fmean(res['messages']):.1f}"
                                                             f" ({tokens / sum(res['messages']):.2f})"),
            ("decode steps seen / peak batch (seqs)", f"{router['decode_steps'][0]} / {router['decode_steps'][1]}"),
            ("  step time at >= 90% of the peak batch (ms)", f"{router['decode_steps'][2]:.1f}"),
            ("router process CPU, all threads (s)", f"{router['cpu_s']:.2f}"
                                                    f" ({router['cpu_s'] / res['wall_s']:.0%} of a core)"),
            ("ROUTER CPU PER 1,000 TOKENS (ms)", f"{per_k(router['cpu_s']):.1f}"),
            ("  of which the event loop thread (ms)", f"{per_k(router['loop_cpu_s']):.1f}"),
            ("  same process idle, same interval (s)", f"{router['idle_cpu_s']:.2f}"),
            ("client process CPU per 1,000 tokens (ms)", f"{per_k(res['client_cpu_s']):.1f}"),
            ("leaks after the run", "none" if not router["leaks"] else str(router["leaks"])),
        ]

    table = [rows(res, router) for _, res, router in runs]
    label_w = max(len(k) for k, _ in table[0]) + 2
    col_w = max(24, *(len(v) + 2 for t in table for _, v in t if len(v) < 40))
    lines = header + ["", f"{'':<{label_w}}" + "".join(f"{mode:>{col_w}}" for mode, _, _ in runs)]
    for i, (label, _) in enumerate(table[0]):
        lines.append(f"{label:<{label_w}}" + "".join(f"{t[i][1]:>{col_w}}" for t in table))
    notes = [
        "",
        "router CPU = getrusage(RUSAGE_SELF) of the benchmark process over the run: the router (grpc.aio server,",
        "orchestrator, decode-stream demux, metrics) and Ray's driver-side threads; the client is another process.",
        "leaks: requests still held / KV blocks not free on any worker after the run ('none' = clean).",
    ]
    return "\n".join(lines + notes) + "\n"


def _server(res: dict, i: int) -> str:
    values = [t[i] for t in res["server_timings"]]
    return f"{pct(values, .5) * 1e3:.0f} / {max(values) * 1e3:.0f}" if values else "-"


def machine_header(args, model: str) -> list[str]:
    import grpc
    import ray

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"bench_streaming  {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"machine: {platform.node()}, {os.cpu_count()} cores ({cpu}), load avg at start {load}",
        f"python {platform.python_version()}, ray {ray.__version__}, grpc {grpc.__version__}",
        f"model: {model}; {args.streams} concurrent streams x ({args.prompt_len} prompt + {args.max_tokens} output"
        f" tokens), greedy, ignore_eos; {args.channels} gRPC channel(s) from a separate client process",
        f"clusters: disaggregated = 1 prefill + 1 decode worker, colocated = 1 worker; 1 CPU / 1 torch thread each;"
        f" max_num_seqs {args.streams}, prefill budget {args.streams * args.prompt_len} tokens, KV pools hold every"
        f" stream; router in this process; 16 warm-up streams before the measured burst",
    ]


def start_cluster(args, column: str):
    """``column``: a cluster mode, optionally with the router's loop after a colon
    ("colocated:asyncio"; router/event_loop.py; default auto: uvloop when installed)."""
    mode, _, loop = column.partition(":")
    from deploy.launcher import ClusterConfig, ClusterThread
    from engine.config import EngineConfig

    blocks_per_stream = -(-(args.prompt_len + args.max_tokens) // BLOCK_SIZE)
    prompt_blocks = -(-args.prompt_len // BLOCK_SIZE)
    config = ClusterConfig(
        mode=mode, num_prefill=1, num_decode=1, port=0, event_loop=loop or None,
        random_model=RANDOM_MODEL if args.model == "random" else None,
        cpus_per_worker=1.0, threads_per_worker=1,
        prefill_engine=EngineConfig(max_num_batched_tokens=args.streams * args.prompt_len, max_num_seqs=args.streams,
                                    num_kv_blocks=args.streams * prompt_blocks + 16, block_size=BLOCK_SIZE),
        # colocated: the one worker also prefills, so it gets the prefill budget on top of a decode step's
        decode_engine=EngineConfig(max_num_seqs=args.streams,
                                   max_num_batched_tokens=args.streams * (1 + (args.prompt_len if mode == "colocated" else 0)),
                                   num_kv_blocks=args.streams * blocks_per_stream + 16, block_size=BLOCK_SIZE),
    )
    cluster = ClusterThread(config)
    cluster.start()
    return cluster


def _watch_decode_steps(cluster, conn, interval_s: float = 0.1) -> list:
    """Until the client reports, collect the decode worker's step timings from the stats that
    ride on its stream (a window of its last 64 steps; reading it costs microseconds)."""
    seen: dict[tuple, object] = {}
    while not conn.poll(interval_s):
        stats = cluster.cluster.registry.decode[0].stats
        for s in stats.recent_steps if stats else ():
            seen[(s.num_seqs, s.num_tokens, s.num_kv_tokens, s.duration_s)] = s
    return list(seen.values())


def decode_step_summary(steps: list) -> tuple[int, int, float]:
    """(decode-only steps seen, peak batch, mean ms of the steps at >= 90 % of the peak)."""
    steps = [s for s in steps if s.num_prefill_tokens == 0]
    if not steps:
        return 0, 0, float("nan")
    peak = max(s.num_seqs for s in steps)
    full = [s.duration_s for s in steps if s.num_seqs >= 0.9 * peak]
    return len(steps), peak, statistics.fmean(full) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 streams x 16 tokens")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--channels", type=int, default=1)
    parser.add_argument("--modes", default="disaggregated,colocated",
                        help="comma-separated cluster modes, one column each (colocated: no KV hand-off); a mode may "
                             "name the router's loop: colocated:asyncio,colocated:uvloop (the A/B of router/event_loop.py)")
    parser.add_argument("--model", choices=("random", "smollm2"), default="random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/streaming.txt (not written with --quick)")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.max_tokens = 32, 16
    out = args.out or (None if args.quick else ROOT / "benchmarks" / "results" / "streaming.txt")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import ray

    rng = random.Random(args.seed)
    id_range = (3, 512) if args.model == "random" else (1000, 40000)
    prompts = [[rng.randrange(*id_range) for _ in range(args.prompt_len)] for _ in range(args.streams)]
    header = machine_header(args, "tiny random Llama (2 layers, hidden 64, vocab 512)"
                            if args.model == "random" else "SmolLM2-135M fp32")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        runs = [(mode, *measure(args, mode, prompts)) for mode in args.modes.split(",")]
    finally:
        ray.shutdown()
    text = report(args, runs, header)
    sys.stdout.write(text)
    if out is not None:
        write_run(out, text)


def measure(args, mode: str, prompts: list[list[int]]) -> tuple[dict, dict]:
    """One cluster, one client process, one burst of streams: (client results, router measurements)."""
    cluster = child = None
    try:
        logger.info("starting the %s cluster", mode)
        cluster = start_cluster(args, mode)
        address = f"127.0.0.1:{cluster.cluster.port}"
        ctx = mp.get_context("spawn")  # never fork after ray.init
        parent_conn, child_conn = ctx.Pipe()
        child = ctx.Process(target=client_main, args=(address, prompts, args.max_tokens, args.channels,
                                                      min(16, args.streams), child_conn), daemon=True)
        child.start()
        kind, value = parent_conn.recv()
        if kind != "ready":
            raise RuntimeError(f"client failed during warm-up: {value}")
        logger.info("client warmed up (%d tokens); measuring idle CPU", value)
        loop_tid = cluster._thread.native_id
        idle_s = 3.0
        idle0 = process_cpu_s()
        time.sleep(idle_s)
        idle_cpu = process_cpu_s() - idle0
        cpu0, loop0 = process_cpu_s(), thread_cpu_s(loop_tid)
        parent_conn.send("go")
        steps = _watch_decode_steps(cluster, parent_conn)
        kind, res = parent_conn.recv()
        cpu, loop_cpu = process_cpu_s() - cpu0, thread_cpu_s(loop_tid) - loop0
        if kind != "done":
            raise RuntimeError(f"client failed: {res}")
        logger.info("%s: %d tokens in %.2f s, %d errors", mode, res["tokens"], res["wall_s"], res["errors"])
        router = {"cpu_s": cpu, "loop_cpu_s": loop_cpu, "idle_cpu_s": idle_cpu * res["wall_s"] / idle_s,
                  "decode_steps": decode_step_summary(steps), "leaks": _leaks(cluster)}
        return res, router
    finally:
        if child is not None:
            child.join(10)
        if cluster is not None:
            cluster.stop()


def _leaks(cluster) -> dict:
    """Aborts and frees run just after the last message: give them a moment to land."""
    from deploy.launcher import holds_anything

    deadline = time.monotonic() + 10
    while True:
        reports = cluster.run(cluster.cluster.leak_reports())
        leaks = {w: r for w, r in reports.items() if holds_anything(r)}
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.2)


if __name__ == "__main__":
    main()
