"""The benchmark workloads, generated deterministically so every run and every system sees the same requests.

W64: 64 requests, all submitted at once, random token ids (so no prefix caching can help), prompt
lengths uniform in [64, 512], output lengths uniform in [64, 128], greedy, EOS ignored.

Draw order (fixed, part of the definition): one ``random.Random(seed)``; for each request in turn
draw its prompt length, then its prompt ids one by one, then its output length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOKEN_ID_RANGE = (1000, 40000)   # half-open; clear of SmolLM2's special ids and inside its 49152 vocab


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int   # exact output length: EOS is ignored


def make_w64(
    num_requests: int = 64,
    seed: int = 1234,
    prompt_range: tuple[int, int] = (64, 512),
    output_range: tuple[int, int] = (64, 128),
) -> list[WorkloadRequest]:
    """W64 (or a prefix-compatible variant): ranges are inclusive, ids from TOKEN_ID_RANGE."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_range)
        prompt = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(prompt_len)]
        requests.append(WorkloadRequest(prompt, rng.randint(*output_range)))
    return requests


def summarize(workload: list[WorkloadRequest]) -> dict[str, int]:
    return {
        "num_requests": len(workload),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
        "output_tokens": sum(r.max_tokens for r in workload),
        "max_prompt_len": max(len(r.prompt_token_ids) for r in workload),
        "max_output_len": max(r.max_tokens for r in workload),
    }


if __name__ == "__main__":
    print(summarize(make_w64()))
