"""Soak probe: does anything grow with the number of requests served? A real cluster (the
router in this process, Ray prefill and decode actors) takes rounds of a mixed workload over
both doors (gRPC and the OpenAI HTTP API): greedy, seeded sampling, logprobs, prompt logprobs,
stop strings, structured output, n > 1, streams cancelled after their first token, HTTP streams
dropped mid-way, invalid requests, deadlines too short to meet, a request id reused while live.
After each round: the cluster-wide leak check, the router's RSS and live Python objects by
type, each worker's RSS. What a server that runs for weeks must show: after the warm-up
rounds, no steady growth per request.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/probe_soak.py [--rounds 8] [--per-round 160]

Prints a line per round and, at the end, the growth from the end of the warm-up to the last
round (per 1,000 requests) and the object types that grew most; the run goes on top of
benchmarks/results/soak.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)   # 2 shared cores: the router and this client share one thread

from deploy.launcher import ClusterConfig, ClusterThread  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from router.client import AsyncPdserveClient  # noqa: E402
from benchmarks.results_file import write_run  # noqa: E402
from tests.conftest import byte_level_tokenizer, cluster_leaks  # noqa: E402

KINDS = ("greedy", "seeded", "logprobs", "prompt_logprobs", "stop", "regex", "cancel", "invalid",
         "deadline", "reuse", "http", "http_n2", "http_stream_drop", "http_chat_stream")


async def _grpc_one(client: AsyncPdserveClient, short: AsyncPdserveClient, kind: str, rng: random.Random) -> str:
    """One request of ``kind``; returns its outcome (a status name or ``OK``)."""
    prompt = [rng.randrange(3, 259) for _ in range(rng.randrange(4, 60))]
    args = {"token_ids": prompt, "max_tokens": rng.randrange(2, 16)}
    extra = {"greedy": {}, "seeded": {"temperature": 0.8, "seed": rng.randrange(1 << 30)},
             "logprobs": {"logprobs": True, "top_logprobs": 5}, "prompt_logprobs": {"prompt_logprobs": 2},
             "stop": {"stop": ["a", "e"], "text": "Tell me a story", "token_ids": None},
             "regex": {"structured_output": {"regex": "[0-9]{1,4}"}, "text": "Count:", "token_ids": None},
             "invalid": {"temperature": -1.0}, "cancel": {"ignore_eos": True, "max_tokens": 200}}.get(kind, {})
    args.update(extra)
    args = {k: v for k, v in args.items() if v is not None}
    try:
        if kind == "deadline":
            await short.generate_text(**args)
        elif kind == "cancel":
            stream = client.generate(**args)
            async for msg in stream:
                if msg.token_ids:
                    break   # leaving the stream cancels the call
            await stream.aclose()
        elif kind == "reuse":
            rid = f"soak-{rng.randrange(1 << 40)}"
            first = client.generate(request_id=rid, ignore_eos=True, **args)
            await first.__anext__()
            outcome = "OK"
            try:
                await client.generate_text(request_id=rid, **args)
            except grpc.aio.AioRpcError as exc:
                outcome = exc.code().name
            async for _ in first:
                pass
            return f"reuse:{outcome}"
        else:
            await client.generate_text(**args)
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


async def _http_one(session: aiohttp.ClientSession, base: str, model: str, kind: str, rng: random.Random) -> str:
    body = {"model": model, "max_tokens": rng.randrange(2, 16), "prompt": "Hello there, " * rng.randrange(1, 8)}
    if kind == "http_n2":
        body.update(n=2, temperature=0.7, seed=rng.randrange(1 << 30))
    if kind == "http_chat_stream":
        body.pop("prompt")
        body.update(messages=[{"role": "user", "content": "Say something " * rng.randrange(1, 6)}], stream=True)
    if kind == "http_stream_drop":
        body.update(stream=True, max_tokens=200, ignore_eos=True)
    path = "/v1/chat/completions" if kind == "http_chat_stream" else "/v1/completions"
    async with session.post(base + path, json=body) as resp:
        if kind == "http_stream_drop":
            await resp.content.readline()   # the first event, then the client goes away
            resp.close()
            return "dropped"
        await resp.read()
        return str(resp.status)


async def _round(addr: str, base: str, model: str, num: int, seed: int) -> collections.Counter:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(12)
    outcomes: collections.Counter = collections.Counter()
    async with AsyncPdserveClient(addr, timeout_s=120) as client, \
            AsyncPdserveClient(addr, timeout_s=0.02) as short, aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            kind = KINDS[i % len(KINDS)]
            async with sem:
                if kind.startswith("http"):
                    outcome = await _http_one(session, base, model, kind, rng)
                else:
                    outcome = await _grpc_one(client, short, kind, rng)
            outcomes[f"{kind}:{outcome}"] += 1
        await asyncio.gather(*(one(i) for i in range(num)))
    return outcomes


def _objects() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _kill_later(cluster: ClusterThread, round_no: int) -> threading.Thread:
    """SIGKILL the round's victim (the workers in turn) a second from now."""
    workers = cluster.cluster.registry.all
    victim = workers[round_no % len(workers)]
    thread = threading.Thread(target=lambda: (time.sleep(1.0), os.kill(victim.pid, signal.SIGKILL)), daemon=True)
    thread.victim = (victim, victim.restarts)
    thread.start()
    return thread


def _wait_replaced(cluster: ClusterThread, victim, restarts_before: int) -> None:
    deadline = time.monotonic() + 180
    while not (victim.alive and victim.restarts > restarts_before):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{victim.worker_id} not replaced: {victim.state}")
        time.sleep(0.05)


def _census(actor_self) -> int:
    """Run inside a worker's actor (Ray's ``__ray_call__``): its live Python objects."""
    import gc

    gc.collect()
    return len(gc.get_objects())


def _worker_marks(cluster: ClusterThread) -> dict[str, tuple[float, int]]:
    """Each worker's (RSS MB, live objects)."""
    return {w.worker_id: (_rss_mb(w.pid), ray.get(w.actor.__ray_call__.remote(_census), timeout=60))
            for w in cluster.cluster.registry.all}


def _rss_mb(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-round", type=int, default=168)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--kill", action="store_true",
                        help="SIGKILL one worker (in turn) a second into every round; wait for its replacement after")
    args = parser.parse_args()

    from engine.model_loader import random_model

    model_dir = Path(tempfile.mkdtemp(prefix="soak-model-"))   # the tests' tiny Llama, with a byte tokenizer
    random_model(seed=0).model.save_pretrained(model_dir)
    byte_level_tokenizer().save_pretrained(model_dir)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    config = ClusterConfig(mode=args.mode, num_prefill=int(args.mode == "disaggregated"), num_decode=args.num_decode,
                           port=0, http_port=0, cpus_per_worker=0.5, threads_per_worker=1,
                           model=str(model_dir),
                           prefill_engine=EngineConfig(num_kv_blocks=128, max_num_batched_tokens=256),
                           decode_engine=EngineConfig(num_kv_blocks=256))
    cluster = ClusterThread(config)
    cluster.start()
    addr = f"127.0.0.1:{cluster.cluster.port}"
    base = f"http://127.0.0.1:{cluster.cluster.http_port}"
    with urllib.request.urlopen(base + "/v1/models") as resp:
        model = json.load(resp)["data"][0]["id"]
    me = psutil.Process()
    marks, lines = [], [_header(args)]
    try:
        for round_no in range(args.rounds):
            start = time.monotonic()
            killer = _kill_later(cluster, round_no) if args.kill else None
            outcomes = asyncio.run(_round(addr, base, model, args.per_round, seed=round_no))
            if killer is not None:
                killer.join()
                _wait_replaced(cluster, *killer.victim)
            leaks = cluster_leaks(cluster)
            objects = _objects()
            workers = _worker_marks(cluster)
            marks.append((me.memory_info().rss / 2**20, sum(objects.values()), objects, workers))
            lines.append(f"round {round_no}: {args.per_round} requests in {time.monotonic() - start:.1f} s; "
                         f"router RSS {marks[-1][0]:.1f} MB, {marks[-1][1]} objects; workers "
                         + ", ".join(f"{w} {mb:.0f} MB {n} objects" for w, (mb, n) in workers.items())
                         + f"; leaks {leaks or 'none'}")
            if round_no == 0 or args.kill:
                lines.append("    outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
            print("\n".join(lines[-2 if round_no == 0 or args.kill else -1:]), flush=True)
        lines += _report(marks, args)
        print("\n".join(lines[-2:]), flush=True)
        write_run(Path(__file__).parent / "results" / "soak.txt", "\n".join(lines))
    finally:
        cluster.stop()
        ray.shutdown()


def _header(args: argparse.Namespace) -> str:
    import subprocess

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent).stdout.strip()
    return (f"# probe_soak.py --rounds {args.rounds} --per-round {args.per_round} --warmup-rounds "
            f"{args.warmup_rounds} --mode {args.mode} --num-decode {args.num_decode}{' --kill' if args.kill else ''}, at {rev} "
            f"({time.strftime('%Y-%m-%d')}); tiny Llama, "
            f"the kinds in turn: {', '.join(KINDS)}")


def _report(marks: list, args: argparse.Namespace) -> list[str]:
    first, last = marks[args.warmup_rounds - 1], marks[-1]
    served = args.per_round * (len(marks) - args.warmup_rounds)
    per_k = 1000 / served
    grown = (last[2] - first[2]).most_common(12)
    return [f"after warm-up, per 1,000 requests: router RSS {(last[0] - first[0]) * per_k:+.2f} MB, "
            f"objects {(last[1] - first[1]) * per_k:+.0f}; workers "
            + ", ".join(f"{w} {(last[3][w][0] - first[3][w][0]) * per_k:+.2f} MB, "
                        f"{(last[3][w][1] - first[3][w][1]) * per_k:+.0f} objects" for w in last[3]),
            "    object types grown most: " + (", ".join(f"{t} +{n}" for t, n in grown) or "none")]


if __name__ == "__main__":
    main()
