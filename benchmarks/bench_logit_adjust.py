"""What a step's logit adjustments cost (engine/logit_adjust.py: min_tokens, logit_bias, the
repetition, frequency and presence penalties): the batched call the sampler makes (every
adjusted row at once) against the same function called row by row (the peer: one call per
request, as a per-request logits processor runs), interleaved in one process, same rows,
answers compared every call; and both against the decode step they ride in (the figure in
results/engine_w64.txt, for scale).

    python benchmarks/bench_logit_adjust.py [--vocab 49152] [--context 512,256] [--calls 40] [--out FILE]

Rows of standard-normal logits; each request holds ``--context`` prompt and output tokens drawn
uniformly from the vocabulary (so few repeat: the most places touched); 1, 8 and 64 adjusted
rows; repetition alone, frequency + presence, and all four with a 10-token bias; 1 torch thread
(a cluster worker's setting). Timings include the copy of the rows the sampler makes. Prints a
table and writes it (results_file.write_run) to benchmarks/results/logit_adjust.txt.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.interleaved import interleaved_medians, report  # noqa: E402
from engine import logit_adjust  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.types import RequestSpec, SamplingParams  # noqa: E402

ROWS = (1, 8, 64)
KINDS = {
    "repetition_penalty": dict(repetition_penalty=1.2),
    "frequency + presence": dict(frequency_penalty=0.5, presence_penalty=0.5),
    "all four (+10 biases)": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5,
                                  logit_bias=tuple((t, 1.0) for t in range(10))),
}


def requests(rows: int, vocab: int, prompt: int, output: int, params: dict) -> list[Request]:
    rng = random.Random(rows)
    out = []
    for i in range(rows):
        request = Request(RequestSpec(f"r{i}", tuple(rng.randrange(vocab) for _ in range(prompt)),
                                      SamplingParams(max_tokens=output + 1, **params)))
        for _ in range(output):
            request.append_output(rng.randrange(vocab), None)
        out.append(request)
    return out


def measure(logits: torch.Tensor, reqs: list[Request], calls: int) -> tuple[float, float]:
    """Median seconds per step: (batched, row by row)."""
    rows = list(range(len(reqs)))
    medians = interleaved_medians({
        "batched": lambda: logit_adjust.adjust(logits[rows], reqs),
        "row by row": lambda: torch.cat([logit_adjust.adjust(logits[[i]], [r]) for i, r in enumerate(reqs)])}, calls)
    return medians["batched"], medians["row by row"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152, help="logits per row (SmolLM2: 49,152)")
    ap.add_argument("--context", default="512,256", help="prompt,output tokens per request")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "logit_adjust.txt"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompt, output = (int(x) for x in args.context.split(","))
    lines = [f"bench_logit_adjust  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"machine: {platform.machine()}, 1 torch thread, torch {torch.__version__}; vocabulary {args.vocab:,}; "
             f"{prompt} prompt + {output} output tokens a request; medians of {args.calls} calls, interleaved",
             "", f"{'adjustment':24s} {'rows':>4s} {'batched ms':>11s} {'row by row ms':>14s} {'ratio':>6s}"]
    for kind, params in KINDS.items():
        for rows in ROWS:
            logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows))
            batched, by_row = measure(logits, requests(rows, args.vocab, prompt, output, params), args.calls)
            lines.append(f"{kind:24s} {rows:4d} {batched * 1e3:11.2f} {by_row * 1e3:14.2f} {by_row / batched:5.2f}x")
    report(lines, "requests that ask for an adjustment", args.out)


if __name__ == "__main__":
    main()
