"""Stop strings are not part of the output text (the proto's and OpenAI's rule; vLLM's
``include_stop_str_in_output`` keeps them): the engine stops generating at one
(``engine/stop.py``), and this trims it, and anything after it, from the text the router
streams. Token ids are left as generated (vLLM does the same).

Life cycle: one ``StopTextTrimmer`` per request with stop strings, fed every text delta in order
by ``GenerationCore``; text that could still be the start of a stop string is held back until
the next delta decides (at most the longest stop string's length), and flushed when the request
finishes without one. Text of the first ``min_tokens`` tokens is pushed ``checked=False``: a stop
string that ends inside it does not count, one that begins there and ends later does (the
engine's rule, ``engine/stop.py``: the token that completes it must come after min_tokens).

Cost: each stop string keeps a Knuth-Morris-Pratt state (the longest end of the text so far that
begins it), advanced over the new characters only, so a delta costs O(stops x its length)
amortized whatever the stop strings' lengths — never a rescan of the held text per stop prefix.
"""

from __future__ import annotations

from collections.abc import Sequence


class _PrefixMatcher:
    """Tracks the longest end of a character stream that is a proper prefix of ``pattern``."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.state = 0                      # characters of pattern matched by the stream's end
        self._fail = _failure_function(pattern)

    def feed(self, text: str) -> None:
        pattern, fail, k = self.pattern, self._fail, self.state
        for ch in text:
            while k and (k == len(pattern) or pattern[k] != ch):
                k = fail[k - 1]
            if pattern[k] == ch:
                k += 1
        # A whole match is found by ``str.find`` in the caller; what may still grow is shorter.
        self.state = fail[k - 1] if k == len(pattern) else k


def _failure_function(pattern: str) -> list[int]:
    """fail[i]: length of the longest proper prefix of pattern[:i + 1] that is also its suffix."""
    fail, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopTextTrimmer:
    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        """``include_stop``: the stop string stays in the text, what follows it does not (vLLM's
        ``include_stop_str_in_output``)."""
        self._stops = tuple(s for s in stops if s)
        self._include_stop = include_stop
        self._matchers = [_PrefixMatcher(s) for s in self._stops]
        self._held = ""
        self._stopped = False
        self.matched: str | None = None   # the stop string found, once found
        self._sent = 0           # characters returned so far: where the held text begins
        self._checked_from = 0   # a stop string must end after this many characters of the text

    def push(self, text: str, *, finished: bool = False, checked: bool = True) -> str:
        """The part of ``text`` (and of what was held) that is output text now. ``checked``:
        False for the text of tokens within min_tokens, where no stop string may end."""
        if self._stopped:
            return ""
        held = self._held + text
        if not checked:
            self._checked_from = self._sent + len(held)
        skip = self._checked_from - self._sent + 1   # a match must start past skip - len(stop)
        # The first stop string listed that the text holds, as vLLM cuts (a probe: stops ["b", "ab"]
        # on "xab" gave "x", vLLM "xa"): the engine stopped at the first token completing any, so
        # every match here ends in that token's text, and there vLLM takes them in the given order.
        found = next(((i, n) for n, s in enumerate(self._stops) if (i := held.find(s, max(0, skip - len(s)))) >= 0), None)
        if found is not None:
            cut, n = found
            self._stopped, self._held, self.matched = True, "", self._stops[n]
            return held[:cut + len(self._stops[n])] if self._include_stop else held[:cut]
        for matcher in self._matchers:
            matcher.feed(text)
        keep = 0 if finished else max((m.state for m in self._matchers), default=0)
        self._held = held[len(held) - keep:] if keep else ""
        self._sent += len(held) - keep
        return held[:len(held) - keep]
