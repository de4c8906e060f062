"""Checks a RequestSpec against the model's limits before any worker sees it.

Torch-free, so the router runs the same checks at its edge (with ``prefix="sampling."``, the
proto path of the fields it names); the engine runs them again on ``add_request`` so a bad
request can never reach the step loop. Each rule is written here once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.errors import InvalidRequestError, require
from engine.types import MAX_TOP_LOGPROBS, RequestSpec, SamplingParams

MAX_PENALTY = 2.0        # OpenAI's range for frequency_penalty and presence_penalty
MAX_LOGIT_BIAS = 100.0   # OpenAI's range for a logit_bias value


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Every id inside the vocabulary; the error names the first one that is not."""
    bad = next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(field, f"token id {bad[1]} at index {bad[0]} is outside the vocabulary [0, {vocab_size})")


def validate_sampling(sampling: SamplingParams, vocab_size: int | None = None, prefix: str = "",
                      eos_token_ids: Sequence[int] = (), num_generated: int = 0) -> None:
    """``prefix`` + the field name is what the error names (the router passes "sampling.");
    ``eos_token_ids``: the model's (what ``min_tokens`` holds back unless EOS is ignored);
    ``num_generated``: output tokens a resumed request (``RequestSpec.num_generated``) already
    has, which ``max_tokens`` no longer counts and ``min_tokens`` still does."""
    s = sampling
    require(s.max_tokens >= 1, prefix + "max_tokens", f"must be >= 1, got {s.max_tokens}")
    # isfinite also rejects NaN, which would slip past every comparison; inf would turn every
    # logit into 0 / inf sampling.
    require(math.isfinite(s.temperature) and s.temperature >= 0, prefix + "temperature",
             f"must be a finite number >= 0, got {s.temperature}")
    require(not math.isnan(s.top_p) and 0.0 < s.top_p <= 1.0, prefix + "top_p", f"must be in (0, 1], got {s.top_p}")
    require(s.top_k >= 0, prefix + "top_k", f"must be >= 0 (0 disables it), got {s.top_k}")
    require(not math.isnan(s.min_p) and 0.0 <= s.min_p <= 1.0, prefix + "min_p", f"must be in [0, 1], got {s.min_p}")
    require(s.seed is None or -2**63 <= s.seed < 2**63, prefix + "seed", f"must be a 64-bit integer, got {s.seed}")
    require(0 <= s.top_logprobs <= MAX_TOP_LOGPROBS, prefix + "top_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}")
    require(s.logprobs or not s.top_logprobs, prefix + "top_logprobs", "needs logprobs")
    require(s.prompt_logprobs is None or 0 <= s.prompt_logprobs <= MAX_TOP_LOGPROBS, prefix + "prompt_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}], got {s.prompt_logprobs}")
    require(all(s.stop), prefix + "stop", "stop strings must not be empty")
    require(all(s.bad_words_token_ids), prefix + "bad_words", "a bad word must have at least one token")
    require(0 <= s.min_tokens <= s.max_tokens + num_generated, prefix + "min_tokens",
            f"must be in [0, max_tokens ({s.max_tokens + num_generated})], got {s.min_tokens}")
    held = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))
    require(not (s.min_tokens and s.allowed_token_ids and set(s.allowed_token_ids) <= held),
            prefix + "allowed_token_ids", "every allowed token is EOS or a stop token id, which min_tokens holds back")
    banned_always = {word[0] for word in s.bad_words_token_ids if len(word) == 1}
    require(not (s.allowed_token_ids and set(s.allowed_token_ids) <= banned_always), prefix + "bad_words",
            "bans every one of allowed_token_ids")
    require(math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0, prefix + "repetition_penalty",
            f"must be a finite number > 0 (1 = off), got {s.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(s, name)
        require(not math.isnan(value) and -MAX_PENALTY <= value <= MAX_PENALTY, prefix + name,
                f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    for token, bias in s.logit_bias:
        require(not math.isnan(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, prefix + "logit_bias",
                f"the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
    require(len({token for token, _ in s.logit_bias}) == len(s.logit_bias), prefix + "logit_bias",
            "names a token id twice")
    if vocab_size is not None:
        check_token_ids(s.stop_token_ids, vocab_size, prefix + "stop_token_ids")
        for word in s.bad_words_token_ids:
            check_token_ids(word, vocab_size, prefix + "bad_words")
        require(len(s.allowed_token_ids) <= vocab_size, prefix + "allowed_token_ids",
                f"{len(s.allowed_token_ids)} ids; at most the vocabulary's {vocab_size}")
        check_token_ids(s.allowed_token_ids, vocab_size, prefix + "allowed_token_ids")
        check_token_ids([token for token, _ in s.logit_bias], vocab_size, prefix + "logit_bias")


def validate_spec(spec: RequestSpec, *, max_model_len: int, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
    """Raise InvalidRequestError naming the offending field; return silently when the spec is servable."""
    ids = spec.prompt_token_ids
    require(spec.req_id, "request_id", "must not be empty")
    require(len(ids) > 0, "prompt", "must not be empty")
    require(len(ids) < max_model_len, "prompt", f"has {len(ids)} tokens; max_model_len is {max_model_len}")
    check_token_ids(ids, vocab_size, "prompt_token_ids")
    validate_sampling(spec.sampling, vocab_size, eos_token_ids=eos_token_ids, num_generated=spec.num_generated)
    require(len(ids) + spec.sampling.max_tokens <= max_model_len, "max_tokens",
             f"prompt ({len(ids)}) + max_tokens ({spec.sampling.max_tokens}) exceeds max_model_len "
             f"{max_model_len} (the model's, or what the worker's KV pool holds)")
    for name, value in (("ttft_ms", spec.slo.ttft_s), ("tpot_ms", spec.slo.tpot_s)):
        require(value is None or (math.isfinite(value) and value > 0), name, f"must be > 0, got {value}")
