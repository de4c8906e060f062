"""Stop strings are not part of the output text (the proto's and OpenAI's rule): the engine stops
generating at one (``engine/stop.py``), and this trims it, and anything after it, from the text
the router streams. Token ids are left as generated (vLLM does the same).

Life cycle: one ``StopTextTrimmer`` per request with stop strings, fed every text delta in order
by ``GenerationCore``; text that could still be the start of a stop string is held back until
the next delta decides (at most the longest stop string's length), and flushed when the request
finishes without one.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopTextTrimmer:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self._stopped = False

    def push(self, text: str, *, finished: bool = False) -> str:
        if self._stopped:
            return ""
        held = self._held + text
        cut = min((i for i in (held.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._stopped, self._held = True, ""
            return held[:cut]
        keep = 0 if finished else self._partial_suffix(held)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep]

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
