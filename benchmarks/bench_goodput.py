"""Goodput under an SLO: pdserve (disaggregated, colocated, admission on/off) against ``transformers serve``.

One invocation runs every system in turn, never two at once, on this machine (2 cores, SmolLM2-135M fp32):

  (a) pdserve-disagg      1 prefill + 1 decode worker, 1 CPU and 1 torch thread each, admission on
                          (conditional disaggregation on: admission may prefill a short prompt on the decode worker)
  (b) pdserve-colocated   chunked prefill on both cores, admission on. Default layout ``2x1``: two colocated
                          workers with 1 thread each, the same per-core setup as (a). Measured in-process on
                          SmolLM2: a 256-token prefill takes 1.06 s on 1 thread and 0.69 s on 2 (1.5x, not 2x),
                          and a decode step of 12 requests on 2 threads (161 ms) costs what one of 6 does on
                          1 thread (150 ms), so two 1-thread loops serve more than one 2-thread loop; the
                          2-thread loop only has lower unloaded latency. ``--colocated-layout 1x2`` runs it.
                          Step token budget 256 (``--chunk``): longer prompts are chunked.
  (c) transformers-serve  ``transformers serve DIR --continuous-batching --device cpu --dtype float32`` on a
                          loopback port, OMP/MKL threads = 2, KV capped (``--cb-num-blocks``) so it does not take
                          60% of RAM; reached through ``pdserve bench --backend openai --openai-flavor
                          transformers --tokenizer DIR --model DIR`` (text prompts; EOS ignored through
                          ``generation_config``). ``--model`` is passed because its ``/v1/models`` lists the
                          local HF cache, not the pinned model.
  (d) pdserve-<better>-noadmit   the better of (a)/(b) by goodput at 90% attainment, admission off, at every
                          rate the better mode ran plus 2x its capacity.

Procedure
  1. Unloaded: ``pdserve bench --max-concurrency 1 --request-rate inf`` (back-to-back, one request at a time,
     ``--unloaded-prompts`` of them) on fresh (a) and (b) clusters; median TTFT and TPOT of each. The SLO
     base is the mode with the lower unloaded latency TTFT + (mean output - 1) x TPOT (``--slo-base`` to force);
     ONE SLO for every system: TTFT <= 5x and TPOT <= 3x its medians (``--slo TTFT_MS,TPOT_MS`` overrides).
     It is set as the cluster's default SLO (``ClusterConfig.defaults``) and sent as request hints
     (``--send-slo``), and given to the bench as ``--goodput ttft:MS tpot:MS``.
  2. Rates: ``--rates`` or capacity x ``--rate-multipliers`` (0.25,0.5,1,1.5,2,3), capacity estimated as
     1 / unloaded TTFT of the SLO base (one prompt at a time on one prefill core: rough, it only places the
     ladder). The same rates for every system.
  3. Sweeps, each on a fresh cluster/server, one ``pdserve bench`` call per rate (warm-ups before the first),
     ``--num-prompts`` seeded requests per rate (input ``--input-len`` +-50%, output ``--output-len`` +-50%,
     each rate its own requests, the same for every system: a rate that reused another's prompts would be
     served from pdserve's prefix cache), Poisson arrivals. Each rate stops ``grace`` seconds after its last arrival
     (grace >= the longest latency a request can have and still meet the SLO, so cancelling never turns a good
     request bad); between rates pdserve is polled until every worker is idle with all KV blocks free (a leak
     is logged). Where a system's lowest rate misses 90% attainment, up to two halvings are added (fewer
     prompts, about ``--extra-run-s`` seconds each); where (a)/(b) still meet 90% at the top rate, one doubling.
  4. (d) runs the better mode's rates plus R2 = 2 x its capacity (the rate where its attainment crosses 90%,
     interpolated) with ``--overload-prompts`` (a longer overload shows whether a system keeps up); the
     better mode gets the same R2 run with admission on (a sweep run within 10% is reused only when it had
     as many prompts).
  5. (c) runs last, after Ray is shut down, so no Ray process shares the cores with it; ``--peer-rates`` and
     ``--peer-prompts`` place its ladder where it saturates (it saturates far below pdserve).

Reported (``summary.txt``, ``summary.json``): unloaded TTFT/TPOT per system; per rate attainment, goodput,
throughput, rejection rate; per system the goodput at 90% attainment = the highest measured rate whose
attainment >= 0.9 and the goodput measured there (plus the interpolated 90% crossing, for reference) with
the rejection rate beside it; ratio pdserve-better / transformers-serve (target >= 3x); at R2, admission-on
goodput as a fraction of its own peak (target >= 90%) against admission-off.
Definitions are the bench's (vLLM's): goodput = requests that completed within every SLO / run duration
(first send to last completion, so an overloaded run that drains a backlog also has a longer duration);
attainment = those / submitted (rejections and failures are misses).

Outputs in ``--out-dir`` (default benchmarks/results/goodput; ``--quick`` defaults to a temp dir):
``<label>.json`` (the bench's JSON, every rate's run merged), ``unloaded-<label>.json``, the bench's plots
for all systems (attainment_vs_rate, goodput_vs_rate, ttft_cdf, tpot_cdf) and for admission on vs off in
``admission/``, and the summary.

Usage (system c, the peer, needs pdserve's ``peer`` extra: ``.venv/bin/python -m pip install -e '.[peer]'``):
  python benchmarks/bench_goodput.py                      # the full session (~25 min on a quiet 2-core machine)
  python benchmarks/bench_goodput.py --rates 0.4,0.55,0.7,0.85,1.0 --num-prompts 40 --overload-prompts 96 \
      --peer-rates 0.2,0.25,0.3,0.35,0.4 --peer-prompts 24   # the recorded sessions (~43 min)
  python benchmarks/bench_goodput.py --quick              # tiny random model, a,b,d only, ~2 min: checks the script
  python benchmarks/bench_goodput.py --quick --systems a,b,c,d   # + transformers serve on a tiny random Llama
  python benchmarks/bench_goodput.py --systems a,b --rates 1,2,4 --num-prompts 30

Caveats: the pdserve router and the load generator share this process (and its GIL), as with
``pdserve bench --launch``; transformers serve's client is this process too. ``--quick`` numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["RAY_AUTH_MODE"] = "disabled"   # a local benchmark cluster: no token auth (before ray is imported)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # Ray workers

from benchmarks.results_file import write_run  # noqa: E402
from deploy.bench import report  # noqa: E402
from deploy.bench.cli import main as bench_main  # noqa: E402
from deploy.bench.dataset import arrival_offsets  # noqa: E402
from kvtransfer.rendezvous import free_port  # noqa: E402

logger = logging.getLogger("bench_goodput")

TARGET_ATTAINMENT = 0.9
TTFT_FACTOR, TPOT_FACTOR = 5.0, 3.0
RANDOM_VOCAB = (3, 512)          # the tiny random Llama: ids 0-2 are pad/bos/eos
LABELS = {"a": "pdserve-disagg", "b": "pdserve-colocated", "c": "transformers-serve"}


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float
    tpot_ms: float
    source: str

    def goodput_flags(self) -> list[str]:
        return ["--goodput", f"ttft:{self.ttft_ms:.1f}", f"tpot:{self.tpot_ms:.1f}"]

    def max_good_latency_s(self, max_output: int) -> float:
        return (self.ttft_ms + (max_output - 1) * self.tpot_ms) / 1000.0


@dataclass(slots=True)
class Unloaded:
    ttft_ms: float
    tpot_ms: float
    mean_output: float

    def e2e_ms(self) -> float:
        return self.ttft_ms + (self.mean_output - 1) * self.tpot_ms


@dataclass(slots=True)
class Target:
    """A running system as the bench sees it: its flags, and how to wait until it is idle."""

    flags: list[str]
    settle: Callable[[], None]
    send_slo: bool


@dataclass(slots=True)
class SystemResult:
    key: str
    label: str
    describe: str
    unloaded: Unloaded | None = None
    doc: dict | None = None          # the merged bench document
    notes: list[str] = field(default_factory=list)
    out_dir: Path | None = None      # where <label>.json is rewritten after every rate

    def add(self, doc: dict) -> None:
        self.doc = merge([self.doc, doc] if self.doc else [doc])
        if self.out_dir is not None:
            report.save_result(self.doc, self.out_dir / f"{self.label}.json")


@contextlib.contextmanager
def guarded(res: SystemResult) -> Iterator[None]:
    """One system failing must not lose the rest of a 25-minute session: log, note, go on."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        logger.exception("%s failed", res.label)
        res.notes.append(f"FAILED: {type(exc).__name__}: {str(exc)[:300]}")


# ---------------------------------------------------------------- systems


def pdserve_config(args, key: str, admission: bool, slo: SLO | None):
    from deploy.launcher import ClusterConfig
    from engine.config import EngineConfig

    kv = {"num_kv_blocks": args.num_kv_blocks}
    common = dict(model=None, random_model={"seed": 0} if args.quick else None, host="127.0.0.1", port=0,
                  admission=admission,
                  defaults={} if slo is None else {"ttft_s": slo.ttft_ms / 1e3, "tpot_s": slo.tpot_ms / 1e3})
    if key == "a":
        return ClusterConfig(mode="disaggregated", num_prefill=1, num_decode=1, cpus_per_worker=1.0,
                             threads_per_worker=1, prefill_engine=EngineConfig(max_num_batched_tokens=512, **kv),
                             decode_engine=EngineConfig(max_num_batched_tokens=512, **kv), **common)
    workers, threads = (2, 1) if args.colocated_layout == "2x1" else (1, 2)
    return ClusterConfig(mode="colocated", num_prefill=0, num_decode=workers, cpus_per_worker=float(threads),
                         threads_per_worker=threads,
                         decode_engine=EngineConfig(max_num_batched_tokens=args.chunk, **kv), **common)


def describe(args, key: str) -> str:
    if key == "a":
        return "1 prefill + 1 decode worker, 1 CPU / 1 thread each, budget 512, conditional disaggregation on"
    if key == "b":
        layout = "2 workers x 1 thread" if args.colocated_layout == "2x1" else "1 worker x 2 threads"
        return f"colocated, {layout}, chunked prefill (step budget {args.chunk})"
    return (f"transformers serve --continuous-batching --device cpu --dtype float32, {args.tserve_threads} threads, "
            f"--cb-num-blocks {args.cb_num_blocks} --cb-max-batch-tokens {args.cb_max_batch_tokens}")


@contextlib.contextmanager
def pdserve_session(args, key: str, admission: bool, slo: SLO | None) -> Iterator[Target]:
    from deploy.launcher import ClusterThread

    cluster = ClusterThread(pdserve_config(args, key, admission, slo))
    logger.info("starting pdserve %s (admission %s)", LABELS[key], "on" if admission else "off")
    try:
        port = cluster.start()
    except BaseException:
        cluster.stop()
        raise
    try:
        yield Target(["--backend", "grpc", "--address", f"127.0.0.1:{port}"], lambda: settle_pdserve(cluster),
                     send_slo=True)
    finally:
        cluster.stop()


def settle_pdserve(cluster, timeout_s: float = 60.0) -> None:
    """Wait until every worker holds no request and every KV block is free (a leak check between rates)."""
    from deploy.launcher import holds_anything

    deadline = time.monotonic() + timeout_s
    while True:
        reports = cluster.run(cluster.cluster.leak_reports())
        busy = {w: r for w, r in reports.items() if holds_anything(r)}
        if not busy:
            return
        if time.monotonic() > deadline:
            logger.warning("workers not idle %.0f s after the run: %s", timeout_s, busy)
            return
        time.sleep(0.5)


def transformers_command() -> str | None:
    """The ``transformers`` CLI: on PATH, or beside this interpreter (a venv not activated has
    its scripts there, not on PATH)."""
    for name in ("transformers", "transformers-cli"):
        beside = Path(sys.executable).parent / name
        found = shutil.which(name) or (str(beside) if beside.exists() else None)
        if found:
            return found
    return None


@contextlib.contextmanager
def transformers_session(args, model_dir: Path, log_path: Path) -> Iterator[Target]:
    exe = transformers_command()
    if exe is None:
        raise RuntimeError("transformers serve is not installed: install pdserve's peer extra "
                           "(.venv/bin/python -m pip install -e '.[peer]', i.e. transformers[serving])")
    port = free_port()
    threads = str(args.tserve_threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    cmd = [exe, "serve", str(model_dir), "--continuous-batching", "--device", "cpu", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--cb-num-blocks", str(args.cb_num_blocks),
           "--cb-max-batch-tokens", str(args.cb_max_batch_tokens), "--log-level", "warning"]
    logger.info("starting %s (log: %s)", " ".join(cmd), log_path)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path)
        flags = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
                 "--openai-flavor", "transformers", "--tokenizer", str(model_dir), "--model", str(model_dir)]
        yield Target(flags, lambda: time.sleep(2.0), send_slo=False)
    finally:
        stop_process(proc)
        log.close()
        wait_port_free(port)


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited ({proc.returncode}):\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"transformers serve not healthy after {timeout_s:.0f} s:\n{tail(log_path)}")


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM the server's own process group (it was started in a new session), SIGKILL after 20 s."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    logger.warning("transformers serve (pid %d) did not exit", proc.pid)


def wait_port_free(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.5)
    logger.warning("port %d still accepts connections %.0f s after the server was stopped", port, timeout_s)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def smollm2_dir() -> Path:
    from engine.model_loader import default_model_gguf, ensure_converted

    return Path(ensure_converted(default_model_gguf()))


def tiny_hf_dir(workdir: Path) -> Path:
    """--quick: a tiny random Llama saved as an HF directory with SmolLM2's tokenizer, for transformers serve."""
    import torch
    import transformers

    out = workdir / "tiny-llama"
    if (out / "config.json").is_file():
        return out
    src = smollm2_dir()
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


# ---------------------------------------------------------------- bench calls


class Bench:
    """Runs ``pdserve bench`` (``deploy.bench.cli.main``) one rate at a time and merges the documents."""

    def __init__(self, args, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.calls = 0

    def workload_flags(self, target: Target, seed_offset: int = 0) -> list[str]:
        a = self.args
        flags = ["--dataset", "random", "--input-len", str(a.input_len), "--output-len", str(a.output_len),
                 "--range-ratio", str(a.range_ratio), "--seed", str(a.seed + seed_offset)]
        if a.quick and "grpc" in target.flags:
            flags += ["--vocab-low", str(RANDOM_VOCAB[0]), "--vocab-high", str(RANDOM_VOCAB[1])]
        return flags

    def call(self, target: Target, label: str, extra: list[str]) -> dict:
        self.calls += 1
        path = self.tmp / f"call-{self.calls}.json"
        argv = target.flags + extra + ["--label", label, "--save-result", str(path)]
        logger.info("pdserve bench %s", " ".join(argv))
        rc = bench_main(argv)
        if not path.is_file():
            raise RuntimeError(f"pdserve bench exited {rc} without a result ({label})")
        doc = report.load_result(path)
        doc["config"]["argv"] = argv
        return doc

    def unloaded(self, target: Target, label: str) -> tuple[Unloaded, dict]:
        n = self.args.unloaded_prompts
        extra = self.workload_flags(target, seed_offset=1000) + [
            "--num-prompts", str(n), "--num-warmups", "1", "--request-rate", "inf", "--max-concurrency", "1"]
        doc = self.call(target, f"{label}-unloaded", extra)
        target.settle()
        outs = [o for o in doc["runs"][0]["outcomes"] if o["status"] == "ok"]
        if not outs:
            raise RuntimeError(f"{label}: no unloaded request completed")
        ttft = statistics.median(o["ttft_s"] * 1e3 for o in outs)
        tpots = [(o["e2e_s"] - o["ttft_s"]) / (o["output_len"] - 1) * 1e3 for o in outs if o["output_len"] > 1]
        mean_out = statistics.fmean(o["output_len"] for o in outs)
        return Unloaded(ttft, statistics.median(tpots) if tpots else math.nan, mean_out), doc

    def rate(self, target: Target, label: str, rate: float, num_prompts: int, slo: SLO, warmups: int) -> dict:
        """One rate; stops ``grace`` after the last arrival (grace covers any request that can still be good)."""
        a = self.args
        offsets = arrival_offsets(num_prompts, rate, seed=a.seed)
        max_out = math.floor(a.output_len * (1 + a.range_ratio))
        grace = max(a.min_grace_s, 1.5 * slo.max_good_latency_s(max_out) + 5.0)
        extra = self.workload_flags(target, seed_offset=rate_seed_offset(rate)) + [
            "--num-prompts", str(num_prompts), "--num-warmups", str(warmups), "--request-rate", f"{rate:g}",
            "--max-duration-s", f"{offsets[-1] + grace:.1f}", *slo.goodput_flags()]
        if target.send_slo:
            extra.append("--send-slo")
        doc = self.call(target, label, extra)
        target.settle()
        return doc


def rate_seed_offset(rate: float) -> int:
    """Each rate's prompts are its own (the same for every system): a rate that reused another's
    would find them in pdserve's prefix cache, all but the first rate would be served from it, and
    the peer has none. Even offsets far from the unloaded run's (+1000); ``pdserve bench`` seeds
    its warm-ups with the seed + 1."""
    return 100_000 + 2 * round(rate * 1000)


def sweep(bench: Bench, target: Target, res: SystemResult, rates: list[float], slo: SLO, *,
          extend_down: bool, extend_up: bool, prompts: dict[float, int] | None = None) -> None:
    """The rates in order on one running system, then halvings/doublings as the results ask for.
    ``prompts``: a different number of prompts at some rates (the overload run)."""
    warmups = 2
    for rate in sorted(rates):
        n = (prompts or {}).get(rate, bench.args.num_prompts)
        res.add(bench.rate(target, res.label, rate, n, slo, warmups=warmups))
        warmups = 0
    for _ in range(2 if extend_down else 0):
        lowest = min(r["request_rate"] for r in res.doc["runs"])
        if attainment(res.doc, lowest) >= TARGET_ATTAINMENT:
            break
        rate = round_rate(lowest / 2)
        res.notes.append(f"added {rate:g} req/s: {lowest:g} missed {TARGET_ATTAINMENT:.0%} attainment")
        res.add(bench.rate(target, res.label, rate, extra_prompts(bench.args, rate), slo, 0))
    if extend_up:
        top = max(r["request_rate"] for r in res.doc["runs"])
        if attainment(res.doc, top) >= TARGET_ATTAINMENT:
            rate = round_rate(top * 2)
            res.notes.append(f"added {rate:g} req/s: {top:g} still met {TARGET_ATTAINMENT:.0%} attainment")
            res.add(bench.rate(target, res.label, rate, bench.args.num_prompts, slo, 0))


def extra_prompts(args, rate: float) -> int:
    """Fewer prompts at an added low rate, so it takes about ``--extra-run-s`` seconds."""
    return max(min(args.num_prompts, 10), min(args.num_prompts, math.ceil(rate * args.extra_run_s)))


def merge(docs: list[dict]) -> dict:
    runs = sorted((r for d in docs for r in d["runs"]), key=lambda r: r["request_rate"])
    base = docs[0]
    config = dict(base["config"])
    config["argv_per_call"] = [d["config"].get("argv") for d in docs]
    return report.result_document(base["label"], config, base["server"], runs)


def round_rate(rate: float) -> float:
    """Two significant digits: readable tick labels, reproducible rate lists."""
    if rate <= 0:
        return rate
    digits = 1 - math.floor(math.log10(rate))
    return round(rate, digits)


# ---------------------------------------------------------------- reading results


def run_at(doc: dict, rate: float, tolerance: float = 1e-9) -> dict | None:
    for run in doc["runs"]:
        if abs(run["request_rate"] - rate) <= tolerance * max(1.0, rate):
            return run
    return None


def attainment(doc: dict, rate: float) -> float:
    run = run_at(doc, rate)
    value = run["summary"]["slo_attainment"] if run else None
    return -1.0 if value is None else value


def curve(doc: dict) -> list[dict]:
    rows = []
    for run in sorted(doc["runs"], key=lambda r: r["request_rate"]):
        s = run["summary"]
        if math.isinf(run["request_rate"]):
            continue
        rows.append({"rate": run["request_rate"], "submitted": s["submitted"], "good": s["good"],
                     "attainment": s["slo_attainment"] or 0.0, "goodput": s["goodput"] or 0.0,
                     "throughput": s["request_throughput"], "rejected": s["rejected"], "failed": s["failed"],
                     "rejection_rate": s["rejected"] / s["submitted"] if s["submitted"] else 0.0,
                     "p99_ttft_ms": s["p99_ttft_ms"], "p99_tpot_ms": s["p99_tpot_ms"],
                     "mean_prompt_tokens": s["total_input_tokens"] / s["completed"] if s["completed"] else math.nan})
    return rows


def at_target(doc: dict) -> dict:
    """Goodput at 90% attainment: the highest measured rate with attainment >= 0.9 and the goodput there;
    plus the 90% crossing interpolated linearly towards the next (failing) rate, for reference."""
    rows = curve(doc)
    ok = [i for i, r in enumerate(rows) if r["attainment"] >= TARGET_ATTAINMENT]
    out: dict[str, Any] = {"rate": None, "goodput": 0.0, "rejection_rate": None, "crossing_rate": None,
                           "crossing_goodput": None, "peak_goodput": max((r["goodput"] for r in rows), default=0.0),
                           "lowest_rate": rows[0]["rate"] if rows else None,
                           "overloaded_in_sweep": bool(rows) and rows[-1]["attainment"] < TARGET_ATTAINMENT}
    if not ok:
        return out
    i = ok[-1]
    row = rows[i]
    out.update(rate=row["rate"], goodput=row["goodput"], rejection_rate=row["rejection_rate"])
    if i + 1 < len(rows):
        nxt = rows[i + 1]
        frac = (row["attainment"] - TARGET_ATTAINMENT) / (row["attainment"] - nxt["attainment"])
        out["crossing_rate"] = row["rate"] + frac * (nxt["rate"] - row["rate"])
        out["crossing_goodput"] = row["goodput"] + frac * (nxt["goodput"] - row["goodput"])
    return out


def capacity(doc: dict) -> float | None:
    """Where attainment crosses 90%: interpolated; the top rate when it never drops; None when never met."""
    t = at_target(doc)
    return t["crossing_rate"] or t["rate"]


def nearest_run(doc: dict, rate: float, within: float = 0.10) -> dict | None:
    runs = [r for r in doc["runs"] if not math.isinf(r["request_rate"])]
    best = min(runs, key=lambda r: abs(r["request_rate"] - rate), default=None)
    return best if best is not None and abs(best["request_rate"] - rate) <= within * rate else None


# ---------------------------------------------------------------- the session


def choose_slo(args, unloaded: dict[str, Unloaded]) -> SLO:
    if args.slo:
        ttft, tpot = (float(x) for x in args.slo.split(","))
        return SLO(ttft, tpot, "given with --slo")
    if not unloaded:
        raise SystemExit("no unloaded pdserve numbers to derive the SLO from: run a or b, or pass --slo")
    key = args.slo_base or min(unloaded, key=lambda k: unloaded[k].e2e_ms())
    base = unloaded[key]
    return SLO(round(TTFT_FACTOR * base.ttft_ms, 1), round(TPOT_FACTOR * base.tpot_ms, 1),
               f"{LABELS[key]} unloaded: TTFT {base.ttft_ms:.1f} ms x {TTFT_FACTOR:g}, "
               f"TPOT {base.tpot_ms:.2f} ms x {TPOT_FACTOR:g}")


def choose_rates(args, unloaded: dict[str, Unloaded], slo: SLO) -> tuple[list[float], str]:
    if args.rates:
        return sorted(args.rates), "given with --rates"
    base = unloaded.get(args.slo_base) if args.slo_base else None
    base = base or (min(unloaded.values(), key=Unloaded.e2e_ms) if unloaded else None)
    ttft_ms = base.ttft_ms if base else slo.ttft_ms / TTFT_FACTOR
    cap = 1000.0 / ttft_ms
    rates = sorted({round_rate(cap * m) for m in args.rate_multipliers})
    return rates, (f"capacity estimate 1 / unloaded TTFT = {cap:.2f} req/s x "
                   f"{','.join(f'{m:g}' for m in args.rate_multipliers)}")


def plan_seconds(args, rates: list[float], num_systems: int, slo: SLO) -> float:
    max_out = math.floor(args.output_len * (1 + args.range_ratio))
    per_system = sum(args.num_prompts / r for r in rates) + len(rates) * min(
        0.5 * max(args.min_grace_s, 1.5 * slo.max_good_latency_s(max_out) + 5), 20) + 30
    return per_system * num_systems


def run_session(args) -> list[SystemResult]:
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_goodput-"))
    bench = Bench(args, tmp)
    systems = args.systems
    results: dict[str, SystemResult] = {}
    unloaded: dict[str, Unloaded] = {}
    ray_up = False
    try:
        # (a)/(b) are measured unloaded for the SLO even when only (c) or (d) is swept, unless --slo is given
        pd_keys = [k for k in ("a", "b") if k in systems or not args.slo]
        if pd_keys or "d" in systems:
            import ray

            ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=args.worker_logs)
            ray_up = True
        # 1. unloaded (a), (b): the SLO base
        for key in pd_keys:
            res = results[key] = SystemResult(key, LABELS[key], describe(args, key), out_dir=out_dir)
            with guarded(res), pdserve_session(args, key, admission=True, slo=None) as target:
                res.unloaded, doc = bench.unloaded(target, res.label)
                report.save_result(doc, out_dir / f"unloaded-{res.label}.json")
                unloaded[key] = res.unloaded
                logger.info("%s unloaded: TTFT %.1f ms, TPOT %.2f ms", res.label, res.unloaded.ttft_ms,
                            res.unloaded.tpot_ms)
        slo = choose_slo(args, unloaded)
        rates, rates_why = choose_rates(args, unloaded, slo)
        args.slo_obj, args.rates_used, args.rates_why = slo, rates, rates_why
        print(f"\nSLO: TTFT <= {slo.ttft_ms:.1f} ms, TPOT <= {slo.tpot_ms:.1f} ms ({slo.source})")
        print(f"rates: {', '.join(f'{r:g}' for r in rates)} req/s ({rates_why}); {args.num_prompts} prompts each")
        print(f"planned sweep time ~{plan_seconds(args, rates, len(systems), slo) / 60:.0f} min "
              "(+ starts, added rates, transformers serve's drains)\n", flush=True)
        # 2. sweeps (a), (b)
        for key in ("b", "a"):
            if key in systems:
                res = results[key]
                with guarded(res), pdserve_session(args, key, admission=True, slo=slo) as target:
                    sweep(bench, target, res, rates, slo, extend_down=True, extend_up=True)
        # 3. (d): the better mode without admission, and the better mode at 2x its capacity
        if "d" in systems:
            try:
                run_no_admission(args, bench, results, rates, slo, out_dir)
            except RuntimeError as exc:
                logger.error("(d) skipped: %s", exc)
        if ray_up:
            import ray

            ray.shutdown()
            ray_up = False
        # 4. (c) transformers serve, alone on the machine
        if "c" in systems:
            res = results["c"] = SystemResult("c", LABELS["c"], describe(args, "c"), out_dir=out_dir)
            with guarded(res):
                model_dir = tiny_hf_dir(tmp) if args.quick else smollm2_dir()
                res.notes.append(f"model dir {model_dir}")
                with transformers_session(args, model_dir, tmp / "transformers-serve.log") as target:
                    res.unloaded, doc = bench.unloaded(target, res.label)
                    report.save_result(doc, out_dir / f"unloaded-{res.label}.json")
                    peer_rates = args.peer_rates or rates
                    sweep(bench, target, res, peer_rates, slo, extend_down=True, extend_up=False,
                          prompts={r: args.peer_prompts for r in peer_rates})
    finally:
        if ray_up:
            import ray

            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return [results[k] for k in ("a", "b", "c", "d") if k in results]


def better_mode(args, results: dict[str, SystemResult]) -> str:
    if args.better:
        return args.better
    swept = [k for k in ("a", "b") if k in results and results[k].doc is not None]
    if not swept:
        raise RuntimeError("(d) needs (a) or (b) swept in this session, or --better a|b")
    return max(swept, key=lambda k: (at_target(results[k].doc)["goodput"], at_target(results[k].doc)["peak_goodput"]))


def run_no_admission(args, bench: Bench, results: dict[str, SystemResult], rates: list[float], slo: SLO,
                     out_dir: Path) -> None:
    """(d): the better mode's rates with admission off, plus R2 = 2x the better mode's capacity with
    ``--overload-prompts`` prompts; the better mode gets the same R2 run with admission on (a sweep
    run there is reused only when it had as many prompts)."""
    key = better_mode(args, results)
    on = results.get(key)
    on_doc = on.doc if on else None
    d_rates = {r["request_rate"] for r in on_doc["runs"]} if on_doc else set(rates)
    cap = capacity(on_doc) if on_doc else None
    prompts: dict[float, int] = {}
    if cap is not None:
        args.capacity = cap
        args.r2 = overload_rate(args, on_doc, cap)
        d_rates.add(args.r2)
        prompts[args.r2] = args.overload_prompts
    res = results["d"] = SystemResult("d", f"{LABELS[key]}-noadmit", describe(args, key) + ", admission OFF",
                                      out_dir=out_dir)
    with guarded(res), pdserve_session(args, key, admission=False, slo=slo) as target:
        sweep(bench, target, res, sorted(d_rates), slo, extend_down=False, extend_up=False, prompts=prompts)
    if args.r2 is not None and run_at(on_doc, args.r2) is None:
        on.notes.append(f"added {args.r2:g} req/s = 2x its capacity ({args.overload_prompts} prompts), "
                        "for the admission on/off comparison")
        with guarded(on), pdserve_session(args, key, admission=True, slo=slo) as target:
            on.add(bench.rate(target, on.label, args.r2, args.overload_prompts, slo, warmups=2))


def overload_rate(args, on_doc: dict, cap: float) -> float:
    """2x capacity: a sweep run within 10% of it when it had ``--overload-prompts`` prompts,
    else a rate of its own (nudged off any sweep rate, so runs stay distinct by rate)."""
    near = nearest_run(on_doc, 2 * cap)
    if near and near["summary"]["submitted"] == args.overload_prompts:
        return near["request_rate"]
    rate = round_rate(2 * cap)
    while run_at(on_doc, rate) is not None:
        rate = round_rate(rate * 1.05)
    return rate


# ---------------------------------------------------------------- summary


def fmt(x: float | None, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def summarize(args, results: list[SystemResult]) -> tuple[str, dict]:
    slo: SLO = args.slo_obj
    quick = "  (--quick: tiny random model, numbers meaningless)" if args.quick else ""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"bench_goodput  {time.strftime('%Y-%m-%dT%H:%M:%S')}{quick}",
        f"machine: {platform.node()}, {os.cpu_count()} cores, load avg now {load}",
        f"workload: random ids, input {args.input_len} +-{args.range_ratio:.0%}, output {args.output_len} "
        f"+-{args.range_ratio:.0%} (EOS ignored), Poisson arrivals, seed {args.seed}, "
        f"{args.num_prompts} prompts per rate",
        f"SLO (one for all): TTFT <= {slo.ttft_ms:.1f} ms, TPOT <= {slo.tpot_ms:.1f} ms  <- {slo.source}",
        f"rates: {', '.join(f'{r:g}' for r in args.rates_used)} req/s  <- {args.rates_why}",
        f"transformers serve: rates {', '.join(f'{r:g}' for r in (args.peer_rates or args.rates_used))} req/s, "
        f"{args.peer_prompts} prompts per rate; 2x-capacity runs: {args.overload_prompts} prompts",
        "goodput@90 = goodput at the highest measured rate with attainment >= 90% (crossing = interpolated 90% point)",
        "",
    ]
    data: dict[str, Any] = {"slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms}, "slo_source": slo.source,
                            "rates": args.rates_used, "systems": {}}
    for res in results:
        lines.append(f"[{res.key}] {res.label}: {res.describe}")
        if res.unloaded:
            lines.append(f"    unloaded (median of {args.unloaded_prompts}, one at a time): "
                         f"TTFT {res.unloaded.ttft_ms:.1f} ms, TPOT {res.unloaded.tpot_ms:.2f} ms")
        lines += [f"    note: {n}" for n in res.notes]
        entry: dict[str, Any] = {"label": res.label, "describe": res.describe, "notes": res.notes,
                                 "unloaded": dataclasses.asdict(res.unloaded) if res.unloaded else None}
        if res.doc is None:
            lines.append("    (no sweep)")
            data["systems"][res.key] = entry
            continue
        lines.append(f"    {'rate':>7} {'sent':>5} {'good':>5} {'attain':>7} {'goodput':>8} {'req/s':>7} {'rej%':>6} "
                     f"{'fail':>5} {'p99 TTFT':>9} {'p99 TPOT':>9} {'prompt':>7}")
        rows = curve(res.doc)
        for r in rows:
            lines.append(f"    {r['rate']:>7g} {r['submitted']:>5} {r['good']:>5} {r['attainment']:>7.3f} "
                         f"{r['goodput']:>8.3f} {r['throughput']:>7.3f} {r['rejection_rate'] * 100:>5.1f}% "
                         f"{r['failed']:>5} "
                         f"{fmt(r['p99_ttft_ms'], '9.0f', '        -')} {fmt(r['p99_tpot_ms'], '9.1f', '        -')} "
                         f"{fmt(r['mean_prompt_tokens'], '7.0f', '      -')}")
        t = at_target(res.doc)
        if t["rate"] is None:
            lines.append(f"    goodput@90: none (no rate down to {t['lowest_rate']:g} req/s reached 90% attainment)")
        else:
            crossing = (f"; 90% crossing ~{t['crossing_rate']:.2f} req/s, goodput ~{t['crossing_goodput']:.3f}"
                        if t["crossing_rate"] else "; never below 90% in the sweep")
            lines.append(f"    goodput@90: {t['goodput']:.3f} req/s at {t['rate']:g} req/s, rejection rate "
                         f"{t['rejection_rate']:.1%}{crossing}; peak goodput {t['peak_goodput']:.3f}")
        entry.update(curve=rows, at_90=t)
        data["systems"][res.key] = entry
        lines.append("")
    lines += comparisons(args, {r.key: r for r in results}, data)
    return "\n".join(lines) + "\n", data


def comparisons(args, results: dict[str, SystemResult], data: dict) -> list[str]:
    lines = ["comparisons:"]
    swept = {k: r for k, r in results.items() if r.doc is not None}
    pd_keys = [k for k in ("a", "b") if k in swept]
    if not pd_keys:
        return lines + ["  (no pdserve sweep)"]
    best = better_mode(args, results) if not args.better else args.better
    best_t = at_target(swept[best].doc) if best in swept else None
    if best_t:
        lines.append(f"  pdserve better mode: {results[best].label} (goodput@90 {best_t['goodput']:.3f} req/s)")
        data["better"] = best
    if best_t and "c" in swept:
        c_t = at_target(swept["c"].doc)
        if best_t["goodput"] == 0 and c_t["goodput"] == 0:
            ratio = math.nan
            lines.append("  goodput@90 pdserve / transformers serve: undefined (neither reached 90% attainment; "
                         f"lowest rates {best_t['lowest_rate']:g} / {c_t['lowest_rate']:g} req/s)")
        elif c_t["goodput"] > 0:
            ratio = best_t["goodput"] / c_t["goodput"]
            lines.append(f"  goodput@90 pdserve / transformers serve = {best_t['goodput']:.3f} / {c_t['goodput']:.3f} "
                         f"= {ratio:.2f}x   target >= 3x   {'PASS' if ratio >= 3 else 'MISS'}")
        else:
            ratio = math.inf
            lines.append(f"  goodput@90 pdserve / transformers serve = {best_t['goodput']:.3f} / 0 (transformers serve "
                         f"never reached 90% attainment, lowest rate {c_t['lowest_rate']:g} req/s) = inf")
        data["ratio_vs_transformers"] = ratio
    r2 = getattr(args, "r2", None)
    if best in swept and "d" in swept and r2 is not None:
        on, off = swept[best].doc, swept["d"].doc
        run_on, run_off = run_at(on, r2), run_at(off, r2)
        peak_on = at_target(on)["peak_goodput"]
        peak_off = at_target(off)["peak_goodput"]
        if run_on and run_off:
            g_on, g_off = run_on["summary"]["goodput"], run_off["summary"]["goodput"]
            frac_on = g_on / peak_on if peak_on else math.nan
            frac_off = g_off / peak_off if peak_off else math.nan
            cap = getattr(args, "capacity", None)
            lines.append(f"  at 2x capacity: {r2:g} req/s (capacity = where {results[best].label}'s attainment crosses "
                         f"90%{f' ~{cap:.2f} req/s' if cap else ''}; {run_on['summary']['submitted']} prompts):")
            lines.append(f"    admission on : goodput {g_on:.3f} = {frac_on:.0%} of its peak {peak_on:.3f}, "
                         f"rejected {run_on['summary']['rejected']}/{run_on['summary']['submitted']}   "
                         f"target >= 90% of peak   {'PASS' if frac_on >= 0.9 else 'MISS'}")
            lines.append(f"    admission off: goodput {g_off:.3f} = {frac_off:.0%} of its peak {peak_off:.3f}, "
                         f"attainment {run_off['summary']['slo_attainment']:.3f}")
            lines.append(f"    on / off = {g_on / g_off:.2f}x" if g_off
                         else "    on / off = inf (off: no good request)")
            data["overload_2x"] = {"rate": r2, "on_goodput": g_on, "on_peak": peak_on, "off_goodput": g_off,
                                   "off_peak": peak_off}
    elif "d" in swept:
        why = ("the better mode was not swept in this session" if best not in swept
               else f"{results[best].label} reached {TARGET_ATTAINMENT:.0%} attainment at no rate: no capacity")
        lines.append(f"  admission on/off at 2x capacity: not computed ({why})")
    return lines


def jsonable(x: Any) -> Any:
    """JSON has no NaN/inf: NaN -> null, inf -> "inf" (as the bench's own files)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else "inf"
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny random model, tiny sweep: checks the script (~2 min)")
    p.add_argument("--systems", default=None, help="comma list of a,b,c,d (default a,b,c,d; --quick: a,b,d)")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x.strip()], default=None,
                   help="req/s for every system (default: from the unloaded numbers)")
    p.add_argument("--rate-multipliers", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="x estimated capacity (default 0.25,0.5,1,1.5,2,3; --quick 0.5,1,2)")
    p.add_argument("--num-prompts", type=int, default=None, help="per rate (default 40; --quick 8)")
    p.add_argument("--unloaded-prompts", type=int, default=None, help="default 6; --quick 3")
    p.add_argument("--overload-prompts", type=int, default=None,
                   help="prompts of the 2x-capacity runs, admission on and off (default: --num-prompts); more "
                        "prompts make a longer overload, where a system without admission keeps falling behind")
    p.add_argument("--peer-rates", type=lambda s: [float(x) for x in s.split(",") if x.strip()], default=None,
                   help="rates for transformers serve (default: the same rates as pdserve)")
    p.add_argument("--peer-prompts", type=int, default=None, help="prompts per rate for transformers serve "
                   "(default: --num-prompts)")
    p.add_argument("--input-len", type=int, default=None, help="default 256; --quick 64")
    p.add_argument("--output-len", type=int, default=None, help="default 64; --quick 16")
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", default=None, metavar="TTFT_MS,TPOT_MS", help="fix the SLO instead of deriving it")
    p.add_argument("--slo-base", choices=("a", "b"), default=None,
                   help="derive the SLO from this mode's unloaded numbers (default: the lower unloaded latency)")
    p.add_argument("--better", choices=("a", "b"), default=None, help="the mode (d) runs without admission")
    p.add_argument("--colocated-layout", choices=("2x1", "1x2"), default="2x1", help="workers x threads for (b)")
    p.add_argument("--chunk", type=int, default=256, help="(b)'s step token budget (chunked prefill)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="per pdserve worker, 16 tokens each (default 1024)")
    p.add_argument("--tserve-threads", type=int, default=2)
    p.add_argument("--cb-num-blocks", type=int, default=64, help="transformers serve KV blocks (256 tokens each)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=512)
    p.add_argument("--extra-run-s", type=float, default=90.0, help="length of an added low-rate run")
    p.add_argument("--min-grace-s", type=float, default=10.0)
    p.add_argument("--worker-logs", action="store_true", help="show Ray workers' logs")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(systems="a,b,d" if quick else "a,b,c,d", rate_multipliers=[0.5, 1, 2] if quick else
                    [0.25, 0.5, 1, 1.5, 2, 3], num_prompts=8 if quick else 40, unloaded_prompts=3 if quick else 6,
                    input_len=64 if quick else 256, output_len=16 if quick else 64,
                    num_kv_blocks=256 if quick else 1024,
                    out_dir=Path(tempfile.gettempdir()) / "bench_goodput-quick" if quick
                    else ROOT / "benchmarks" / "results" / "goodput")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.overload_prompts = args.overload_prompts or args.num_prompts
    args.peer_prompts = args.peer_prompts or args.num_prompts
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(args.systems) - set("abcd"):
        p.error(f"--systems takes a,b,c,d; got {args.systems}")
    if args.slo and len(args.slo.split(",")) != 2:
        p.error("--slo takes TTFT_MS,TPOT_MS")
    if "d" in args.systems and not ({"a", "b"} & set(args.systems)) and not args.better:
        p.error("(d) without (a) or (b): pass --better a|b")
    args.r2 = args.capacity = None   # set once (d) knows the better mode's capacity
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    results = run_session(args)
    docs = [r.doc for r in results if r.doc is not None]
    from deploy.bench.plots import plot_results

    written = plot_results(docs, args.out_dir) if docs else []
    by_key = {r.key: r for r in results}
    if "d" in by_key and by_key["d"].doc is not None:
        best = better_mode(args, by_key)
        if best in by_key and by_key[best].doc is not None:
            written += plot_results([by_key[best].doc, by_key["d"].doc], args.out_dir / "admission")
    text, data = summarize(args, results)
    text += f"\nsession wall time {(time.monotonic() - started) / 60:.1f} min\n"
    print("\n" + text)
    write_run(args.out_dir / "summary.txt", text)   # earlier runs' summaries kept below this one
    (args.out_dir / "summary.json").write_text(json.dumps(jsonable(data), indent=1))
    for path in written:
        print(f"wrote {path}")
    print(f"wrote {args.out_dir / 'summary.txt'}, summary.json, and the per-system JSON in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
