"""A request's logit adjustments before its token is chosen (greedy or sampled): vLLM's
``min_tokens`` (EOS and the stop token ids held at -inf until that many tokens are out), OpenAI's
``logit_bias``, ``frequency_penalty`` and ``presence_penalty``, and the ``repetition_penalty``
of Hugging Face and vLLM, in vLLM's order: the hold and the bias first, then the repetition penalty (every
token in the prompt or the output: a positive logit divided by it, a negative one multiplied),
then the frequency penalty (times the token's count in the output) and the presence penalty
(once per token in the output), each subtracted.

Stateless: every step reads the request's tokens as they stand (``Request.all_token_ids``, and
its output, which reaches back into the prompt of a migrated request), so a request recomputed
after preemption, resumed on another worker, or whose first token a prefill worker chose gets
the same adjustments it would have had on one engine. The arithmetic is Hugging Face's
processors' (float32, the penalty a Python float), so greedy output with them equals
``generate``'s. Only rows whose request asks for an adjustment come here; the others keep the
batch's argmax.
"""

from __future__ import annotations

import torch

from engine.request import Request


def applies(request: Request) -> bool:
    """Whether this request's row is adjusted this step (``Request.adjusts_logits`` is what the
    parameters ask for at all; ``min_tokens`` only until that many tokens are out)."""
    return request.adjusts_logits or (request.sampling.min_tokens > 0 and request.num_generated < request.sampling.min_tokens)


def adjusted(row: torch.Tensor, request: Request, eos_token_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """A copy of one request's (finite) logits row with its adjustments applied; ``eos_token_ids``:
    the model's, which ``min_tokens`` holds back (unless the request ignores EOS)."""
    params = request.sampling
    row = row.clone()
    if request.num_generated < params.min_tokens:
        held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if held:
            row[torch.tensor(sorted(held), device=row.device)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias], device=row.device)
        row[ids] += torch.tensor([bias for _, bias in params.logit_bias], dtype=row.dtype, device=row.device)
    if params.repetition_penalty != 1.0:
        ids = torch.tensor(request.all_token_ids, device=row.device).unique()
        seen = row[ids]
        row[ids] = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        output = request.generated_tail(request.num_generated)
        if output:
            ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
            row[ids] -= params.frequency_penalty * counts.to(row.dtype)
            row[ids] -= params.presence_penalty
    return row
