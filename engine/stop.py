"""Stop conditions applied after each sampled token: EOS (unless ``ignore_eos``; always for a
guided request, whose grammar ends there), stop token ids, stop strings, ``max_tokens`` and the
model's maximum length."""

from __future__ import annotations

from typing import Any

from engine.request import Request
from engine.types import FinishReason

# Tokens decoded before the tail the stop check reads, for their effect on its text (as the
# router's detokenizer decodes the output after the prompt's last ids: ``router.convert``).
CONTEXT_TOKENS = 4


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer: Any | None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def check(self, request: Request) -> FinishReason | None:
        token = request.output_token_ids[-1]
        sampling = request.sampling
        # A grammar lets EOS through only where the output is a whole match, and takes nothing
        # after it: there a guided request ends, ignore_eos or not (found by a probe: it went on
        # and failed with "the output left its grammar").
        if token in self.eos_token_ids and (not sampling.ignore_eos or request.grammar is not None):
            return FinishReason.STOP
        if token in sampling.stop_token_ids:
            return FinishReason.STOP
        # Stop strings count from the token after min_tokens on (vLLM's rule: one that token
        # completes counts, one completed earlier never does).
        if sampling.stop and request.num_generated > sampling.min_tokens and self._hits_stop_string(request):
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
        start = len(request.all_token_ids) - len(tail_ids)
        context = request.all_token_ids[max(0, start - CONTEXT_TOKENS):start]
        before = self.tokenizer.decode(context, skip_special_tokens=True) if context else ""
        prev_text = self._text_after(context, before, tail_ids[:-1])
        text = self._text_after(context, before, tail_ids)
        # Only a match that the newest token completes counts, so a stop string is found once.
        return any(s in text and s not in prev_text for s in request.sampling.stop)

    def _text_after(self, context: list[int], before: str, ids: list[int]) -> str:
        """The text of ``ids`` as it reads after ``context`` (the tokens before them, whose text
        is ``before``): the text the client sees. A SentencePiece tokenizer (Llama's) drops a
        word's leading space at the start of a decoded text, so ``ids`` decoded alone would miss
        a stop string " Paris" at the first generated token. The context's own text is not part
        of it: a stop string matches the output alone (vLLM's rule)."""
        text = self.tokenizer.decode(context + ids, skip_special_tokens=True)
        if text.startswith(before):
            return text[len(before):]
        return self.tokenizer.decode(ids, skip_special_tokens=True)   # the context ends inside a character
