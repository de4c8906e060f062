"""The engine's host work per decode step (everything but the forward), this checkout against a
baseline revision, in alternating subprocesses.

Why: with decode steps replayed as CUDA graphs the host's share of a step is serial with the GPU's
(H100, SmolLM2 twin, bf16, batch 64: 12% of a 5.06 ms step, benchmarks/results/cuda/), and it
grows as the GPU's share shrinks. It is the same Python on CPU: scheduling, loading the graph
inputs, sampling, advancing the requests, the step's deltas. Measured here with a one-layer,
64-wide Llama (the forward costs little) and 64 requests decoding through the decode graphs'
static-buffer path (``GraphMode.UNCAPTURED``: the GPU's per-step host path without a graph), as
the wall time of ``LLMEngine.step`` minus the time inside ``ModelRunner.execute``.

    python benchmarks/bench_step_host.py [--baseline REV] [--rounds 4] [--steps 300] [--out FILE]

The baseline runs from a temporary git worktree; rounds alternate baseline / this checkout.
Prints a table and writes it (results_file.write_run) to benchmarks/results/step_host.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

# Runs in the subprocess, against whichever checkout PYTHONPATH names first.
MEASURE = r'''
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
import transformers
from engine.config import EngineConfig, GraphMode
from engine.engine import LLMEngine
from engine.model_loader import random_model
from engine.types import RequestSpec, SamplingParams
batch, steps = int(sys.argv[1]), int(sys.argv[2])
loaded = random_model(transformers.LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=1,
    intermediate_size=128, max_position_embeddings=8192, num_attention_heads=4, num_key_value_heads=2), seed=0)
engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=8192, block_size=16, max_num_seqs=batch,
    max_num_batched_tokens=8192, decode_graphs=GraphMode.UNCAPTURED))
for i in range(batch):   # contexts 100-290 tokens, every request outlives the run
    engine.add_request(RequestSpec(f"r{i}", tuple(range(5, 105 + 3 * i)), SamplingParams(max_tokens=steps + 50, ignore_eos=True)))
while any(r.num_computed_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
    engine.step()
for _ in range(20):
    engine.step()
inside = [0.0]
execute = engine.runner.execute
def timed(inputs):
    t = time.perf_counter(); out = execute(inputs); inside[0] += time.perf_counter() - t; return out
engine.runner.execute = timed
host = []
for _ in range(steps):
    inside[0] = 0.0
    t = time.perf_counter()
    result = engine.step()
    host.append(time.perf_counter() - t - inside[0])
    assert len(result.deltas) == batch
print(json.dumps({"median_us": statistics.median(host) * 1e6, "p90_us": statistics.quantiles(host, n=10)[-1] * 1e6}))
'''


def measure(checkout: Path, batch: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(batch), str(steps)], cwd=checkout, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="cc1be7e", help="git revision to compare against")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_host.txt"))
    args = ap.parse_args()
    this = "this checkout"
    base = f"baseline {args.baseline}"
    runs: dict[str, list[dict]] = {base: [], this: []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for _ in range(args.rounds):
                runs[base].append(measure(tree, args.batch, args.steps))
                runs[this].append(measure(ROOT, args.batch, args.steps))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    base_us = statistics.median(r["median_us"] for r in runs[base])
    lines = [f"bench_step_host  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"host work per decode step (LLMEngine.step minus ModelRunner.execute), {args.batch} requests decoding "
             f"through the decode graphs' static-buffer path (UNCAPTURED), 1-layer 64-wide Llama, 1 thread; "
             f"{args.rounds} alternating rounds of {args.steps} steps, a subprocess each",
             "", f"{'checkout':<26}{'median us':>10}{'per request':>13}{'rounds (median us)':>40}{'vs baseline':>13}"]
    for name, rs in runs.items():
        med = statistics.median(r["median_us"] for r in rs)
        rounds = ", ".join(f"{r['median_us']:.0f}" for r in rs)
        lines.append(f"{name:<26}{med:>10.0f}{med / args.batch:>12.2f} {rounds:>40}{base_us / med:>12.2f}x")
    text = "\n".join(lines)
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
