"""The router's stop-string trimming (router/stop_text.py) equals a plain reference that
rescans the whole text after every delta, on random stop strings and random delta splits (the
stop string cut or, with include_stop_str_in_output, kept), and
its per-delta work does not depend on how long the stop strings are."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.stop_text import StopTextTrimmer

_TEXT = st.text(alphabet="abx", max_size=6)


def _reference(stops: list[str], deltas: list[str], include: bool = False) -> str:
    """What the client must see: the engine stops at the first delta (a token's text) after which
    a stop string appears, and the text is cut where the first one listed that appears begins
    (with ``include``: where it ends), as vLLM cuts; all text if none."""
    text = ""
    for delta in deltas:
        text += delta
        found = next(((text.find(s), n) for n, s in enumerate(stops) if s in text), None)
        if found:
            cut, n = found
            return text[:cut + len(stops[n])] if include else text[:cut]
    return text


def _held_back_ok(stops: list[str], sent: str, seen: str) -> bool:
    """Everything not yet sent could still start a stop string (nothing is held for no reason)."""
    rest = seen[len(sent):]
    return not rest or any(s.startswith(rest) for s in stops if s)


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=7), min_size=1, max_size=3),
       deltas=st.lists(_TEXT, min_size=1, max_size=10), include=st.booleans())
def test_trimmed_stream_equals_reference(stops, deltas, include):
    trimmer = StopTextTrimmer(stops, include_stop=include)
    sent, seen = "", ""
    for i, delta in enumerate(deltas):
        sent += trimmer.push(delta, finished=i == len(deltas) - 1)
        seen += delta
        if i < len(deltas) - 1 and not any(s in seen for s in stops):
            assert _held_back_ok(stops, sent, seen), (stops, deltas, sent)
    assert sent == _reference(stops, deltas, include)


def _reference_after_min_tokens(stops: list[str], deltas: list[str], unchecked: int, include: bool) -> str:
    """The engine's rule with min_tokens: the first ``unchecked`` deltas are the text of tokens
    within min_tokens; a stop string counts only if it ends after their text."""
    checked_from = len("".join(deltas[:unchecked]))
    text = ""
    for i, delta in enumerate(deltas):
        text += delta
        if i < unchecked:
            continue
        found = next(((at, n) for n, s in enumerate(stops)
                      if (at := text.find(s, max(0, checked_from - len(s) + 1))) >= 0), None)
        if found:
            cut, n = found
            return text[:cut + len(stops[n])] if include else text[:cut]
    return text


@settings(max_examples=400, deadline=None)
@given(stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=5), min_size=1, max_size=3),
       deltas=st.lists(_TEXT, min_size=1, max_size=10), unchecked=st.integers(0, 10), include=st.booleans())
def test_stop_strings_within_min_tokens_do_not_count(stops, deltas, unchecked, include):
    trimmer = StopTextTrimmer(stops, include_stop=include)
    sent = ""
    for i, delta in enumerate(deltas):
        sent += trimmer.push(delta, finished=i == len(deltas) - 1, checked=i >= unchecked)
    assert sent == _reference_after_min_tokens(stops, deltas, unchecked, include)


def test_long_stop_strings_do_not_slow_each_delta():
    """Work per delta is counted in matcher steps: 16 stop strings of 256 characters cost a
    bounded number of steps per character, not a rescan of the held text per stop prefix."""
    stops = ["a" * 255 + "b"] * 16
    trimmer = StopTextTrimmer(stops)
    out = "".join(trimmer.push("a") for _ in range(2000))
    assert out == "a" * (2000 - 255)          # the last 255 characters could still begin a stop
    assert trimmer.push("b", finished=True) == ""


class _BytesTokenizer:
    """One token per UTF-8 byte: a character may take several tokens (byte-level BPE's case)."""

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


_PIECES = [b"a", b"!", b"b", "é".encode(), "€".encode()]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=12), min_tokens=st.integers(0, 12),
       cuts=st.lists(st.integers(1, 4), min_size=1, max_size=12), stop=st.sampled_from(["!", "a!", "é", "!b"]))
def test_the_text_does_not_depend_on_how_tokens_are_batched_into_messages(pieces, min_tokens, cuts, stop):
    """Found by a probe: with min_tokens, a message whose tokens straddled where min_tokens ends,
    the head ending inside a character, held that head's text back and then checked a stop string
    that ended within min_tokens. Any batching gives the text of one token per message."""
    from router.convert import IncrementalDetokenizer
    from router.generation import _text

    tokens = [b for piece in pieces for b in piece]

    def streamed(sizes) -> str:
        detok, trim = IncrementalDetokenizer(_BytesTokenizer(), [97]), StopTextTrimmer([stop])
        out, sent, i = "", 0, 0
        while sent < len(tokens):
            chunk = tokens[sent:sent + sizes[i % len(sizes)]]
            sent, i = sent + len(chunk), i + 1
            out += _text(chunk, sent == len(tokens), detok, trim, min_tokens - (sent - len(chunk)))
            if trim.matched:
                break
        return out

    assert streamed(cuts) == streamed([1])
