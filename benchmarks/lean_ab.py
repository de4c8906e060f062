"""Decode forward at batch 64: engine.lean_forward against the model's own call, interleaved A B B A.

The engine is benchmarks/profile_decode.py's (SmolLM2-135M, decode role, random KV, scattered
blocks, contexts uniform in [--ctx-min, --ctx-max]); with --tiny, a random Llama of SmolLM2's
depth (30 layers) and batch but 64 wide: the same Python and op dispatch around much cheaper
kernels, so the gain stands out of the noise. After --warmup steps, one decode step's inputs are
kept and its forward (ModelRunner.execute; the KV writes rewrite the same slots) runs --rounds
times A B B A (A: the model's call, B: the lean forward; only the runner's ``lean`` changes).
Per call: wall time, process CPU time (every thread's; at 2 threads it includes the OpenMP
workers' spinning) and main-thread CPU time (where the Python runs). Prints medians and the
median paired gain (A - B within a round) with its interquartile range: robust to a round that
other work stopped or crowded. Run it niced beside other work and read the CPU figures.

    python -m benchmarks.lean_ab [--threads 1] [--rounds 20] [--tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.profile_decode import BATCH, build_engine  # noqa: E402

CLOCKS = ("wall", "cpu", "main_thread_cpu")
ORDER = ("model_call", "lean", "lean", "model_call")


def tiny_engine():
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.model_loader import random_model
    from engine.types import RequestSpec, SamplingParams

    loaded = random_model(num_hidden_layers=30, hidden_size=64, intermediate_size=128)
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=1024, max_num_seqs=BATCH, max_num_batched_tokens=4096))
    for i in range(BATCH):
        engine.add_request(RequestSpec(f"r{i}", tuple(range(5, 25 + i)), SamplingParams(max_tokens=64, ignore_eos=True)))
    engine.step()   # every prompt in one prefill step
    return engine


def decode_inputs(engine):
    """The inputs of the engine's next (decode) step, as the runner prepared them."""
    kept = []
    prepare = engine.runner.prepare
    engine.runner.prepare = lambda out: kept.append(prepare(out)) or kept[-1]
    engine.step()
    engine.runner.prepare = prepare
    assert not kept[0].metadata.prefills and kept[0].input_ids.shape[1] == BATCH
    return kept[0]


def timed(call) -> dict[str, float]:
    t = (time.perf_counter(), time.process_time(), time.thread_time())
    call()
    return dict(zip(CLOCKS, (time.perf_counter() - t[0], time.process_time() - t[1], time.thread_time() - t[2])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ctx-min", type=int, default=64)
    ap.add_argument("--ctx-max", type=int, default=640)
    ap.add_argument("--tiny", action="store_true", help="30 layers 64 wide: the Python and dispatch alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = tiny_engine() if args.tiny else build_engine(args.ctx_min, args.ctx_max, args.warmup + 2)
    runner, lean = engine.runner, engine.runner.lean
    assert lean is not None, "lean forward refused or switched off (PDSERVE_LEAN_FORWARD)"
    for _ in range(args.warmup):
        engine.step()
    inputs = decode_inputs(engine)
    variants = {"model_call": None, "lean": lean}
    rounds = []
    for _ in range(args.rounds):
        row = {name: [] for name in variants}
        for name in ORDER:
            runner.lean = variants[name]
            row[name].append(timed(lambda: runner.execute(inputs)))
        rounds.append({name: {c: sum(s[c] for s in row[name]) / 2 for c in CLOCKS} for name in variants})
    shape = "tiny 30-layer Llama" if args.tiny else "SmolLM2-135M"
    print(f"decode forward, batch {BATCH}, {shape}, {args.threads} thread(s), {2 * args.rounds} calls each (ms):")
    for c in CLOCKS:
        a = statistics.median(r["model_call"][c] for r in rounds) * 1e3
        b = statistics.median(r["lean"][c] for r in rounds) * 1e3
        gains = [(r["model_call"][c] - r["lean"][c]) * 1e3 for r in rounds]
        q1, gain, q3 = statistics.quantiles(gains, n=4)
        print(f"  {c:16s} median model_call {a:7.2f}  lean {b:7.2f}   paired gain median {gain:6.2f} "
              f"(IQR {q1:.2f}..{q3:.2f}) = {gain / a:5.1%}")


if __name__ == "__main__":
    main()
