"""What prompt logprobs cost (engine/prompt_logprobs.py): the time to the first token of one
prompt alone in the engine, without them, with ``prompt_logprobs=0`` (each prompt token's
logprob and rank) and with ``prompt_logprobs=5`` (and its 5 most likely), against the peer:
Hugging Face's way to score a prompt (one forward over it, logits at every position, their
log-softmax, the prompt tokens' gathered). Interleaved round by round in one process, the
median of ``--rounds``; the values are checked against the peer's each round.

    python benchmarks/bench_prompt_logprobs.py [--prompt-len 512] [--rounds 5] [--threads 1] [--out FILE]

The embedded SmolLM2-135M in float32 (vocabulary 49,152): the lm_head at every prompt
position (~7 GFLOP a 512-token prompt beside the forward's ~70) and a log-softmax over those
rows is what they add. Writes the table (results_file.write_run) to
benchmarks/results/prompt_logprobs.txt.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.results_file import write_run  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.types import RequestSpec, SamplingParams  # noqa: E402

VARIANTS = {"no prompt logprobs": None, "prompt_logprobs=0": 0, "prompt_logprobs=5": 5}


def engine_run(engine: LLMEngine, prompt: tuple[int, ...], n: int | None, tag: str):
    """Seconds to the first token, and the prompt logprobs it carried."""
    spec = RequestSpec(tag, prompt, SamplingParams(max_tokens=1, prompt_logprobs=n))
    start = time.perf_counter()
    engine.add_request(spec)
    got = None
    while engine.has_work():
        for delta in engine.step().deltas:
            got = delta.prompt_logprobs or got
    return time.perf_counter() - start, got


def hf_run(model, prompt: tuple[int, ...]) -> tuple[float, list[float]]:
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return time.perf_counter() - start, lp.tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/prompt_logprobs.txt"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model()
    reference = __import__("copy").deepcopy(loaded.model)   # HF's own attention: the engine swaps the model's
    reference.config._attn_implementation = "sdpa"
    engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=256 << 20, max_num_batched_tokens=args.prompt_len,
                                            enable_prefix_caching=False))
    prompt = tuple((i * 7919) % 40000 + 100 for i in range(args.prompt_len))
    times: dict[str, list[float]] = {name: [] for name in [*VARIANTS, "HF forward + log_softmax"]}
    worst = 0.0
    for r in range(args.rounds + 1):   # round 0 warms up
        for name, n in VARIANTS.items():
            seconds, got = engine_run(engine, prompt, n, f"{r}-{name}")
            if r:
                times[name].append(seconds)
        seconds, ref = hf_run(reference, prompt)
        worst = max(worst, max(abs(a - b) for a, b in zip(got.logprobs, ref)))
        if r:
            times["HF forward + log_softmax"].append(seconds)
    base = statistics.median(times["no prompt logprobs"])
    lines = [f"bench_prompt_logprobs  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"machine: {platform.processor() or platform.machine()}, {args.threads} torch thread(s); "
             f"model: SmolLM2-135M-Instruct float32; one {args.prompt_len}-token prompt, max_tokens 1; "
             f"median of {args.rounds} interleaved rounds",
             "", f"{'':28s} {'TTFT ms':>9s} {'vs without':>11s}"]
    for name, values in times.items():
        m = statistics.median(values)
        lines.append(f"{name:28s} {m * 1e3:9.1f} {m / base:10.2f}x")
    lines += ["", f"prompt logprobs vs the peer's: max |difference| {worst:.2e} over {args.prompt_len - 1} tokens"]
    text = "\n".join(lines)
    print(text)
    write_run(args.out, text)


if __name__ == "__main__":
    main()
