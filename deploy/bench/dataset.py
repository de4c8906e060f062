"""Seeded synthetic requests and their arrival times: same seed, same benchmark.

Draw order (part of the definition, so results stay comparable across versions): one
``random.Random(seed)``; for each request in turn its prompt length, then its prompt ids one by
one, then its output length. Arrivals use their own generator (seeded ``"arrivals:<seed>"``), so
changing the rate rescales the same draws instead of drawing new ones.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DEFAULT_VOCAB = (1000, 40000)   # half-open; clear of SmolLM2's special ids and inside its 49152 vocab
DATASETS = ("random", "fixed")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    idx: int
    prompt_token_ids: list[int]
    output_len: int                 # exact: backends ask the server to ignore EOS
    prompt_text: str | None = None  # set when a tokenizer decoded the ids (text-only servers)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of ``uniform[length*(1-r), length*(1+r)]``, never below 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    return low, max(low, math.floor(length * (1.0 + range_ratio)))


def make_requests(
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    range_ratio: float = 0.0,
    vocab: tuple[int, int] = DEFAULT_VOCAB,
    seed: int = 0,
) -> list[BenchRequest]:
    """``random``: lengths uniform in their ranges; ``fixed``: exactly ``input_len``/``output_len``.
    Token ids are uniform in the half-open ``vocab`` range either way."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if input_len < 1 or output_len < 1 or num_prompts < 0:
        raise ValueError("input_len and output_len must be >= 1, num_prompts >= 0")
    low, high = vocab
    if not 0 <= low < high:
        raise ValueError(f"vocab range must be 0 <= low < high, got {vocab}")
    ratio = range_ratio if dataset == "random" else 0.0
    in_range, out_range = length_range(input_len, ratio), length_range(output_len, ratio)
    rng = random.Random(seed)
    requests = []
    for idx in range(num_prompts):
        prompt_len = rng.randint(*in_range)
        ids = [rng.randrange(low, high) for _ in range(prompt_len)]
        requests.append(BenchRequest(idx, ids, rng.randint(*out_range)))
    return requests


def with_text(requests: list[BenchRequest], tokenizer) -> list[BenchRequest]:
    """Decode each prompt for servers that take text only. Re-tokenized on the server, random
    ids rarely round-trip exactly: the prompt length the server reports is the one recorded."""
    return [BenchRequest(r.idx, r.prompt_token_ids, r.output_len,
                         tokenizer.decode(r.prompt_token_ids, skip_special_tokens=True))
            for r in requests]


def arrival_offsets(num: int, rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent: the first at 0, then gaps drawn
    from gamma(shape=burstiness, mean=1/rate) (burstiness 1: Poisson arrivals; below 1 burstier,
    above 1 more regular), as vLLM does. ``rate`` inf: everything at 0."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(f"arrivals:{seed}")
    scale = 1.0 / (rate * burstiness)   # gamma mean = shape * scale = 1 / rate
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets
