"""A request's logit adjustments before its token is chosen (greedy or sampled): its structured
output's grammar (every token that would leave it at -inf: ``engine.grammar``), vLLM's
``allowed_token_ids`` (every other token at -inf), ``bad_words`` (their tokens at -inf where the
output would complete one) and ``min_tokens`` (EOS and the stop token ids
held at -inf until that many tokens are out), OpenAI's ``logit_bias``, ``frequency_penalty`` and
``presence_penalty``, and the ``repetition_penalty`` of Hugging Face and vLLM, in vLLM's order:
the grammar, the allowed set, the bad words, the hold and the bias first, then the repetition penalty (every
token in the prompt or the output: a positive logit divided by it, a negative one multiplied),
then the frequency penalty (times the token's count in the output) and the presence penalty
(once per token in the output), each subtracted.

Stateless: every step reads the request's tokens as they stand (``Request.all_token_ids``, and
its output, which reaches back into the prompt of a migrated request; a grammar's matcher is a
cache of that output), so a request recomputed
after preemption, resumed on another worker, or whose first token a prefill worker chose gets
the same adjustments it would have had on one engine. The arithmetic is Hugging Face's
processors' (the same float32 operations on the same values), so greedy output with them equals
``generate``'s. Only the rows whose request asks for an adjustment come here, all of a step's in
one call (the sampler's); the others keep the batch's argmax. Cost on one CPU thread, a
49,152-token vocabulary and 768 tokens of context a row (benchmarks/bench_logit_adjust.py): all
four at once ~0.3 ms for one row, 8-15 ms for 64, 2-2.5x less than the same work row by row.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from engine import grammar
from engine.request import Request


def applies(request: Request) -> bool:
    """Whether this request's row is adjusted this step (``Request.adjusts_logits`` is what the
    parameters ask for at all; ``min_tokens`` only until that many tokens are out)."""
    return request.adjusts_logits or (request.sampling.min_tokens > 0 and request.num_generated < request.sampling.min_tokens)


def adjust(rows: torch.Tensor, requests: Sequence[Request], eos_token_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """``rows`` (one finite logits row per request, a copy the caller owns) adjusted in place and
    returned. Each adjustment is a few batched gathers and scatters at the (row, token) places it
    touches, whatever the number of rows: no per-row kernel launches on a GPU, no dense
    (rows x vocabulary) pass. ``eos_token_ids``: the model's, which ``min_tokens`` holds back
    (unless the request ignores EOS)."""
    vocab, flat = rows.shape[-1], rows.view(-1)

    def at(items: Iterable[tuple[int, Sequence[int]]]) -> torch.Tensor:
        """Flat indices of (row, each of its tokens)."""
        items = [(i, tokens) for i, tokens in items if tokens]
        if not items:
            return torch.empty(0, dtype=torch.long, device=rows.device)
        # numpy reads a list of ints ~8x faster than torch.tensor (tens of thousands a step at batch 64).
        ids = np.fromiter(itertools.chain.from_iterable(t for _, t in items), dtype=np.int64)
        if ids.min() < 0 or ids.max() >= vocab:   # a flat index past its row would be another row's
            raise IndexError(f"a token id outside the logits' vocabulary of {vocab}")
        tokens = torch.from_numpy(ids).to(rows.device)
        if len(items) == 1:
            return tokens + items[0][0] * vocab
        row_of = torch.repeat_interleave(torch.tensor([i for i, _ in items], device=rows.device),
                                         torch.tensor([len(t) for _, t in items], device=rows.device))
        return row_of * vocab + tokens

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=rows.dtype, device=rows.device)

    guided = [(i, r) for i, r in enumerate(requests) if r.grammar is not None]
    if guided:   # what the grammar does not allow after the output so far to -inf, in place
        for _, r in guided:
            r.grammar.sync(r.generated_tail(r.num_generated))
        allowed = grammar.allowed_rows([r.grammar for _, r in guided], vocab, torch.get_num_threads())
        blocked = torch.from_numpy(~allowed).to(rows.device)
        if len(guided) == len(requests):
            rows.masked_fill_(blocked, float("-inf"))
        else:
            for k, (i, _) in enumerate(guided):
                rows[i].masked_fill_(blocked[k], float("-inf"))
    limited = [(i, r.sampling.allowed_token_ids) for i, r in enumerate(requests) if r.sampling.allowed_token_ids]
    if limited:   # every other token of those rows to -inf
        idx = at(limited)
        kept = flat[idx]
        rows[[i for i, _ in limited]] = float("-inf")
        flat[idx] = kept
    banned = at((i, _banned(r)) for i, r in enumerate(requests) if r.sampling.bad_words_token_ids)
    flat[banned] = float("-inf")
    held = at((i, _held(r, eos_token_ids)) for i, r in enumerate(requests) if r.num_generated < r.sampling.min_tokens)
    flat[held] = float("-inf")
    biased = [(i, r.sampling.logit_bias) for i, r in enumerate(requests) if r.sampling.logit_bias]
    if biased:   # token ids unique per request (validated): one add each
        flat[at((i, [t for t, _ in bias]) for i, bias in biased)] += per_row([b for _, bias in biased for _, b in bias])
    repeated = [(i, r) for i, r in enumerate(requests) if r.sampling.repetition_penalty != 1.0]
    if repeated:
        idx = at((i, r.all_token_ids) for i, r in repeated).unique()
        penalty = torch.ones(len(requests), dtype=rows.dtype, device=rows.device)
        penalty[[i for i, _ in repeated]] = per_row([r.sampling.repetition_penalty for _, r in repeated])
        penalty, seen = penalty[idx // vocab], flat[idx]
        flat[idx] = torch.where(seen < 0, seen * penalty, seen / penalty)
    counted = [(i, r) for i, r in enumerate(requests) if r.sampling.frequency_penalty or r.sampling.presence_penalty]
    if counted:
        idx, counts = at((i, r.generated_tail(r.num_generated)) for i, r in counted).unique(return_counts=True)
        frequency, presence = (torch.zeros(len(requests), dtype=rows.dtype, device=rows.device) for _ in range(2))
        frequency[[i for i, _ in counted]] = per_row([r.sampling.frequency_penalty for _, r in counted])
        presence[[i for i, _ in counted]] = per_row([r.sampling.presence_penalty for _, r in counted])
        row_of = idx // vocab
        flat[idx] -= frequency[row_of] * counts.to(rows.dtype)
        flat[idx] -= presence[row_of]
    return rows


def _banned(request: Request) -> list[int]:
    """vLLM's bad words now: a one-token word's token; a longer word's last token where the output
    (not the prompt, as vLLM: a migrated request's streamed tokens count) ends with its others."""
    banned = set()
    for word in request.sampling.bad_words_token_ids:
        before = len(word) - 1
        if before <= request.num_generated and (not before or tuple(request.generated_tail(before)) == word[:-1]):
            banned.add(word[-1])
    return sorted(banned)


def _held(request: Request, eos_token_ids: frozenset[int]) -> list[int]:
    params = request.sampling
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids))
