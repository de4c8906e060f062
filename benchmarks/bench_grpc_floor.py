"""What grpc.aio itself costs the router, measured on a bare server with nothing of pdserve in it.

Two figures the router's own benchmarks are read against (benchmarks/results/router_scale.txt):

  - streaming floor: server CPU per streamed message. A server process whose one handler writes
    ``--messages`` one-token ``GenerateResponse``s per call (``context.write``, as the router does,
    and ``yield`` for comparison) to ``--streams`` concurrent calls from a client in another process;
    the server's CPU (user + system, all its threads) over the run / messages sent. At one token
    per message this is the least router CPU per streamed token any grpc.aio router can reach.
  - accept rate under a busy loop: new calls per second a server completes when its event loop
    has other work. grpc.aio's server asks core for one call at a time (it awaits each accept
    before asking for the next), and calls that arrive faster than it takes them wait in gRPC
    core, where the router's admission cannot see them. A task burns ``busy`` ms per event-loop pass (the router's
    streaming work, standing in) while ``--users`` clients call a one-message method in a closed
    loop; with 1 server, with 4 servers bound to the port in one process, and with 2 server
    processes bound to it (SO_REUSEPORT: the kernel spreads the connections across processes;
    within one process they all landed on one server in session 13's probe).

The streaming floor runs on asyncio's loop and on uvloop's in turns (the router runs on uvloop
where it is installed: router/event_loop.py); the accept rate on the router's default loop.

Run: ``python benchmarks/bench_grpc_floor.py`` (~2 min), writes benchmarks/results/grpc_floor.txt;
``--quick`` prints a short run only.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

SERVICE = "pdserve.v1.Pdserve"
CHANNELS = 16


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _serve(ready, *, servers: int, messages: int, style: str, busy_ms: float, port: int = 0) -> None:
    import grpc

    from protos import pdserve_pb2 as pb

    async def write_handler(request, context):
        msg = pb.GenerateResponse(request_id="r", token_ids=[5], text="a")
        for _ in range(messages):
            await context.write(msg)

    async def yield_handler(request, context):
        msg = pb.GenerateResponse(request_id="r", token_ids=[5], text="a")
        for _ in range(messages):
            yield msg

    handler = write_handler if style == "write" else yield_handler
    for _ in range(servers):
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        method = grpc.unary_stream_rpc_method_handler(handler, request_deserializer=pb.GenerateRequest.FromString,
                                                      response_serializer=pb.GenerateResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Generate": method}),))
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()

    async def busy() -> None:   # the loop's other work: busy_ms in every pass
        while True:
            _burn(busy_ms / 1e3)
            await asyncio.sleep(0)

    if busy_ms > 0:
        asyncio.get_running_loop().create_task(busy())
    ready.put(port)
    await asyncio.Event().wait()


def _server_main(ready, kwargs: dict) -> None:
    from router import event_loop

    kwargs = dict(kwargs)
    loop = kwargs.pop("loop")
    event_loop.run(_serve(ready, **kwargs), loop)


async def _clients(port: int, *, users: int, calls_per_user: int | None, seconds: float | None) -> tuple[int, int, float]:
    """``users`` closed-loop callers over CHANNELS connections: (calls, messages, wall seconds)."""
    import grpc

    from protos import pdserve_pb2 as pb
    from protos import pdserve_pb2_grpc as pb_grpc

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHANNELS)]
    stubs = [pb_grpc.PdserveStub(c) for c in channels]
    counts = [0, 0]
    start = time.perf_counter()
    stop = start + seconds if seconds else None

    async def user(i: int) -> None:
        n = 0
        while (calls_per_user is None or n < calls_per_user) and (stop is None or time.perf_counter() < stop):
            async for _ in stubs[i % CHANNELS].Generate(pb.GenerateRequest()):
                counts[1] += 1
            counts[0] += 1
            n += 1

    await asyncio.gather(*(user(i) for i in range(users)))
    wall = time.perf_counter() - start
    for c in channels:
        await c.close()
    return counts[0], counts[1], wall


def _process_cpu_s(pid: int) -> float:
    """User + system CPU of a process, all its threads (Linux /proc; 10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(server_kwargs: dict, client_kwargs: dict, processes: int = 1) -> tuple[int, int, float, float]:
    """``processes`` server processes on one port, one client run (after a warm-up run): calls,
    messages, wall s, servers' CPU s."""
    ctx = mp.get_context("spawn")
    procs, port = [], 0
    try:
        for _ in range(processes):   # the first binds a free port, the others join it
            ready = ctx.Queue()
            proc = ctx.Process(target=_server_main, args=(ready, dict(server_kwargs, port=port)), daemon=True)
            proc.start()
            procs.append(proc)
            port = ready.get(timeout=60)
        warm = dict(client_kwargs, seconds=min(2.0, client_kwargs.get("seconds") or 2.0))
        asyncio.run(_clients(port, **warm))
        cpu0 = sum(_process_cpu_s(proc.pid) for proc in procs)
        calls, messages, wall = asyncio.run(_clients(port, **client_kwargs))
        return calls, messages, wall, sum(_process_cpu_s(proc.pid) for proc in procs) - cpu0
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)


def streaming_floor(args) -> list[str]:
    """Each style on asyncio's loop and on uvloop's (router/event_loop.py), in turns, ``--repeats`` times."""
    lines = [f"streaming floor: {args.streams} concurrent calls x {args.messages} one-token messages, client in"
             f" another process over {CHANNELS} connections; server CPU (all threads) / messages; each loop in turn,"
             f" {args.repeats} runs each"]
    for style in ("write", "yield"):
        runs: dict[str, list[tuple[float, float]]] = {"asyncio": [], "uvloop": []}
        for _ in range(args.repeats):
            for loop in runs:
                _, messages, wall, cpu = _run({"servers": 1, "messages": args.messages, "style": style,
                                               "busy_ms": 0.0, "loop": loop},
                                              {"users": args.streams, "calls_per_user": 1, "seconds": None})
                runs[loop].append((cpu / messages * 1e6, messages / wall))
        for loop, got in runs.items():
            us = " / ".join(f"{u:5.1f}" for u, _ in got)
            rate = " / ".join(f"{r:,.0f}" for _, r in got)
            lines.append(f"  {'context.write' if style == 'write' else 'yield':<14} {loop:<8} {us} us of server CPU"
                         f" per message  ({rate} messages/s)")
    return lines


def accept_rate(args) -> list[str]:
    lines = [f"accept rate: {args.users} closed-loop callers of a one-message call for {args.seconds:g} s; the"
             " server's event loop (the router's default) busy for the given time in every pass"]
    setups = (("1 server", 1, 1), ("4 servers, 1 process", 4, 1), ("2 processes", 1, 2))
    for busy_ms in args.busy_ms:
        row = []
        for name, servers, processes in setups:
            calls, _, wall, _ = _run({"servers": servers, "messages": 1, "style": "write", "busy_ms": busy_ms,
                                      "loop": "auto"},
                                     {"users": args.users, "calls_per_user": None, "seconds": args.seconds},
                                     processes)
            row.append(f"{name}: {calls / wall:6,.0f}")
        lines.append(f"  loop busy {busy_ms:4.1f} ms per pass   calls/s  " + "   ".join(row))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--messages", type=int, default=200)
    p.add_argument("--users", type=int, default=500)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    p.add_argument("--repeats", type=int, default=2, help="streaming floor runs per loop and style")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "grpc_floor.txt")
    args = p.parse_args()
    if args.quick:
        args.streams, args.messages, args.users, args.seconds, args.busy_ms = 50, 50, 100, 2.0, [0.0, 5.0]
        args.repeats = 1
    import grpc

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"bench_grpc_floor  {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {platform.machine()}, {os.cpu_count()} cores, load avg at start {load}",
             f"python {platform.python_version()}, grpc {grpc.__version__}", ""]
    lines += streaming_floor(args) + [""] + accept_rate(args)
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        write_run(args.out, text)


if __name__ == "__main__":
    main()
