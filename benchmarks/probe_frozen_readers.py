"""Frozen-reader probe: clients that read their first message and then stop (their process
SIGSTOPped: never reading, never closing) while others stream; prints the others' TPOT and the
longest round of theirs, the decode worker's preemptions, then kills the frozen clients and
ends with the cluster-wide leak check.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/probe_frozen_readers.py

Tiny random Llama with a 16 Ki context, a 1200-block decode pool, ``max_pending_tokens`` 256,
real Ray actors, gRPC and the HTTP API. Three frozen clients (a gRPC stream and an SSE stream
of 12000 tokens, an SSE n=3 of 6000 each) outgrow the pool: their output sits in transport
buffers (the pending-token cap only counts what the router holds), so they keep decoding as in
vLLM. Measured on this VM: at bd3ebf2 the others' longest round (3 x 200-token streams) took
12-40 s in 3 runs (mean TPOT of a round up to 198 ms; 3-5 ms before the pool filled): preempted
requests recomputed in a loop at the head of the decode worker's line; at 4923a9a 2.1-2.5 s in
2 runs (mean TPOT at most 11.6 ms); leaks {} each run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

MODEL = "random-llama"


def _freeze() -> None:
    print("READY", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def frozen_client(door: str, where: str, max_tokens: int, n: int) -> None:
    """Runs in its own process: read the first message, then stop."""
    if door == "grpc":
        from router.client import PdserveClient
        stream = PdserveClient(where).generate(token_ids=[7, 8, 9, 10], max_tokens=max_tokens, ignore_eos=True)
        next(stream)
        _freeze()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(where)))
    body = json.dumps({"model": MODEL, "prompt": [7, 8, 9, 10], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "n": n, "temperature": 1.0 if n > 1 else 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while b"data:" not in got:
        got += sock.recv(4096)
    _freeze()


def _spawn(*args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--frozen", *map(str, args)], stdout=subprocess.PIPE, text=True)
    assert "READY" in proc.stdout.readline()
    return proc


async def _stream(addr: str, prompt: list[int]) -> list[float]:
    from router.client import AsyncPdserveClient
    gaps, last = [], None
    async with AsyncPdserveClient(addr) as client:
        async for msg in client.generate(token_ids=prompt, max_tokens=200, ignore_eos=True):
            now = time.monotonic()
            if last is not None:
                gaps.append((now - last) / max(1, len(msg.token_ids)))
            last = now
    return gaps


async def _round(addr: str) -> float:
    """Mean TPOT (ms) of 3 concurrent 200-token streams."""
    gaps = await asyncio.gather(*(_stream(addr, [10 + i, 11, 12, 13]) for i in range(3)))
    return 1000 * statistics.mean(g for one in gaps for g in one)


def main() -> None:
    import ray

    from engine.config import EngineConfig
    from router.limits import ServerLimits
    from tests.conftest import cluster_leaks
    from tests.test_cluster_e2e import address, start_cluster
    from tests.test_openai_api import wait_for

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    cluster = start_cluster("disaggregated", random_model={"seed": 0, "max_position_embeddings": 16384},
                            decode_engine=EngineConfig(num_kv_blocks=1200, block_size=16), http_port=0,
                            served_model_name=MODEL, defaults={"limits": ServerLimits(max_pending_tokens=256)})
    addr, port = address(cluster), cluster.cluster.http_port
    try:
        print(f"before: TPOT {asyncio.run(_round(addr)):.1f} ms")
        frozen = [_spawn("grpc", addr, 12000, 1), _spawn("http", port, 12000, 1), _spawn("http", port, 6000, 3)]
        rounds, tpots = [], []
        for _ in range(30):
            start = time.monotonic()
            tpots.append(asyncio.run(_round(addr)))
            rounds.append(time.monotonic() - start)
            if not len(cluster.cluster.servicer.core.live):
                break
        stats = cluster.cluster.registry.get("decode-0").stats
        print(f"with frozen readers: {len(rounds)} rounds, longest {max(rounds):.1f} s, mean TPOT median "
              f"{statistics.median(tpots):.1f} ms, worst {max(tpots):.1f} ms, decode preemptions {stats.num_preemptions}")
        for proc in frozen:
            proc.kill()
            proc.wait()
        print("leaks:", {} if wait_for(lambda: cluster_leaks(cluster) == {}, 20) else cluster_leaks(cluster))
    finally:
        cluster.stop()
        ray.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--frozen"]:
        frozen_client(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
