"""What structured output costs a step (engine/grammar.py's masks, applied by
engine/logit_adjust.py): the batched call the sampler makes for every guided row at once, against
the same grammars as per-request logits processors (the peer: llguidance's mask computed and
applied row by row, the shape of a Hugging Face ``LogitsProcessor`` or of vLLM V0's
per-request processors), interleaved in one process on the same matcher states, answers compared
every call; and both against the decode step they ride in, for scale.

    python -m benchmarks.bench_grammar [--calls 30] [--threads 1] [--out FILE]

SmolLM2's tokenizer (49,152 tokens: the mask's cost grows with the vocabulary and with how many
tokens the grammar's current lexeme admits), a JSON schema of an object with a string, a number
and an enum field, and 1, 8 and 64 guided rows, each row's matcher at a different point of a
document that follows the schema (inside a string admits most of the vocabulary; between fields,
few tokens). 1 torch thread by default (a cluster worker's setting); the batched call's llguidance
executor takes as many threads as torch has (they are idle while the sampler runs). Prints a table and writes it
(results_file.write_run) to benchmarks/results/grammar.txt.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import llguidance
import numpy as np
import torch

from benchmarks.interleaved import interleaved_medians, report
from engine import logit_adjust
from engine.grammar import Grammars, grammar_of
from engine.model_loader import load_model
from engine.request import Request
from engine.types import GuideKind, RequestSpec, SamplingParams, StructuredOutput

ROWS = (1, 8, 64)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 200}, "age": {"type": "integer"},
    "mood": {"enum": ["happy", "sad", "curious"]}, "notes": {"type": "string"}},
    "required": ["name", "age", "mood", "notes"], "additionalProperties": False}
DOCUMENT = json.dumps({"name": "Ada Lovelace, of the Analytical Engine", "age": 36, "mood": "curious",
                       "notes": "She wrote the first program for a machine that did not yet exist."})


def guided_requests(grammars: Grammars, tokenizer, rows: int) -> list[Request]:
    """``rows`` requests whose outputs are prefixes of DOCUMENT, spread over its length."""
    guide = StructuredOutput(GuideKind.JSON, json.dumps(SCHEMA))
    doc = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    out = []
    for i in range(rows):
        request = Request(RequestSpec(f"g{i}", (1, 2, 3), SamplingParams(max_tokens=len(doc) + 1, structured_output=guide)))
        request.grammar = grammars.matcher(guide)
        for token in doc[: (i * 7919) % len(doc)]:
            request.append_output(token, None)
        out.append(request)
    return out


class PerRequestProcessor:
    """The peer: one llguidance matcher per request, its mask computed and applied to its row alone."""

    def __init__(self, ll_tokenizer, request: Request) -> None:
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar_of(request.sampling.structured_output), log_level=0)
        assert self.matcher.consume_tokens(request.output_token_ids)

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        return row.masked_fill(torch.from_numpy(bits[: row.shape[-1]] == 0), float("-inf"))


def measure(logits: torch.Tensor, reqs: list[Request], peers: list[PerRequestProcessor],
            calls: int) -> tuple[float, float]:
    """Median seconds per step: (batched, per request)."""
    rows = list(range(len(reqs)))
    medians = interleaved_medians({
        "batched": lambda: logit_adjust.adjust(logits[rows], reqs),
        "per request": lambda: torch.stack([p(logits[i]) for i, p in enumerate(peers)])}, calls)
    return medians["batched"], medians["per request"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the executor takes as many)")
    ap.add_argument("--out", default="benchmarks/results/grammar.txt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model()
    vocab = loaded.model.config.vocab_size
    grammars = Grammars(loaded.tokenizer, vocab, loaded.eos_token_ids)
    start = time.perf_counter()
    ll_tokenizer = grammars._tokenizer_for_llguidance()
    tokenizer_s = time.perf_counter() - start
    lines = [f"bench_grammar  {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"machine: {platform.machine()}, {args.threads} torch thread(s), torch {torch.__version__}, llguidance "
             f"{llguidance.get_version() if hasattr(llguidance, 'get_version') else '?'}; SmolLM2's vocabulary "
             f"{vocab:,}; a JSON schema of 4 fields, each row at another point of a {len(DOCUMENT)}-character document",
             f"the tokenizer in llguidance's form, built once per worker on the first guided request: {tokenizer_s * 1e3:.0f} ms",
             "", f"{'rows':>4s} {'batched ms':>11s} {'per request ms':>15s} {'ratio':>6s} {'batched per row ms':>19s}"]
    for rows in ROWS:
        reqs = guided_requests(grammars, loaded.tokenizer, rows)
        peers = [PerRequestProcessor(ll_tokenizer, r) for r in reqs]
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
        batched, per_request = measure(logits, reqs, peers, args.calls)
        lines.append(f"{rows:4d} {batched * 1e3:11.2f} {per_request * 1e3:15.2f} {per_request / batched:5.2f}x "
                     f"{batched / rows * 1e3:19.3f}")
    report(lines, "guided requests", args.out)


if __name__ == "__main__":
    main()
