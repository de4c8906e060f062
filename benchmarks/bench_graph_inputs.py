"""Host time to load a decode step into the CUDA-graph static buffer (engine.cuda_graphs
``DecodeGraphPool.prepare``), this revision against a baseline revision's, interleaved in one process.

Why: with decode steps replayed as graphs, the host's per-step work is serial with the GPU's
(H100, SmolLM2 twin, bf16, batch 64: 12% of a 5.06 ms step, benchmarks/results/cuda/). Loading the
inputs was its largest single part: every row's scalars and block table written one numpy
assignment at a time. This measures ``prepare`` alone, on CPU (the static buffer's host side is the
same code on a GPU; only the final copy differs), for ``--steps`` consecutive decode steps of
``--batch`` requests whose contexts grow by a token a step (a block boundary now and then).

    python benchmarks/bench_graph_inputs.py [--baseline REV] [--batch 64] [--steps 400] [--out FILE]

Prints a table and writes it (results_file.write_run) to benchmarks/results/graph_inputs.txt.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.results_file import write_run  # noqa: E402
from engine import cuda_graphs  # noqa: E402
from engine.kv_manager import KVCacheManager  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402
from engine.types import RequestSpec, SamplingParams  # noqa: E402

BLOCK = 16


def baseline_module(rev: str):
    """engine/cuda_graphs.py as of ``rev``, imported under another name beside this revision's."""
    source = subprocess.run(["git", "show", f"{rev}:engine/cuda_graphs.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "cuda_graphs_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("cuda_graphs_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_pool(module, batch: int, num_blocks: int):
    plan = module.GraphPlan(capture=False, batch_sizes=module.capture_sizes(batch),
                            widths=module.width_ladder(2048 // BLOCK), null_block=num_blocks)
    cache = torch.zeros(1, 2, num_blocks + 1, BLOCK, 1, 2)
    return module.DecodeGraphPool(plan, lambda *a: None, cache, BLOCK)


def workload(batch: int, seed: int = 0):
    """``batch`` requests with contexts spread over [64, 1024) tokens, their KV allocated."""
    rng = random.Random(seed)
    kv = KVCacheManager(batch * 80, BLOCK)
    requests = []
    for i in range(batch):
        req = Request(RequestSpec(f"r{i}", tuple(rng.randrange(3, 30000) for _ in range(rng.randrange(64, 1024))),
                                  SamplingParams(max_tokens=1000)))
        req.num_computed_tokens = req.num_tokens - 1
        kv.allocate_slots(req.req_id, req.num_tokens)
        requests.append(req)
    return kv, requests


def advance(kv: KVCacheManager, requests: list[Request]) -> None:
    for r in requests:
        r.append_output(7, None)
        r.num_computed_tokens += 1
        kv.allocate_slots(r.req_id, r.num_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="384079f", help="revision whose cuda_graphs.py is the peer")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "graph_inputs.txt"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    pools = {"this revision": make_pool(cuda_graphs, args.batch, args.batch * 80),
             f"baseline {args.baseline}": make_pool(baseline_module(args.baseline), args.batch, args.batch * 80)}
    kv, requests = workload(args.batch)
    times: dict[str, list[float]] = {name: [] for name in pools}
    for step in range(args.steps):
        out = SchedulerOutput([ScheduledRequest(r, 1, True, kv.block_tables[r.req_id]) for r in requests], len(requests))
        names = list(pools) if step % 2 == 0 else list(reversed(pools))   # alternate who goes first
        loaded = {}
        for name in names:
            start = time.perf_counter()
            inputs = pools[name].prepare(out)
            times[name].append(time.perf_counter() - start)
            loaded[name] = pools[name]._rows[: inputs.batch, : cuda_graphs.TABLE + inputs.width]   # what the graph reads
        first, *others = loaded.values()
        assert all(torch.equal(first, o) for o in others), f"step {step}: the two revisions loaded different rows"
        advance(kv, requests)
    base = statistics.median(times[f"baseline {args.baseline}"])
    lines = [f"bench_graph_inputs  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"DecodeGraphPool.prepare, decode steps at batch {args.batch}, contexts 64-1024 growing a token a step, "
             f"block {BLOCK}, {args.steps} steps interleaved; rows of both revisions compared equal every step",
             "", f"{'revision':<24}{'median us':>10}{'p90 us':>10}{'vs baseline':>13}"]
    for name, ts in times.items():
        med, p90 = statistics.median(ts), statistics.quantiles(ts, n=10)[-1]
        lines.append(f"{name:<24}{med * 1e6:>10.1f}{p90 * 1e6:>10.1f}{base / med:>12.2f}x")
    text = "\n".join(lines)
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
