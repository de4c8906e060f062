"""Prefix caching: a shared-prefix chat workload through pdserve, cache on vs off, in one run;
and the cost of the cache on a workload with nothing to share.

Workload (seeded; ``make_conversations``): ``--num-systems`` system prompts of ``--system-len``
random token ids (8 x 400: the deployment's fixed instructions), and per rate ``--conversations``
conversations, each on one system prompt (uniform), of ``--turns`` turns. A turn's prompt is
the whole history: system prompt, every earlier user turn and the answer the server actually
gave to it, then a new user turn of 20-100 random ids; the answer is 16-32 tokens (EOS ignored,
greedy). A conversation starts at a Poisson arrival (``--rates`` conversations per second, the
same arrival draws rescaled per rate) and sends its next turn as soon as the previous answer has
arrived. The system prompts are the same at every rate (a deployment's constants); the user turns
are drawn afresh per rate (seed + rate index), so a rate never replays the previous one's
histories. Cache on and cache off see exactly the same requests.

System: SmolLM2-135M-Instruct fp32, 1 prefill + 1 decode worker, 1 CPU and 1 torch thread each,
admission on with the SLO of ``benchmarks/bench_goodput.py`` run 7 (TTFT 6.4 s, TPOT 390 ms) as
the cluster's default, conditional disaggregation on (bench_goodput's system (a)); one cluster
with ``enable_prefix_caching`` on, then one with it off, each run through every rate.

Reported per mode and rate: prefix-cache hit ratio (prompt tokens the prefilling worker found
cached / prompt tokens; and the decode worker's: KV not transferred), TTFT p50/p99, TPOT p50,
goodput (requests within both SLO targets / run duration) and attainment, KV bytes transferred
per request, output throughput. Then the all-unique check: a W64-like workload (``make_w64``
distribution, ``--unique-requests`` of them, random ids, nothing shared) through the engine
in-process on 2 threads, cache off / on / off / on; the better of each pair is compared
(target: cache on costs <= 3% output throughput).

Usage:
  python benchmarks/bench_prefix.py                  # ~12-15 min on a quiet 2-core machine
  python benchmarks/bench_prefix.py --parts unique   # one part; the other's figures are kept from summary.json
  python benchmarks/bench_prefix.py --quick          # tiny random model, ~3 min: checks the script
Outputs in ``--out-dir`` (default benchmarks/results/prefix): summary.txt, summary.json.
Caveat: the router and this load generator share one process (and its GIL), as in bench_goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["RAY_AUTH_MODE"] = "disabled"   # a local benchmark cluster: no token auth (before ray is imported)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # Ray workers

from deploy.bench.dataset import arrival_offsets  # noqa: E402
from deploy.bench.report import percentile  # noqa: E402

logger = logging.getLogger("bench_prefix")

SLO_TTFT_S, SLO_TPOT_S = 6.4, 0.390      # bench_goodput run 7
VOCAB = (1000, 40000)                    # clear of SmolLM2's special ids
QUICK_VOCAB = (3, 512)                   # the tiny random Llama
USER_RANGE, ANSWER_RANGE = (20, 100), (16, 32)


# ---------------------------------------------------------------- the workload


@dataclass(frozen=True, slots=True)
class Conversation:
    idx: int
    system: int                          # index into the system prompts
    user_turns: tuple[tuple[int, ...], ...]
    answer_lens: tuple[int, ...]


def make_systems(num: int, length: int, seed: int, vocab: tuple[int, int]) -> list[tuple[int, ...]]:
    rng = random.Random(f"systems:{seed}")
    return [tuple(rng.randrange(*vocab) for _ in range(length)) for _ in range(num)]


def make_conversations(num: int, num_systems: int, turns: int, seed: int, vocab: tuple[int, int]) -> list[Conversation]:
    """Draw order: per conversation its system prompt, then per turn the user length, its ids,
    the answer length."""
    rng = random.Random(f"conversations:{seed}")
    convs = []
    for idx in range(num):
        system = rng.randrange(num_systems)
        users, answers = [], []
        for _ in range(turns):
            users.append(tuple(rng.randrange(*vocab) for _ in range(rng.randint(*USER_RANGE))))
            answers.append(rng.randint(*ANSWER_RANGE))
        convs.append(Conversation(idx, system, tuple(users), tuple(answers)))
    return convs


# ---------------------------------------------------------------- one rate against a server


@dataclass(slots=True)
class Turn:
    conv: int
    turn: int
    prompt_len: int
    output_len: int = 0
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    kv_bytes: int = 0
    prefill_cached: int = 0
    decode_cached: int = 0
    saved_bytes: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)

    @property
    def good(self) -> bool:
        tpot = self.tpot_s
        return self.ok and self.ttft_s is not None and self.ttft_s <= SLO_TTFT_S and (tpot is None or tpot <= SLO_TPOT_S)


async def send_turn(client, conv: Conversation, turn: int, prompt: list[int]) -> tuple[Turn, list[int]]:
    from grpc import aio

    rec = Turn(conv.idx, turn, len(prompt))
    tokens: list[int] = []
    start = time.perf_counter()
    try:
        async for resp in client.generate(token_ids=prompt, max_tokens=conv.answer_lens[turn], ignore_eos=True,
                                          temperature=0.0):
            if resp.token_ids and rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - start
            tokens.extend(resp.token_ids)
            if resp.HasField("timings"):
                t = resp.timings
                rec.kv_bytes, rec.prefill_cached = t.kv_transfer_bytes, t.prefill_cached_tokens
                rec.decode_cached, rec.saved_bytes = t.decode_cached_tokens, t.kv_transfer_saved_bytes
            rec.error = resp.error or rec.error
        rec.ok = len(tokens) == conv.answer_lens[turn]
    except aio.AioRpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"
    rec.e2e_s = time.perf_counter() - start
    rec.output_len = len(tokens)
    return rec, tokens


async def run_conversation(client, conv: Conversation, system: tuple[int, ...], delay_s: float) -> list[Turn]:
    await asyncio.sleep(delay_s)
    history, turns = list(system), []
    for k, user in enumerate(conv.user_turns):
        prompt = history + list(user)
        rec, answer = await send_turn(client, conv, k, prompt)
        turns.append(rec)
        if not rec.ok:
            break    # a conversation whose answer failed ends there (its history is unknown)
        history = prompt + answer
    return turns


async def run_rate(address: str, systems, convs: list[Conversation], rate: float, seed: int) -> tuple[list[Turn], float]:
    from router.client import AsyncPdserveClient

    offsets = arrival_offsets(len(convs), rate, seed=seed)
    async with AsyncPdserveClient(address, timeout_s=600) as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(run_conversation(client, c, systems[c.system], o) for c, o in zip(convs, offsets)))
        duration = time.perf_counter() - start
    return [t for turns in done for t in turns], duration


def summarize(turns: list[Turn], duration_s: float) -> dict:
    ok = [t for t in turns if t.ok]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    prompt = sum(t.prompt_len for t in ok) or 1
    handed = [t for t in ok if t.kv_bytes > 0]
    return {
        "requests": len(turns), "ok": len(ok), "duration_s": duration_s,
        "prefill_hit_ratio": sum(t.prefill_cached for t in ok) / prompt,
        "decode_hit_ratio": sum(t.decode_cached for t in ok) / prompt,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "tpot_p50_s": percentile(tpots, 50) if tpots else None,
        "goodput_rps": sum(t.good for t in turns) / duration_s,
        "attainment": sum(t.good for t in turns) / len(turns) if turns else 0.0,
        "kv_bytes_per_request": statistics.fmean(t.kv_bytes for t in ok) if ok else 0.0,
        "kv_bytes_saved_per_request": statistics.fmean(t.saved_bytes for t in ok) if ok else 0.0,
        "handoffs": len(handed),
        "output_tok_s": sum(t.output_len for t in ok) / duration_s,
        "errors": sorted({t.error for t in turns if t.error})[:3],
    }


# ---------------------------------------------------------------- the cluster


def cluster_config(args, cache: bool):
    from deploy.launcher import ClusterConfig
    from engine.config import EngineConfig

    engine = dict(max_num_batched_tokens=512, num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=cache)
    return ClusterConfig(mode="disaggregated", num_prefill=1, num_decode=1, cpus_per_worker=1.0, threads_per_worker=1,
                         model=None, random_model={"seed": 0} if args.quick else None, host="127.0.0.1", port=0,
                         prefill_engine=EngineConfig(**engine), decode_engine=EngineConfig(**engine),
                         defaults={"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S}, standby_workers=False)


def serve_mode(args, cache: bool, systems) -> list[dict]:
    from deploy.launcher import ClusterThread

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_goodput import settle_pdserve

    vocab = QUICK_VOCAB if args.quick else VOCAB
    cluster = ClusterThread(cluster_config(args, cache))
    port = cluster.start()
    address = f"127.0.0.1:{port}"
    rows = []
    try:
        warm = make_conversations(1, 1, 1, seed=-1, vocab=vocab)   # its own system prompt: warms nothing shared
        asyncio.run(run_rate(address, make_systems(1, args.system_len, -1, vocab), warm, 100.0, 0))
        settle_pdserve(cluster)
        for i, rate in enumerate(args.rates):
            convs = make_conversations(args.conversations, args.num_systems, args.turns, args.seed + i, vocab)
            turns, duration = asyncio.run(run_rate(address, systems, convs, rate, args.seed))
            row = {"cache": cache, "rate_conv_s": rate, **summarize(turns, duration)}
            logger.info("cache %s rate %g: %s", "on" if cache else "off", rate, row)
            rows.append(row)
            settle_pdserve(cluster)
    finally:
        cluster.stop()
    return rows


# ---------------------------------------------------------------- all unique: the cache's cost


def unique_check(args) -> dict:
    import torch

    from benchmarks.workload import make_w64
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.model_loader import load_model, random_model
    from engine.types import RequestSpec, SamplingParams

    torch.set_num_threads(2)
    loaded = random_model(seed=0) if args.quick else load_model(None)
    workload = make_w64(num_requests=args.unique_requests)
    if args.quick:
        workload = [dataclasses.replace(r, prompt_token_ids=[3 + t % 509 for t in r.prompt_token_ids][:200])
                    for r in workload]
    out = {"off": [], "on": []}
    bookkeeping = []
    for cache in (False, True, False, True):
        engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=3 << 30, max_num_seqs=64, max_num_batched_tokens=512,
                                                enable_prefix_caching=cache))
        spent = _time_cache_calls(engine.kv) if cache else None
        specs = [RequestSpec(f"u{i}", tuple(r.prompt_token_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
                 for i, r in enumerate(workload)]
        start = time.perf_counter()
        tokens = sum(len(v) for v in engine.generate(specs).values())
        wall = time.perf_counter() - start
        out["on" if cache else "off"].append(tokens / wall)
        if spent is not None:
            bookkeeping.append(spent[0] / wall)
        logger.info("unique, cache %s: %.1f out tok/s (%.1f s), hits %d", cache, tokens / wall, wall,
                    engine.kv.counters.hits)
        del engine
    best_off, best_on = max(out["off"]), max(out["on"])
    return {"requests": len(workload), "off_tok_s": out["off"], "on_tok_s": out["on"],
            "cost": 1 - best_on / best_off, "pass": best_on >= 0.97 * best_off,
            "bookkeeping_share": max(bookkeeping)}


def _time_cache_calls(kv) -> list[float]:
    """Wrap the prefix cache's own work (lookups, filing, admission) with a timer: on an
    all-unique workload that is all the cache adds, and unlike two wall times it does not
    drown in a shared machine's noise."""
    spent = [0.0]
    for name in ("find_cached", "cache_computed", "can_admit", "admit"):
        fn = getattr(kv, name)

        def timed(*a, _fn=fn, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        setattr(kv, name, timed)
    return spent


# ---------------------------------------------------------------- report


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def render(args, rows: list[dict], unique: dict | None, elapsed_s: float) -> str:
    lines = [f"bench_prefix  {time.strftime('%Y-%m-%dT%H:%M:%S')}  (parts {args.parts}: {elapsed_s / 60:.1f} min)",
             f"model: {'tiny random Llama (--quick)' if args.quick else 'SmolLM2-135M-Instruct fp32'}; "
             f"1 prefill + 1 decode worker, 1 thread each; SLO TTFT {SLO_TTFT_S} s, TPOT {SLO_TPOT_S * 1e3:.0f} ms",
             f"workload: {args.num_systems} system prompts x {args.system_len} tokens, {args.conversations} "
             f"conversations x {args.turns} turns per rate, user turns {USER_RANGE[0]}-{USER_RANGE[1]} tokens, "
             f"answers {ANSWER_RANGE[0]}-{ANSWER_RANGE[1]}, seed {args.seed}", "",
             f"{'cache':5} {'conv/s':>6} {'ok':>6} {'hit%':>5} {'dhit%':>5} {'TTFT p50':>8} {'p99':>6} "
             f"{'TPOT p50':>8} {'goodput':>7} {'attain':>6} {'KV MB/req':>9} {'saved MB':>8} {'tok/s':>6}"]
    for r in rows:
        lines.append(
            f"{'on' if r['cache'] else 'off':5} {r['rate_conv_s']:6.2f} {r['ok']:>3}/{r['requests']:<2} "
            f"{100 * r['prefill_hit_ratio']:5.1f} {100 * r['decode_hit_ratio']:5.1f} {fmt(r['ttft_p50_s']):>8} "
            f"{fmt(r['ttft_p99_s']):>6} {fmt(r['tpot_p50_s'] and r['tpot_p50_s'] * 1e3, '.0f') + ' ms':>8} "
            f"{r['goodput_rps']:7.3f} {r['attainment']:6.2f} {r['kv_bytes_per_request'] / 1e6:9.2f} "
            f"{r['kv_bytes_saved_per_request'] / 1e6:8.2f} {r['output_tok_s']:6.1f}")
    lines.append("hit% = prompt tokens the prefilling worker found cached; dhit% = prompt tokens the decode "
                 "worker held already (not transferred); goodput in requests/s within both SLO targets")
    if unique is not None:
        lines += ["", f"all-unique (W64-like, {unique['requests']} requests, engine in-process, 2 threads, off/on/off/on):",
                  "  cache off: " + ", ".join(f"{x:.1f}" for x in unique["off_tok_s"]) + " out tok/s",
                  "  cache on:  " + ", ".join(f"{x:.1f}" for x in unique["on_tok_s"]) + " out tok/s",
                  f"  cost of the cache (best of each): {100 * unique['cost']:+.1f}% (target <= 3%): "
                  f"{'PASS' if unique['pass'] else 'MISS'}",
                  f"  the cache's own work (lookups, filing, admission; timed inside the cache-on runs): "
                  f"{100 * unique.get('bookkeeping_share', float('nan')):.2f}% of wall time"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="conversation arrival rates per second (default 0.1,0.2,0.4)")
    p.add_argument("--conversations", type=int, default=None, help="per rate (default 10)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--num-systems", type=int, default=8)
    p.add_argument("--system-len", type=int, default=None, help="default 400")
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--unique-requests", type=int, default=None, help="default 32")
    p.add_argument("--parts", default="serve,unique", help="serve, unique or both (a part not run keeps "
                                                           "its figures from an earlier summary.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    quick = args.quick
    args.rates = args.rates or ([0.5, 2.0] if quick else [0.1, 0.2, 0.4])
    args.conversations = args.conversations or (4 if quick else 10)
    args.system_len = args.system_len or (60 if quick else 400)
    args.unique_requests = args.unique_requests or (8 if quick else 32)
    if args.quick:
        args.num_kv_blocks = min(args.num_kv_blocks, 256)
    args.out_dir = args.out_dir or (Path("/tmp/bench_prefix_quick") if quick else ROOT / "benchmarks/results/prefix")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    begin = time.perf_counter()
    vocab = QUICK_VOCAB if args.quick else VOCAB
    parts = set(args.parts.split(","))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    saved = args.out_dir / "summary.json"
    kept = json.loads(saved.read_text()) if saved.is_file() else {"rows": [], "unique": None}
    if "serve" in parts:
        systems = make_systems(args.num_systems, args.system_len, args.seed, vocab)
        kept["rows"] = serve_mode(args, True, systems) + serve_mode(args, False, systems)
        saved.write_text(json.dumps(kept, indent=2) + "\n")   # a later part may fail: keep this one
    if "unique" in parts:
        kept["unique"] = unique_check(args)
        saved.write_text(json.dumps(kept, indent=2) + "\n")
    text = render(args, kept["rows"], kept["unique"], time.perf_counter() - begin)
    (args.out_dir / "summary.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
