"""Turns each sampled request's logits row into its next token.

Greedy rows take one batched argmax. Random rows use temperature, top-k and top-p with a
generator seeded from (request seed, output position): the same seed gives the same output
whatever shares the batch, and a request recomputed after preemption redraws the same tokens.
"""

from __future__ import annotations

import torch

from engine.request import Request

_SEED_STRIDE = 1_000_003


def sample(logits: torch.Tensor, requests: list[Request], seeds: dict[str, int]) -> list[tuple[int, float | None]]:
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    for row, request in enumerate(requests):
        if not request.sampling.greedy:
            seed = seeds[request.req_id] * _SEED_STRIDE + request.num_generated
            tokens[row] = _sample_row(logits[row], request, seed % (2**63))
    want_logprobs = any(r.sampling.logprobs for r in requests)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0] if want_logprobs else None
    token_list = tokens.tolist()
    return [
        (token_list[i], float(logprobs[i]) if logprobs is not None and r.sampling.logprobs else None)
        for i, r in enumerate(requests)
    ]


def _sample_row(row: torch.Tensor, request: Request, seed: int) -> int:
    params = request.sampling
    row = row / params.temperature
    if params.top_k and params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the first token always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    generator = torch.Generator(device=row.device).manual_seed(seed)
    return int(torch.multinomial(probs, 1, generator=generator))
