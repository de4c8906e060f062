"""Stop conditions applied after each sampled token: EOS, stop token ids, stop strings,
``max_tokens`` and the model's maximum length."""

from __future__ import annotations

from typing import Any

from engine.request import Request
from engine.types import FinishReason


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer: Any | None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, request: Request) -> FinishReason | None:
        token = request.output_token_ids[-1]
        sampling = request.sampling
        if not sampling.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if token in sampling.stop_token_ids:
            return FinishReason.STOP
        if sampling.stop and self._hits_stop_string(request):
            return FinishReason.STOP
        if len(request.output_token_ids) >= sampling.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _hits_stop_string(self, request: Request) -> bool:
        if self.tokenizer is None:
            return False
        # A stop string ends within the text of the last few tokens; decoding only that tail keeps
        # the check O(1) per token. A token is at least one byte of text, not one character
        # (byte-level BPE splits an emoji into up to 4 tokens), so the stop string's UTF-8 length
        # + 1 tokens suffice.
        window = max(len(s.encode("utf-8")) for s in request.sampling.stop) + 1
        tail_ids = request.generated_tail(window)
        prev_text = self.tokenizer.decode(tail_ids[:-1], skip_special_tokens=True)
        text = self.tokenizer.decode(tail_ids, skip_special_tokens=True)
        # Only a match that the newest token completes counts, so a stop string is found once.
        return any(s in text and s not in prev_text for s in request.sampling.stop)
