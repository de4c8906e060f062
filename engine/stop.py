"""Stop conditions applied after each sampled token: EOS (unless ``ignore_eos``; always for a
guided request, whose grammar ends there), stop token ids, stop strings, ``max_tokens`` and the
model's maximum length."""

from __future__ import annotations

import os
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
        stops, skip = request.sampling.stop, request.sampling.skip_special_tokens
        longest = max(len(s) for s in stops)
        # A stop string ends within the newest token's text and begins at most ``longest``
        # characters before it: decoding only the output's tail keeps the check O(1) per token.
        # The tail is grown until the text before the newest token holds that many characters or
        # it reaches the output's start: at once almost always (a token is at least one byte of
        # text), not where tokens decode to nothing (a skipped special token, an id past the
        # tokenizer's vocabulary: found by a probe, a stop string around such tokens was missed).
        window = max(len(s.encode("utf-8")) for s in stops) + 1
        while True:
            tail_ids = request.generated_tail(window)
            start = len(request.all_token_ids) - len(tail_ids)
            context = request.all_token_ids[max(0, start - CONTEXT_TOKENS):start]
            before = self.tokenizer.decode(context, skip_special_tokens=skip) if context else ""
            prev_text = self._text_after(context, before, tail_ids[:-1], skip)
            if len(prev_text) >= longest or len(tail_ids) < window:
                break
            window *= 2
        text = self._text_after(context, before, tail_ids, skip)
        # Only a match that the newest token completes counts (it ends past the text before it,
        # vLLM's rule), so a stop string is found once; one that also ended earlier, within
        # min_tokens, still counts where it ends again (a probe: "aa" in "aaa" was missed).
        seen = len(os.path.commonprefix([prev_text, text]))
        return any(text.find(s, max(0, seen - len(s) + 1)) >= 0 for s in stops)

    def _text_after(self, context: list[int], before: str, ids: list[int], skip: bool) -> str:
        """The text of ``ids`` as it reads after ``context`` (the tokens before them, whose text
        is ``before``): the text the client sees (``skip``: its ``skip_special_tokens``). A
        SentencePiece tokenizer (Llama's) drops a word's leading space at the start of a decoded
        text, so ``ids`` decoded alone would miss a stop string " Paris" at the first generated
        token. The context's own text is not part of it: a stop string matches the output alone
        (vLLM's rule)."""
        text = self.tokenizer.decode(context + ids, skip_special_tokens=skip)
        if text.startswith(before):
            return text[len(before):]
        return self.tokenizer.decode(ids, skip_special_tokens=skip)   # the context ends inside a character
