"""The engine's stop-string check (engine/stop.py) on the text the client sees, as vLLM's
detokenizer checks it: a stop string is found where the newest token completes it, whatever
tokens without text lie inside it (a skipped special token, EOS under ignore_eos, an id past
the tokenizer's vocabulary), once more where it ends again after an occurrence within
min_tokens, and in special tokens' text where the request keeps it (skip_special_tokens
false). Each case found by a probe that served the same requests through a cluster."""

from __future__ import annotations

import pytest

from engine.request import Request
from engine.stop import StopChecker
from engine.types import FinishReason, RequestSpec, SamplingParams

BOS, EOS, NO_TEXT = 1, 2, 99
_SPECIAL = {BOS: "<s>", EOS: "</s>"}


class LettersTokenizer:
    """ids 3.. are letters; 1 and 2 are special tokens; 99 decodes to nothing."""

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        out = []
        for t in token_ids:
            if t in _SPECIAL:
                out.append("" if skip_special_tokens else _SPECIAL[t])
            elif t != NO_TEXT:
                out.append(chr(ord("a") + t - 3))
        return "".join(out)


def ids(text: str) -> list[int]:
    return [3 + ord(ch) - ord("a") for ch in text]


def stops_at(output: list[int], **sampling) -> int | None:
    """The 1-based position of the token the engine stops at (None: it does not)."""
    checker = StopChecker((EOS,), 512, LettersTokenizer())
    request = Request(RequestSpec("r", (5, 6), SamplingParams(max_tokens=100, **sampling)))
    for i, token in enumerate(output, 1):
        request.append_output(token, None)
        if checker.check(request) is FinishReason.STOP:
            return i
    return None


@pytest.mark.parametrize("filler", [EOS, BOS, NO_TEXT])
@pytest.mark.parametrize("count", [0, 1, 3, 9])
def test_tokens_without_text_inside_a_stop_string_do_not_hide_it(filler, count):
    output = ids("xa") + [filler] * count + ids("bz")
    assert stops_at(output, stop=("ab",), ignore_eos=True) == 3 + count


def test_a_stop_string_that_ends_again_after_min_tokens_counts():
    assert stops_at(ids("aaab"), stop=("aa",), min_tokens=2) == 3   # "aa" ended at 2, within min_tokens
    assert stops_at(ids("aab"), stop=("aa",), min_tokens=1) == 2
    assert stops_at(ids("xyxyxq"), stop=("xyx",), min_tokens=3) == 5
    assert stops_at(ids("abab"), stop=("ab",), min_tokens=2) == 4
    assert stops_at(ids("abcab"), stop=("ab",)) == 2                # found once: the first end stops


def test_a_stop_string_in_a_special_tokens_text_where_the_request_keeps_it():
    output = ids("hi") + [BOS] + ids("there")
    assert stops_at(output, stop=("<s>",), skip_special_tokens=False) == 3
    assert stops_at(output, stop=("<s>",)) is None                   # skipped: not in the text
    assert stops_at(output, stop=("ith",)) == 5                      # "hi" + "th": <s> is no text here
