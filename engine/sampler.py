"""Turns each sampled request's logits row into its next token, or a per-row failure.

Greedy rows (temperature below ``GREEDY_TEMPERATURE``) take one batched argmax
(``engine.greedy_argmax``: a C++ kernel on CPU); a request's logit bias and penalties
(``engine.logit_adjust``) apply to a copy of its row first, greedy or not. Logprobs are the
model's, before those and before temperature (vLLM's default). Random rows use
temperature, min-p, top-k and top-p (vLLM's order) with a generator seeded from (request seed, output position): the
same seed gives the same output whatever shares the batch, and a request recomputed after
preemption redraws the same tokens.

Numerics: everything runs in float32 on a copy of the row with NaN and ±inf logits made finite
(NaN and +inf become the row's extremes, so a poisoned logit can neither win by accident nor
turn the softmax into NaN); the temperature is at least ``GREEDY_TEMPERATURE`` here, so
``logits / temperature`` stays finite; top-k / top-p never mask the argmax, so something is always
left to sample. A row that still fails (a row of all NaN, an exception) becomes a
``RowFailure``: only that request fails, the rest of the batch goes on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine import grammar
from engine.grammar import GrammarError
from engine.greedy_argmax import argmax_if_finite
from engine import logit_adjust
from engine.request import Request
from engine.types import TopLogprobs

logger = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003


class SamplingError(RuntimeError):
    """One row of logits cannot be sampled (e.g. the forward produced only NaN for it)."""


@dataclass(frozen=True, slots=True)
class RowFailure:
    """This request's row could not be sampled; ``message`` goes to the worker log and the delta;
    ``field``: the sampling field to blame where the request's own constraints left no token
    (the client's mistake, ``TokenDelta.error_field``), None where the failure is ours."""

    message: str
    field: str | None = None


# (token id, its logprob when requested, the position's top logprobs when requested)
Sampled = tuple[int, float | None, TopLogprobs | None] | RowFailure


def sample(logits: torch.Tensor, requests: list[Request], seeds: dict[str, int],
           eos_token_ids: frozenset[int] = frozenset()) -> list[Sampled]:
    raw = logits.float()
    tokens, all_finite = argmax_if_finite(raw)
    logits = raw if all_finite else _finite(raw)
    if not all_finite:
        tokens = logits.argmax(dim=-1).tolist()
    failed: dict[int, RowFailure] = {}
    adjusted = _adjusted_rows(logits, requests, eos_token_ids, failed)
    for row, request in enumerate(requests):
        if row in failed or (all_finite and request.sampling.greedy and row not in adjusted):
            continue   # most rows: the argmax stands
        try:
            if not all_finite and not bool(torch.isfinite(raw[row]).any()):
                raise SamplingError("the forward produced no finite logit for this request")
            chosen_from = adjusted.get(row, logits[row])
            if row in adjusted and not bool(torch.isfinite(chosen_from).any()):
                failed[row] = RowFailure("every token is ruled out (by allowed_token_ids, structured_output, bad_words "
                                         "and min_tokens together)", _constraint(request))
                continue
            if not request.sampling.greedy:
                seed = seeds[request.req_id] * _SEED_STRIDE + request.num_generated
                tokens[row] = _sample_row(chosen_from, request, seed % (2**63))
            elif row in adjusted:
                tokens[row] = int(chosen_from.argmax())
        except Exception as exc:  # one bad row fails its request, never the batch
            logger.warning("sampling %s failed: %s", request.req_id, exc)
            failed[row] = RowFailure(f"sampling failed: {type(exc).__name__}")
    logprobs, tops = None, [None] * len(requests)
    if any(r.sampling.logprobs for r in requests):
        logprobs, tops = _logprobs(logits, torch.tensor(tokens, device=logits.device), requests)
    return [
        failed[i] if i in failed else
        (tokens[i], float(logprobs[i]) if logprobs is not None and r.sampling.logprobs else None, tops[i])
        for i, r in enumerate(requests)
    ]


def _adjusted_rows(logits: torch.Tensor, requests: list[Request], eos_token_ids: frozenset[int],
                   failed: dict[int, RowFailure]) -> dict[int, torch.Tensor]:
    """Row index -> its adjusted copy, for the rows whose request adjusts its logits this step:
    one batched pass over all of them (``engine.logit_adjust``); if that fails, row by row, so a
    request that cannot be adjusted fails alone (into ``failed``)."""
    rows = [i for i, r in enumerate(requests) if logit_adjust.applies(r)]
    if not rows:
        return {}
    try:
        return dict(zip(rows, logit_adjust.adjust(logits[rows], [requests[i] for i in rows], eos_token_ids)))
    except Exception:
        adjusted = {}
        for i in rows:
            try:
                adjusted[i] = logit_adjust.adjust(logits[[i]], [requests[i]], eos_token_ids)[0]
            except Exception as exc:
                logger.warning("adjusting the logits of %s failed: %s", requests[i].req_id, exc)
                # A grammar's reason is the client's to read; anything else is ours (the log has it).
                failed[i] = RowFailure(f"structured output: {exc}", grammar.FIELD) \
                    if isinstance(exc, GrammarError) else RowFailure(f"sampling failed: {type(exc).__name__}")
        return adjusted


def _constraint(request: Request) -> str:
    """The field to name when a request's constraints together rule out every token."""
    s = request.sampling
    return (grammar.FIELD if s.structured_output is not None else "allowed_token_ids" if s.allowed_token_ids
            else "bad_words" if s.bad_words_token_ids else "min_tokens")


def _finite(x: torch.Tensor, neginf: float | None = None) -> torch.Tensor:
    """NaN -> the lowest float, ±inf -> the extremes (``neginf``: what -inf becomes instead):
    comparisons and softmax stay defined."""
    info = torch.finfo(x.dtype)
    return torch.nan_to_num(x, nan=info.min, posinf=info.max, neginf=info.min if neginf is None else neginf)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              requests: list[Request]) -> tuple[list[float], list[TopLogprobs | None]]:
    """The sampled tokens' logprobs, and each row's ``top_logprobs`` most likely tokens (one
    ``topk`` over the batch's log-softmax, which the sampled logprobs need anyway). ``logits``
    finite already."""
    lp = torch.log_softmax(logits, dim=-1)   # NaN-free outputs below: the small tensors only
    chosen = torch.nan_to_num(lp.gather(1, tokens[:, None])[:, 0], nan=float("-inf")).tolist()
    k = max(r.sampling.top_logprobs if r.sampling.logprobs else 0 for r in requests)
    if not k:
        return chosen, [None] * len(requests)
    values, indices = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    values, indices = torch.nan_to_num(values, nan=float("-inf")).tolist(), indices.tolist()
    tops = [tuple(zip(indices[i][:n], values[i][:n])) if (n := r.sampling.top_logprobs) and r.sampling.logprobs
            else None for i, r in enumerate(requests)]
    return chosen, tops


def _sample_row(row: torch.Tensor, request: Request, seed: int) -> int:
    params = request.sampling
    # Subtracting the max first keeps the division finite for any temperature >= 1e-5. A -inf
    # stays -inf (probability 0 at any temperature): min_tokens holds tokens back that way.
    row = _finite(row, neginf=float("-inf"))
    row = (row - row.max()) / params.temperature
    row = torch.nan_to_num(row, nan=float("-inf"), neginf=float("-inf"))
    if params.min_p > 0.0:   # vLLM's order: after the temperature, before top-k / top-p
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < params.min_p * probs.max(), float("-inf"))  # the argmax stays
    if params.top_k and params.top_k < row.numel():
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))  # the argmax is >= kth: it stays
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        row = row.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise SamplingError("no finite probability left to sample from")
    generator = torch.Generator(device=row.device).manual_seed(seed)
    return int(torch.multinomial(probs, 1, generator=generator))
