"""What the OpenAI-compatible HTTP layer and tracing cost, measured in one run on one cluster
(tiny random Llama, disaggregated, real Ray actors) against gRPC as the peer.

  1. per-request overhead: sequential one-token completions, median end-to-end latency over
     gRPC (AsyncPdserveClient) and over HTTP (aiohttp, POST /v1/completions, not streamed);
  2. streaming CPU at 64 concurrent streams: this process's CPU seconds (the router and the
     load generator share it, as in ``pdserve bench --launch``) per streamed token, gRPC vs
     HTTP (SSE), and the clients' median TPOT;
  3. tracing on vs off as deployed: two ``pdserve serve`` processes side by side, one with
     ``--otlp-traces-endpoint`` (OTLP/HTTP, batched export in every process) pointed at a local
     sink that counts and discards spans (``otlp_sink.py``), one without; the same 64 gRPC
     streams alternate between them round by round; TPOT (target: within 2 % of off) and the
     CPU seconds of each cluster's router and workers per request. On SmolLM2 (the real model)
     and on the tiny random Llama for reference (``tracing_ab.py``).

Usage: python benchmarks/bench_http.py [--out benchmarks/results/http_tracing.txt] [--quick]
                                       [--parts doors,tracing] [--models smollm2,tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import aiohttp  # noqa: E402

from benchmarks import tracing_ab  # noqa: E402
from deploy.launcher import ClusterConfig, ClusterThread  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from router.client import AsyncPdserveClient  # noqa: E402


def start() -> ClusterThread:
    config = ClusterConfig(mode="disaggregated", random_model={"seed": 0}, port=0, http_port=0, standby_workers=False,
                           cpus_per_worker=0.5, threads_per_worker=1,
                           prefill_engine=EngineConfig(num_kv_blocks=512, max_num_batched_tokens=512),
                           decode_engine=EngineConfig(num_kv_blocks=1024, max_num_seqs=128))
    cluster = ClusterThread(config)
    cluster.start()
    return cluster


def prompt(i: int) -> list[int]:
    return [(i * 13 + j) % 400 + 3 for j in range(32)]


async def grpc_one(client, i: int, max_tokens: int) -> tuple[float, list[float]]:
    start, times = time.perf_counter(), []
    async for resp in client.generate(token_ids=prompt(i), max_tokens=max_tokens, ignore_eos=True):
        times.extend([time.perf_counter()] * len(resp.token_ids))
    return times[-1] - start, times


async def http_one(session, url: str, i: int, max_tokens: int, stream: bool) -> tuple[float, list[float]]:
    body = {"model": "random-llama", "prompt": prompt(i), "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    start, times = time.perf_counter(), []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        if not stream:
            await resp.json()
            times.append(time.perf_counter())
        else:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())   # one chunk per engine step here (1 token)
    return times[-1] - start, times


async def http_raw_one(port: int, i: int) -> float:
    """One non-streamed completion over a fresh connection, the request in one write (as curl
    sends it): aiohttp writes headers and body apart, and the second segment then waits on the
    server's delayed ACK (~40 ms), a client artifact that is not the server's cost."""
    body = json.dumps({"model": "random-llama", "prompt": prompt(i), "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await reader.read()   # connection: close: the whole response, then EOF
    writer.close()
    return time.perf_counter() - start


def tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0


async def overhead(cluster, n: int) -> dict:
    port, url = cluster.cluster.port, f"http://127.0.0.1:{cluster.cluster.http_port}"
    async with AsyncPdserveClient(f"127.0.0.1:{port}") as client, aiohttp.ClientSession() as session:
        for i in range(5):   # warm both paths
            await grpc_one(client, i, 1)
            await http_one(session, url, i, 1, False)
        g = [(await grpc_one(client, i, 1))[0] for i in range(n)]
        h = [(await http_one(session, url, i, 1, False))[0] for i in range(n)]
        raw = [await http_raw_one(cluster.cluster.http_port, i) for i in range(n)]
    return {"grpc_ms": 1e3 * statistics.median(g), "http_ms": 1e3 * statistics.median(raw),
            "aiohttp_ms": 1e3 * statistics.median(h)}


async def streams(cluster, door: str, num: int, max_tokens: int) -> dict:
    url = f"http://127.0.0.1:{cluster.cluster.http_port}"
    async with AsyncPdserveClient(f"127.0.0.1:{cluster.cluster.port}") as client, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        cpu, wall = time.process_time(), time.perf_counter()
        if door == "grpc":
            results = await asyncio.gather(*(grpc_one(client, i, max_tokens) for i in range(num)))
        else:
            results = await asyncio.gather(*(http_one(session, url, i, max_tokens, True) for i in range(num)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = sum(len(t) for _, t in results)
    return {"door": door, "tokens": tokens, "cpu_s": cpu, "wall_s": wall, "cpu_us_per_token": 1e6 * cpu / tokens,
            "tpot_ms": 1e3 * statistics.median(tpot(t) for _, t in results)}


def doors(quick: bool) -> list[str]:
    n, num, max_tokens, rounds = (10, 8, 8, 1) if quick else (60, 64, 64, 3)
    lines = [f"HTTP vs gRPC: tiny random Llama, disaggregated, {os.cpu_count()} cores, load average "
             f"{tracing_ab.load_average()}; router and load generator in one process"]
    cluster = start()
    try:
        o = cluster.run(overhead(cluster, n), 600)
        lines.append(f"per-request (1 token, sequential, median of {n}): gRPC {o['grpc_ms']:.2f} ms, "
                     f"HTTP {o['http_ms']:.2f} ms (one write per request, new connection), HTTP overhead "
                     f"{o['http_ms'] - o['grpc_ms']:+.2f} ms; aiohttp keep-alive client {o['aiohttp_ms']:.2f} ms "
                     "(headers and body in two segments: ~40 ms of delayed ACK, the client's)")
        for _ in range(rounds):   # alternate doors: the machine's drift hits both alike
            for door in ("grpc", "http"):
                r = cluster.run(streams(cluster, door, num, max_tokens), 600)
                lines.append(f"{num} streams x {max_tokens} tokens, {door:4}: {r['cpu_us_per_token']:.0f} us CPU/token "
                             f"({r['cpu_s']:.2f} s CPU, {r['wall_s']:.2f} s wall), TPOT p50 {r['tpot_ms']:.2f} ms")
    finally:
        cluster.stop()
    lines.append(f"load average at the end: {tracing_ab.load_average()}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/http_tracing.txt"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="doors,tracing", help="comma-separated: doors, tracing")
    parser.add_argument("--models", default="smollm2,tiny", help="the tracing part's models: smollm2, tiny")
    args = parser.parse_args()
    parts = args.parts.split(",")
    lines = [f"bench_http.py ({'quick' if args.quick else 'full'}, parts {args.parts})"]
    if "doors" in parts:
        lines += doors(args.quick)
    if "tracing" in parts:
        for model in args.models.split(","):
            lines += tracing_ab.run(model, args.quick)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    write_run(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
