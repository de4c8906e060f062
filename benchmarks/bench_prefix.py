"""Prefix caching: a shared-prefix chat workload through pdserve with the cache on and off and
through ``transformers serve --continuous-batching``, the same requests at a sweep of rates;
and the cost of the cache on a workload with nothing to share.

Workload (seeded; text, so every server gets the same requests): ``--num-systems`` system
prompts of ``--system-len`` words (8 x 400; each word one token of SmolLM2's vocabulary: the
deployment's fixed instructions), and per rate r max(``--min-conversations``, r x ``--window-s``)
conversations (the offered load lasts about the same at every rate), each on one system prompt
(uniform), of ``--turns`` turns. A turn's prompt is the whole history: system
prompt, every earlier user turn and the answer that server gave to it, then a new user turn of
20-100 words; the answer is 16-32 tokens (EOS ignored, greedy). A conversation starts at a
Poisson arrival (``--rates`` conversations per second, the same arrival draws rescaled per
rate) and sends its next turn as soon as the previous answer has arrived; a conversation whose
turn fails (refused, error) ends there. Each rate stops ``GRACE_S`` after its last arrival
(time for a late conversation's every turn to still meet the SLO); what is unfinished then is
cancelled. The system prompts are the same at every rate (a deployment's constants: a warm
cache carries over from one rate to the next, on every server); the user turns are drawn afresh
per rate (seed + rate index). pdserve gets each prompt as token ids (the text tokenized here
with the model's tokenizer, so Timings come back per turn), transformers serve gets the text.

Systems, one at a time: pdserve with ``enable_prefix_caching`` on, then off (SmolLM2-135M-Instruct
fp32, 1 prefill + 1 decode worker, 1 CPU and 1 torch thread each, admission on with the SLO of
``benchmarks/bench_goodput.py`` run 7 (TTFT 6.4 s, TPOT 390 ms) as the cluster's default,
conditional disaggregation on: bench_goodput's system (a)); then, after Ray has shut down,
``transformers serve --continuous-batching`` on 2 threads (bench_goodput's system (c), started
by its code; its own prefix sharing is on by default).

Goodput, as bench_goodput reports it: per system, each rate's attainment (turns within both
SLO targets / turns planned: a turn never sent because its conversation ended early is a miss)
and goodput (those turns / run duration, first send to last completion); the system's
goodput@90 is the highest offered rate whose attainment >= 90%, with the goodput measured there.
The "cache on >= 2x cache off" target compares those (the rates, and the goodput at them). A
system's sweep climbs ``--rates`` (steps of ~sqrt 2) and stops after its first rate below 90%; when even
the lowest misses, it is halved (up to 3 times); one that meets 90% at the top rate has a lower bound.
Also per pdserve rate: prefix-cache hit ratio (prompt tokens the prefilling worker found cached
/ prompt tokens; and the decode worker's: KV not transferred), TTFT p50/p99, TPOT p50, KV bytes
transferred per request, output throughput. Then the all-unique check: a W64-like workload
(``make_w64`` distribution, ``--unique-requests`` of them, random ids, nothing shared) through
the engine in-process on 2 threads, cache off / on / off / on; the better of each pair is
compared (target: cache on costs <= 3% output throughput).

Usage:
  python benchmarks/bench_prefix.py                  # ~20 min on a quiet 2-core machine
  python benchmarks/bench_prefix.py --parts serve    # one part; the other's figures are kept from summary.json
  python benchmarks/bench_prefix.py --systems on,off # leave transformers serve out
  python benchmarks/bench_prefix.py --quick          # tiny random Llama (SmolLM2's tokenizer) on every
                                                     # server, fewer and shorter conversations, ~5 min:
                                                     # checks the script, its numbers mean nothing
Outputs in ``--out-dir`` (default benchmarks/results/prefix): summary.txt, summary.json.
Caveat: the router and this load generator share one process (and its GIL), as in bench_goodput;
transformers serve's client is this process too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ["RAY_AUTH_MODE"] = "disabled"   # a local benchmark cluster: no token auth (before ray is imported)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # Ray workers

from benchmarks.results_file import write_run  # noqa: E402
from deploy.bench.dataset import arrival_offsets  # noqa: E402
from deploy.bench.report import percentile  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

logger = logging.getLogger("bench_prefix")

SLO_TTFT_S, SLO_TPOT_S = 6.4, 0.390      # bench_goodput run 7
TARGET_ATTAINMENT = 0.9
BLOCK_SIZE = EngineConfig().block_size   # the clusters' KV block (the default)
MAX_HALVINGS = 3             # a sweep whose lowest rate misses halves it at most this often
USER_RANGE, ANSWER_RANGE = (20, 100), (16, 32)
SYSTEMS = {"on": "pdserve, prefix cache on", "off": "pdserve, prefix cache off",
           "tserve": "transformers serve --continuous-batching"}


# ---------------------------------------------------------------- the workload


@dataclass(frozen=True, slots=True)
class Conversation:
    idx: int
    system: int                          # index into the system prompts
    user_turns: tuple[str, ...]
    answer_lens: tuple[int, ...]


def word_list(tokenizer) -> list[str]:
    """Words that are one token each with their leading space (so a text of n of them is about n
    tokens), in id order: the same list wherever this tokenizer is."""
    words = []
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if token.startswith("\u0120") and token[1:].isascii() and token[1:].isalpha() and len(token) > 3:
            words.append(" " + token[1:])
    return words


def make_systems(num: int, length: int, seed: int, words: list[str]) -> list[str]:
    rng = random.Random(f"systems:{seed}")
    return ["System:" + "".join(rng.choice(words) for _ in range(length)) for _ in range(num)]


def make_conversations(num: int, num_systems: int, turns: int, seed: int, words: list[str]) -> list[Conversation]:
    """Draw order: per conversation its system prompt, then per turn the user length, its words,
    the answer length."""
    rng = random.Random(f"conversations:{seed}")
    convs = []
    for idx in range(num):
        system = rng.randrange(num_systems)
        users, answers = [], []
        for _ in range(turns):
            n = rng.randint(*USER_RANGE)
            users.append("\nUser:" + "".join(rng.choice(words) for _ in range(n)) + "\nAssistant:")
            answers.append(rng.randint(*ANSWER_RANGE))
        convs.append(Conversation(idx, system, tuple(users), tuple(answers)))
    return convs


# ---------------------------------------------------------------- one turn, on either kind of server


@dataclass(slots=True)
class Turn:
    conv: int
    turn: int
    prompt_len: int = 0
    output_len: int = 0
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    kv_bytes: int = 0
    prefill_cached: int = 0
    decode_cached: int = 0
    saved_bytes: int = 0
    handoff: str = ""              # Timings.kv_handoff: "ok", "prefilled_locally", ...
    error: str = ""
    end_s: float | None = None     # perf_counter when it ended (None: cancelled unfinished)

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)

    @property
    def good(self) -> bool:
        tpot = self.tpot_s
        return self.ok and self.ttft_s is not None and self.ttft_s <= SLO_TTFT_S and (tpot is None or tpot <= SLO_TPOT_S)


class Server(Protocol):
    async def send(self, rec: Turn, prompt: str, max_tokens: int) -> str:
        """Fill ``rec`` with the turn's outcome; return the answer's text."""


class PdserveServer:
    """pdserve over gRPC: the prompt as token ids (tokenized here), Timings read per turn."""

    def __init__(self, client, tokenizer) -> None:
        self.client, self.tokenizer = client, tokenizer

    async def send(self, rec: Turn, prompt: str, max_tokens: int) -> str:
        from grpc import aio

        ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        rec.prompt_len = len(ids)
        tokens: list[int] = []
        start = time.perf_counter()
        try:
            async for resp in self.client.generate(token_ids=ids, max_tokens=max_tokens, ignore_eos=True,
                                                   temperature=0.0):
                if resp.token_ids and rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - start
                tokens.extend(resp.token_ids)
                if resp.HasField("timings"):
                    t = resp.timings
                    rec.kv_bytes, rec.prefill_cached = t.kv_transfer_bytes, t.prefill_cached_tokens
                    rec.decode_cached, rec.saved_bytes = t.decode_cached_tokens, t.kv_transfer_saved_bytes
                    rec.handoff = t.kv_handoff
                rec.error = resp.error or rec.error
            rec.ok = len(tokens) == max_tokens
        except aio.AioRpcError as exc:
            rec.error = f"{exc.code().name}: {exc.details()}"
        rec.e2e_s = time.perf_counter() - start
        rec.output_len = len(tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class OpenAIServer:
    """transformers serve over HTTP (``/v1/completions``, streamed): text in, text out; the
    request body is ``pdserve bench``'s for that server (EOS ignored via generation_config)."""

    def __init__(self, backend, tokenizer) -> None:
        self.backend, self.tokenizer = backend, tokenizer

    async def send(self, rec: Turn, prompt: str, max_tokens: int) -> str:
        import aiohttp

        from deploy.bench.backends import chunk_content, parse_sse_line
        from deploy.bench.dataset import BenchRequest

        rec.prompt_len = len(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        body = self.backend.payload(BenchRequest(rec.turn, [], max_tokens, prompt_text=prompt))
        text: list[str] = []
        usage: dict = {}
        start = time.perf_counter()
        try:
            async with self.backend._session.post(self.backend.base_url + self.backend.endpoint, json=body) as resp:
                if resp.status != 200:
                    rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                async for line in resp.content if resp.status == 200 else ():
                    event = parse_sse_line(line)
                    if event is None or event == "[DONE]":
                        continue    # transformers serve ends the stream after a usage chunk, no [DONE]
                    if "error" in event:
                        rec.error = f"stream error: {event['error']}"
                        break
                    if chunk_content(event):
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - start
                        text.append(chunk_content(event))
                    usage = event.get("usage") or usage
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        rec.e2e_s = time.perf_counter() - start
        rec.output_len = usage.get("completion_tokens") or len(text)
        rec.ok = not rec.error and rec.output_len == max_tokens
        return "".join(text)


# ---------------------------------------------------------------- one rate against a server

GRACE_S = 3 * (SLO_TTFT_S + (ANSWER_RANGE[1] - 1) * SLO_TPOT_S)   # a conversation's every turn, at the SLO


async def run_conversation(server: Server, conv: Conversation, system: str, delay_s: float,
                           turns: list[Turn]) -> None:
    await asyncio.sleep(delay_s)
    history = system
    for k, user in enumerate(conv.user_turns):
        prompt = history + user
        rec = Turn(conv.idx, k)
        turns.append(rec)
        answer = await server.send(rec, prompt, conv.answer_lens[k])
        rec.end_s = time.perf_counter()
        if not rec.ok:
            break    # a conversation whose answer failed ends there (its history is unknown)
        history = prompt + answer


async def run_rate(server: Server, systems: list[str], convs: list[Conversation], rate: float,
                   seed: int) -> tuple[list[Turn], float]:
    """Every conversation, cancelled ``GRACE_S`` after the last arrival; the duration runs from
    the first send to the last completion."""
    offsets = arrival_offsets(len(convs), rate, seed=seed)
    turns: list[Turn] = []
    start = time.perf_counter()
    tasks = [asyncio.ensure_future(run_conversation(server, c, systems[c.system], o, turns))
             for c, o in zip(convs, offsets)]
    _, late = await asyncio.wait(tasks, timeout=offsets[-1] + GRACE_S)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    ended = [t for t in turns if t.end_s is not None]
    duration = max(t.end_s for t in ended) - start if ended else time.perf_counter() - start
    return ended, max(duration, 1e-9)


def summarize(turns: list[Turn], planned: int, duration_s: float) -> dict:
    ok = [t for t in turns if t.ok]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    prompt = sum(t.prompt_len for t in ok) or 1
    good = sum(t.good for t in turns)
    return {
        "planned": planned, "requests": len(turns), "ok": len(ok), "good": good, "duration_s": duration_s,
        "prefill_hit_ratio": sum(t.prefill_cached for t in ok) / prompt,
        "decode_hit_ratio": sum(t.decode_cached for t in ok) / prompt,
        "local_share": sum(t.handoff == "prefilled_locally" for t in ok) / max(1, len(ok)),
        **handoff_bytes([t for t in ok if t.handoff == "ok"]),
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "tpot_p50_s": percentile(tpots, 50) if tpots else None,
        "goodput_rps": good / duration_s,
        "attainment": good / planned if planned else 0.0,
        "prompt_tokens_per_request": prompt / max(1, len(ok)),
        "kv_bytes_per_request": statistics.fmean(t.kv_bytes for t in ok) if ok else 0.0,
        "kv_bytes_saved_per_request": statistics.fmean(t.saved_bytes for t in ok) if ok else 0.0,
        "output_tok_s": sum(t.output_len for t in ok) / duration_s,
        "errors": sorted({t.error for t in turns if t.error})[:3],
    }


def handoff_bytes(handoffs: list[Turn]) -> dict:
    """Over the turns whose KV was handed over (not those the decode worker prefilled itself,
    which move nothing in either system): KV bytes moved per prompt token, and the prompt
    tokens the decode worker held already. Per prompt token, so cache on and off compare on
    their own prompts (a turn refused in one system and served in the other shifts the means)."""
    prompt = sum(t.prompt_len for t in handoffs)
    if not prompt:
        return {"handoffs": 0}
    return {"handoffs": len(handoffs), "kv_bytes_per_handoff_token": sum(t.kv_bytes for t in handoffs) / prompt,
            "handoff_decode_hit": sum(t.decode_cached for t in handoffs) / prompt,
            "block_rounding": BLOCK_SIZE * len(handoffs) / prompt}


async def sweep(args, key: str, server: Server, systems: list[str], words: list[str], settle) -> list[dict]:
    """Climb the rates; stop after the first below the attainment target; when the lowest
    misses, halve it (up to MAX_HALVINGS times) so that a slow system still gets a finite
    goodput@90 rather than an "infinite" ratio."""
    rows: list[dict] = []
    queue = list(args.rates)
    lowest = args.rates[0]
    while queue:
        rate = queue.pop(0)
        num = max(args.min_conversations, round(rate * args.window_s))
        convs = make_conversations(num, args.num_systems, args.turns, args.seed + round(rate * 1000), words)
        turns, duration = await run_rate(server, systems, convs, rate, args.seed)
        row = {"system": key, "rate_conv_s": rate, **summarize(turns, len(convs) * args.turns, duration)}
        logger.info("%s rate %g: %s", key, rate, row)
        rows.append(row)
        settle()
        if row["attainment"] < TARGET_ATTAINMENT:
            halvings = round(math.log2(args.rates[0] / rate))
            queue = [rate / 2] if rate == lowest and halvings < MAX_HALVINGS else []
            lowest = min(lowest, rate / 2)
    return sorted(rows, key=lambda r: r["rate_conv_s"])


# ---------------------------------------------------------------- the servers


def cluster_config(args, cache: bool, model_dir: Path):
    from deploy.launcher import ClusterConfig

    engine = dict(max_num_batched_tokens=512, num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=cache)
    return ClusterConfig(mode="disaggregated", num_prefill=1, num_decode=1, cpus_per_worker=1.0, threads_per_worker=1,
                         model=str(model_dir) if args.quick else None, host="127.0.0.1", port=0,
                         prefill_engine=EngineConfig(**engine), decode_engine=EngineConfig(**engine),
                         defaults={"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S}, standby_workers=False)


@contextlib.contextmanager
def pdserve_target(args, cache: bool, model_dir: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """A cluster: its gRPC address, and how to wait until it is idle (a leak check between rates)."""
    from bench_goodput import settle_pdserve

    from deploy.launcher import ClusterThread

    cluster = ClusterThread(cluster_config(args, cache, model_dir))
    try:
        port = cluster.start()
        yield f"127.0.0.1:{port}", lambda: settle_pdserve(cluster)
    finally:
        cluster.stop()


@contextlib.contextmanager
def tserve_target(args, model_dir: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """transformers serve, started by bench_goodput's code: its base URL and settle."""
    from bench_goodput import transformers_session

    peer_args = argparse.Namespace(tserve_threads=args.tserve_threads, cb_num_blocks=args.cb_num_blocks,
                                   cb_max_batch_tokens=512)
    with transformers_session(peer_args, model_dir, args.out_dir / "transformers-serve.log") as target:
        yield target.flags[target.flags.index("--base-url") + 1], target.settle


@contextlib.asynccontextmanager
async def connect(key: str, where: str, model_dir: Path, tokenizer) -> AsyncIterator[Server]:
    if key != "tserve":
        from router.client import AsyncPdserveClient

        async with AsyncPdserveClient(where, timeout_s=600) as client:
            yield PdserveServer(client, tokenizer)
        return
    from deploy.bench.backends import OpenAIBackend

    backend = OpenAIBackend(where, model=str(model_dir), flavor="transformers", timeout_s=600)
    await backend.start()
    try:
        yield OpenAIServer(backend, tokenizer)
    finally:
        await backend.close()


def run_system(args, key: str, model_dir: Path, tokenizer, systems: list[str], words: list[str]) -> list[dict]:
    """One server: a warm-up conversation on a system prompt of its own, then the sweep."""
    target = tserve_target(args, model_dir) if key == "tserve" else pdserve_target(args, key == "on", model_dir)

    async def serve(where: str, settle) -> list[dict]:
        async with connect(key, where, model_dir, tokenizer) as server:
            warm = make_conversations(1, 1, 1, seed=-1, words=words)
            await run_rate(server, make_systems(1, args.system_len, -1, words), warm, 100.0, 0)
            settle()
            return await sweep(args, key, server, systems, words, settle)

    logger.info("system %s: %s", key, SYSTEMS[key])
    with target as (where, settle):
        return asyncio.run(serve(where, settle))


# ---------------------------------------------------------------- all unique: the cache's cost
# ---------------------------------------------------------------- all unique: the cache's cost


def unique_check(args) -> dict:
    import torch

    from benchmarks.workload import make_w64
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


def at_target(rows: list[dict], key: str) -> dict | None:
    """bench_goodput's goodput@90: the run at the highest rate whose attainment >= 90%."""
    passed = [r for r in rows if r["system"] == key and r["attainment"] >= TARGET_ATTAINMENT]
    return max(passed, key=lambda r: r["rate_conv_s"]) if passed else None


def comparisons(rows: list[dict]) -> list[str]:
    """The issue's targets, each from figures measured in this run."""
    lines = ["", "goodput@90 (the highest rate with >= 90% of turns within the SLO, and the goodput there):"]
    best = {}
    for key in SYSTEMS:
        ran = [r for r in rows if r["system"] == key]
        if not ran:
            continue
        best[key] = at_target(rows, key)
        b = best[key]
        lines.append(f"  {key:6} " + (f"{b['rate_conv_s']:g} conv/s: {b['goodput_rps']:.3f} req/s"
                                       + ("  (met 90% at every rate run: a lower bound)"
                                          if b["rate_conv_s"] == max(r["rate_conv_s"] for r in ran) else "")
                                       if b else "below 90% at every rate run: 0"))
    on = best.get("on")
    for key, name, target in (("off", "cache off", 2.0), ("tserve", "transformers serve", None)):
        if on is None or key not in best:
            continue
        g = best[key]["goodput_rps"] if best[key] else 0.0
        ratio = on["goodput_rps"] / g if g else float("inf")
        rate = best[key]["rate_conv_s"] if best[key] else 0.0
        rate_ratio = on["rate_conv_s"] / rate if rate else float("inf")
        verdict = f" (target >= {target:g}x): {'PASS' if min(ratio, rate_ratio) >= target else 'MISS'}" if target else ""
        lines.append(f"  cache on / {name}: rate at 90% {on['rate_conv_s']:g} / {rate:g} conv/s = {rate_ratio:.2f}x, "
                     f"goodput there {on['goodput_rps']:.3f} / {g:.3f} req/s = {ratio:.2f}x{verdict}")
    pairs = [(a, b) for a in rows if a["system"] == "on" for b in rows
             if b["system"] == "off" and b["rate_conv_s"] == a["rate_conv_s"]]
    if pairs:
        lines.append("cache on vs off at the same rate:")
    for a, b in pairs:
        ttft = b["ttft_p50_s"] / a["ttft_p50_s"] if a["ttft_p50_s"] and b["ttft_p50_s"] else None
        lines.append(f"  {a['rate_conv_s']:g} conv/s: TTFT p50 off/on {fmt(ttft)}x (target >= 3x: "
                     f"{'-' if ttft is None else 'PASS' if ttft >= 3 else 'MISS'})")
        lines.append("    " + kv_cut_line(a, b))
    return lines


def kv_cut_line(on: dict, off: dict) -> str:
    """KV bytes moved per hand-off, cache on against off, per prompt token; the cut should be
    the decode worker's hit ratio: only the blocks it lacks move. Both systems move a prompt's
    last, partial block whole, so the cut falls short of the hit ratio by at most that
    rounding (one block per prompt)."""
    if not on.get("handoffs") or not off.get("handoffs"):
        return "KV bytes per hand-off: no hand-off in one of the systems"
    per_on, per_off = on["kv_bytes_per_handoff_token"], off["kv_bytes_per_handoff_token"]
    cut, hit, slack = 1 - per_on / per_off, on["handoff_decode_hit"], on["block_rounding"]
    return (f"KV bytes per hand-off and prompt token {per_off / 1e3:.1f} kB (off) -> {per_on / 1e3:.1f} kB (on): "
            f"down {100 * cut:.1f}% vs the decode worker's hit ratio over those hand-offs {100 * hit:.1f}% "
            f"(target: down >= hit ratio, less the partial last block ({100 * slack:.1f}% of a prompt): "
            f"{'PASS' if cut >= hit - slack else 'MISS'}; {on['handoffs']} and {off['handoffs']} hand-offs)")


def render(args, rows: list[dict], unique: dict | None, elapsed_s: float, load: str) -> str:
    lines = [f"bench_prefix  {time.strftime('%Y-%m-%dT%H:%M:%S')}  (parts {args.parts}: {elapsed_s / 60:.1f} min; "
             f"load average {load})",
             f"model: {'tiny random Llama, SmolLM2 tokenizer (--quick)' if args.quick else 'SmolLM2-135M-Instruct fp32'}"
             f"; SLO TTFT {SLO_TTFT_S} s, TPOT {SLO_TPOT_S * 1e3:.0f} ms; attainment target {TARGET_ATTAINMENT:.0%}",
             "systems: " + "; ".join(f"{k} = {v}" for k, v in SYSTEMS.items()),
             "  pdserve: 1 prefill + 1 decode worker, 1 CPU / 1 thread each, admission on, conditional disaggregation; "
             f"transformers serve: {args.tserve_threads} threads, --cb-num-blocks {args.cb_num_blocks}",
             f"workload: {args.num_systems} system prompts x {args.system_len} words; per rate r, max("
             f"{args.min_conversations}, r x {args.window_s:g} s) conversations x {args.turns} turns, user turns {USER_RANGE[0]}-{USER_RANGE[1]} words, "
             f"answers {ANSWER_RANGE[0]}-{ANSWER_RANGE[1]} tokens, seed {args.seed}", "",
             f"{'system':6} {'conv/s':>6} {'good':>7} {'attain':>6} {'goodput':>7} {'TTFT p50':>8} {'p99':>6} "
             f"{'TPOT p50':>8} {'hit%':>5} {'dhit%':>5} {'local%':>6} {'prompt':>6} {'KV MB/req':>9} {'saved MB':>8} {'tok/s':>6}"]
    for r in rows:
        pd = r["system"] != "tserve"
        lines.append(
            f"{r['system']:6} {r['rate_conv_s']:6.3f} {r['good']:>3}/{r['planned']:<3} {r['attainment']:6.2f} "
            f"{r['goodput_rps']:7.3f} {fmt(r['ttft_p50_s']):>8} {fmt(r['ttft_p99_s']):>6} "
            f"{fmt(r['tpot_p50_s'] and r['tpot_p50_s'] * 1e3, '.0f') + ' ms':>8} "
            f"{fmt(pd and 100 * r['prefill_hit_ratio'], '.1f') if pd else '-':>5} "
            f"{fmt(100 * r['decode_hit_ratio'], '.1f') if pd else '-':>5} "
            f"{fmt(100 * r.get('local_share', float('nan')), '.0f') if pd else '-':>6} {r['prompt_tokens_per_request']:6.0f} "
            f"{fmt(r['kv_bytes_per_request'] / 1e6) if pd else '-':>9} "
            f"{fmt(r['kv_bytes_saved_per_request'] / 1e6) if pd else '-':>8} {r['output_tok_s']:6.1f}")
    lines.append("good = turns within both SLO targets / turns planned (a turn not sent because its conversation ended "
                 "early is a miss); goodput = good turns/s over the run; hit% = prompt tokens the prefilling worker "
                 "found cached; dhit% = prompt tokens the decode worker held already (KV not transferred); local% = turns the decode "
                 "worker prefilled itself (conditional disaggregation: no hand-off); prompt = "
                 "mean prompt tokens per completed turn")
    if rows:
        lines += comparisons(rows)
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
                   help="conversation arrival rates per second, climbed in order until one misses 90%% "
                        "(default 0.07,0.1,0.14,0.2,0.28,0.4,0.56,0.8: steps of ~sqrt(2), so a goodput ratio is "
                        "not rounded to a power of 2)")
    p.add_argument("--window-s", type=float, default=None,
                   help="conversations per rate = rate x this (at least --min-conversations; default 60)")
    p.add_argument("--min-conversations", type=int, default=4)
    p.add_argument("--systems", default="on,off,tserve", help="of on, off, tserve (transformers serve runs last)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--num-systems", type=int, default=8)
    p.add_argument("--system-len", type=int, default=None, help="words (default 400)")
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--tserve-threads", type=int, default=2)
    p.add_argument("--cb-num-blocks", type=int, default=64, help="transformers serve KV blocks (256 tokens each)")
    p.add_argument("--unique-requests", type=int, default=None, help="default 32")
    p.add_argument("--parts", default="serve,unique", help="serve, unique or both (a part not run keeps "
                                                           "its figures from an earlier summary.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    quick = args.quick
    args.rates = args.rates or ([1.0, 4.0] if quick else [0.07, 0.1, 0.14, 0.2, 0.28, 0.4, 0.56, 0.8])
    args.window_s = args.window_s or (2.0 if quick else 60.0)
    if quick:
        args.min_conversations = min(args.min_conversations, 3)
    args.system_len = args.system_len or (60 if quick else 400)
    args.unique_requests = args.unique_requests or (8 if quick else 32)
    if quick:
        args.num_kv_blocks = min(args.num_kv_blocks, 256)
    args.out_dir = args.out_dir or (Path("/tmp/bench_prefix_quick") if quick else ROOT / "benchmarks/results/prefix")
    keys = args.systems.split(",")
    unknown = set(keys) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
    args.systems = [k for k in SYSTEMS if k in keys]   # transformers serve last, after Ray is down
    return args


def serve_part(args) -> list[dict]:
    import ray
    from bench_goodput import smollm2_dir, tiny_hf_dir

    from deploy.model_prep import load_tokenizer

    model_dir = tiny_hf_dir(args.out_dir) if args.quick else smollm2_dir()
    tokenizer = load_tokenizer(str(model_dir))
    words = word_list(tokenizer)
    systems = make_systems(args.num_systems, args.system_len, args.seed, words)
    rows: list[dict] = []
    for key in args.systems:
        if key == "tserve" and ray.is_initialized():
            ray.shutdown()     # no Ray process shares the cores with transformers serve
        try:
            rows += run_system(args, key, model_dir, tokenizer, systems, words)
        except Exception as exc:  # noqa: BLE001 - one system failing must not lose the others
            logger.exception("%s failed", key)
            rows.append({"system": key, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return rows


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    begin = time.perf_counter()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    parts = set(args.parts.split(","))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    saved = args.out_dir / "summary.json"
    kept = json.loads(saved.read_text()) if saved.is_file() else {"rows": [], "unique": None}
    if "serve" in parts:
        kept["rows"] = serve_part(args)
        saved.write_text(json.dumps(kept, indent=2) + "\n")   # a later part may fail: keep this one
    if "unique" in parts:
        kept["unique"] = unique_check(args)
        saved.write_text(json.dumps(kept, indent=2) + "\n")
    load += " -> " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    failed = [r for r in kept["rows"] if "failed" in r]
    rows = [r for r in kept["rows"] if "failed" not in r and "system" in r]
    text = render(args, rows, kept["unique"], time.perf_counter() - begin, load)
    text += "".join(f"FAILED {r['system']}: {r['failed']}\n" for r in failed)
    print(text)
    write_run(args.out_dir / "summary.txt", text)   # earlier runs' summaries kept below this one
    return 0


if __name__ == "__main__":
    sys.exit(main())
