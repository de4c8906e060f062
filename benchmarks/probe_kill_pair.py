"""Kill probe: a prefill and a decode worker SIGKILLed at the same moment under a dozen
concurrent streams, with ``--migration-limit 1``. One failure event should cost each request
one migration at most: the probe counts the streams that failed (and why), checks every
completed stream against HF greedy, and ends with the cluster-wide leak check.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/probe_kill_pair.py [--rounds 3] [--cold]

Tiny random Llama (the tests' model), real Ray actors, real gRPC. Each round starts the
streams, kills ``prefill-0`` and ``decode-0`` together once half the streams have their first
token (the others are still prefilling), and waits for both replacements before the next.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)   # 2 shared cores: the reference model and the router share one thread

from deploy.launcher import ClusterConfig, ClusterThread  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from router.client import AsyncPdserveClient  # noqa: E402
from tests.conftest import cluster_leaks, greedy_workload  # noqa: E402

NUM_STREAMS = 12


async def _round(addr: str, prompts, max_tokens, kill) -> list[tuple[list[int], str | None, int]]:
    """Every stream's (tokens, error or None, migrations); ``kill`` runs once half have a token."""
    half = asyncio.Event()
    started = [0]

    async def one(client, prompt, n):
        tokens, migrations = [], 0
        try:
            async for msg in client.generate(token_ids=prompt, max_tokens=n, ignore_eos=True):
                if not tokens and msg.token_ids:
                    started[0] += 1
                    if started[0] >= len(prompts) // 2:
                        half.set()
                tokens.extend(msg.token_ids)
                if msg.HasField("timings"):
                    migrations = msg.timings.migrations
            return tokens, None, migrations
        except grpc.aio.AioRpcError as exc:
            return tokens, f"{exc.code().name}: {exc.details().split(' (ref ')[0][:160]}", migrations

    async with AsyncPdserveClient(addr, timeout_s=180) as client:
        tasks = [asyncio.create_task(one(client, p, n)) for p, n in zip(prompts, max_tokens)]
        await asyncio.wait_for(half.wait(), 120)
        kill()
        return await asyncio.gather(*tasks)


def _wait_replaced(cluster: ClusterThread, restarts: dict[str, int]) -> None:
    deadline = time.monotonic() + 120
    for worker_id, before in restarts.items():
        worker = cluster.cluster.registry.get(worker_id)
        while not (worker.alive and worker.restarts > before):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker_id} not replaced: {worker.state}")
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="no warm spares (cold replacements)")
    args = parser.parse_args()

    from engine.model_loader import random_model

    ref_model = random_model(seed=0).model
    ref_model.config._attn_implementation = "sdpa"
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    config = ClusterConfig(mode="disaggregated", port=0, cpus_per_worker=0.5, threads_per_worker=1,
                           random_model={"seed": 0}, migration_limit=1, standby_workers=not args.cold,
                           prefill_engine=EngineConfig(num_kv_blocks=96, max_num_batched_tokens=64),
                           decode_engine=EngineConfig(num_kv_blocks=320, block_size=16))
    cluster = ClusterThread(config)
    cluster.start()
    addr = f"127.0.0.1:{cluster.cluster.port}"
    total_failed = total = 0
    try:
        for round_no in range(args.rounds):
            prompts, max_tokens, refs = greedy_workload(ref_model, seed=100 + round_no, num=NUM_STREAMS,
                                                        prompt_len=(20, 120), output_len=(40, 80))
            registry = cluster.cluster.registry
            victims = {w: registry.get(w) for w in ("prefill-0", "decode-0")}
            restarts = {w: h.restarts for w, h in victims.items()}

            def kill():
                for handle in victims.values():
                    os.kill(handle.pid, signal.SIGKILL)

            results = asyncio.run(_round(addr, prompts, max_tokens, kill))
            failed = [err for _, err, _ in results if err]
            wrong = [i for i, (tokens, err, _) in enumerate(results) if not err and tokens != refs[i]]
            moves = sorted(m for _, err, m in results if not err)
            print(f"round {round_no}: {len(failed)} of {len(results)} failed; completed outputs unlike HF: "
                  f"{len(wrong)}; migrations of the completed: {moves}", flush=True)
            for err in sorted(set(failed)):
                print(f"    {failed.count(err)} x {err}", flush=True)
            total_failed += len(failed)
            total += len(results)
            _wait_replaced(cluster, restarts)
        leaks = cluster_leaks(cluster)
        print(f"total: {total_failed} of {total} failed; leaks: {leaks or 'none'}", flush=True)
    finally:
        cluster.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
