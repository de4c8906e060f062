"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's logprob given the tokens
before it, and with ``sampling.prompt_logprobs = N > 0`` its position's N most likely tokens.

Life cycle: a request that asks owes them from its arrival until its first output token. Each
prefill chunk's plan names the positions whose logits it must keep (``positions``: position p's
logits score prompt token p + 1); the model runner keeps those rows after the sampling rows;
``record`` turns them into the request's lists, each position once (a retried step or a chunk
recomputed after preemption appends nothing twice); the first delta of the request (or the
prefill worker's first token) carries the result, and the request owes nothing after that.
Such a request reads nothing from the prefix cache: a cached block's positions are never
computed, so their logits do not exist (vLLM does the same). The logprobs are the model's,
before any logit adjustment or temperature, as the output's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.types import PromptLogprobs

if TYPE_CHECKING:
    from engine.request import Request


def owed(request: Request) -> bool:
    """This engine owes them (``Request.prompt_logprobs`` is not None) and has not sent them:
    no output token yet."""
    return request.prompt_logprobs is not None and not request.output_token_ids


def positions(request: Request, start: int, n: int) -> range:
    """Positions in ``[start, start + n)`` whose logits score a prompt token not yet recorded."""
    if not owed(request):
        return range(0)
    return range(max(start, len(request.prompt_logprobs)), min(start + n, request.num_prompt_tokens - 1))


ROWS_AT_ONCE = 256   # rows at a time: a float32 copy of them stays ~50 MB at a 49k vocabulary


def record(spans: list[tuple[Request, range]], logits: torch.Tensor) -> None:
    """``logits``: one row per position of ``spans``, in order. Each position's logprob, rank
    (and top N) goes to its request (``Request.add_prompt_logprob``)."""
    targets = torch.tensor([r.spec.prompt_token_ids[p + 1] for r, span in spans for p in span],
                           dtype=torch.long, device=logits.device)
    k = max(r.sampling.prompt_logprobs for r, _ in spans)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, logits.shape[0], ROWS_AT_ONCE):
        lp = torch.log_softmax(logits[start : start + ROWS_AT_ONCE].float(), dim=-1)
        own = lp.gather(1, targets[start : start + ROWS_AT_ONCE, None])
        # vLLM's rank: 1 + the tokens more likely. Summed as int32: torch sums a bool tensor
        # into int64 otherwise, twice the time (30 vs 64 ms for 256 rows of 49,152).
        ranks += ((lp > own).sum(dim=-1, dtype=torch.int32) + 1).tolist()
        chosen += torch.nan_to_num(own[:, 0], nan=float("-inf")).tolist()
        if k:
            values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
            top_values += torch.nan_to_num(values, nan=float("-inf")).tolist()
            top_ids += ids.tolist()
    i = 0
    for request, span in spans:
        n = request.sampling.prompt_logprobs
        for p in span:
            top = tuple(zip(top_ids[i][:n], top_values[i][:n])) if n else None
            request.add_prompt_logprob(p, chosen[i], ranks[i], top)
            i += 1


def result(request: Request) -> PromptLogprobs | None:
    """What the request's first delta carries: None unless it asked and this engine computed them."""
    if request.prompt_logprobs is None:
        return None
    return PromptLogprobs(request.spec.prompt_token_ids, tuple(request.prompt_logprobs),
                          tuple(request.prompt_ranks), tuple(request.prompt_top_logprobs))
