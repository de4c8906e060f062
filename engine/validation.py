"""Checks a RequestSpec against the model's limits before any worker sees it.

Torch-free, so the router runs the same checks at its edge; the engine runs them again on
``add_request`` so a bad request can never reach the step loop.
"""

from __future__ import annotations

import math

from engine.errors import InvalidRequestError
from engine.types import RequestSpec, SamplingParams


def validate_sampling(sampling: SamplingParams) -> None:
    if sampling.max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"must be >= 1, got {sampling.max_tokens}")
    if math.isnan(sampling.temperature) or sampling.temperature < 0:
        raise InvalidRequestError("temperature", f"must be >= 0, got {sampling.temperature}")
    if math.isnan(sampling.top_p) or not 0.0 < sampling.top_p <= 1.0:
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {sampling.top_k}")
    if sampling.seed is not None and sampling.seed < 0:
        raise InvalidRequestError("seed", f"must be >= 0, got {sampling.seed}")
    if any(not s for s in sampling.stop):
        raise InvalidRequestError("stop", "stop strings must not be empty")


def validate_spec(spec: RequestSpec, *, max_model_len: int, vocab_size: int) -> None:
    """Raise InvalidRequestError naming the offending field; return silently when the spec is servable."""
    ids = spec.prompt_token_ids
    if not spec.req_id:
        raise InvalidRequestError("request_id", "must not be empty")
    if len(ids) == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {len(ids)} tokens; max_model_len is {max_model_len}"
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    validate_sampling(spec.sampling)
    if len(ids) + spec.sampling.max_tokens > max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({len(ids)}) + max_tokens ({spec.sampling.max_tokens}) exceeds max_model_len "
            f"{max_model_len} (the model's, or what the worker's KV pool holds)",
        )
    bad_stop = next((t for t in spec.sampling.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise InvalidRequestError("stop_token_ids", f"token id {bad_stop} is outside the vocabulary")
    for name, value in (("ttft_ms", spec.slo.ttft_s), ("tpot_ms", spec.slo.tpot_s)):
        if value is not None and not value > 0:
            raise InvalidRequestError(name, f"must be > 0, got {value}")
