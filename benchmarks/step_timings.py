"""Real engine step timings for the simulated cluster: what ``benchmarks/sim_workers.py``'s step
times are fitted to.

Runs the real engine (SmolLM2-135M-Instruct, float32, CPU, ``--threads`` torch threads) in this
process on a seeded batch of short prompts whose output lengths are spread out, so the running
batch shrinks step by step from ``--batch`` to 1 and the steps cover every batch size and a range
of KV lengths (decode steps), plus the prompts' chunked prefill steps. Every step's ``StepTiming``
(the same record workers report to the router) is written as JSON; ``load`` reads it back.

Run: ``python benchmarks/step_timings.py`` (~1-2 min on 2 cores), writes
benchmarks/results/router_scale_steps.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.types import StepTiming  # noqa: E402  (torch-free)

DEFAULT_PATH = ROOT / "benchmarks" / "results" / "router_scale_steps.json"


def collect(batch: int, prompt_len: int, max_output: int, threads: int, seed: int = 0) -> list[StepTiming]:
    import torch

    from engine.config import EngineConfig, EngineRole
    from engine.engine import LLMEngine
    from engine.model_loader import load_model
    from engine.types import RequestSpec, SamplingParams

    torch.set_num_threads(threads)   # deliberate: the machine is shared
    loaded = load_model(None)
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=2048, num_kv_blocks=2048,
                          role=EngineRole.COLOCATED, enable_prefix_caching=False)
    engine = LLMEngine(loaded, config)
    rng = random.Random(seed)
    vocab = loaded.model.config.vocab_size
    for i in range(batch):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(prompt_len + rng.randrange(prompt_len)))
        out = 1 + (i * max_output) // batch
        engine.add_request(RequestSpec(f"r{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True)))
    steps = []
    while engine.has_work():
        result = engine.step()
        if result.timing is not None:
            steps.append(result.timing)
    return steps


def save(steps: list[StepTiming], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "steps": [dataclasses.asdict(s) for s in steps]}, indent=1))


def load(path: Path = DEFAULT_PATH) -> list[StepTiming]:
    return [StepTiming(**s) for s in json.loads(Path(path).read_text())["steps"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=112)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-output", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=DEFAULT_PATH)
    args = p.parse_args()
    steps = collect(args.batch, args.prompt_len, args.max_output, args.threads)
    meta = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.machine(),
            "load_avg": os.getloadavg(), "model": "SmolLM2-135M-Instruct float32 cpu", "threads": args.threads,
            "batch": args.batch, "prompt_len": args.prompt_len, "max_output": args.max_output}
    save(steps, args.out, meta)
    print(f"{len(steps)} steps -> {args.out}")


if __name__ == "__main__":
    main()
