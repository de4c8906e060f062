"""What a worker's loss did to the requests it held, said in one log line per loss.

Every request on a lost worker migrates (``router.orchestrator``), within milliseconds of the
loss for all of them: one WARNING per request made a decode worker's death under 256 streams 256
lines, each naming Ray's generic "actor died" text, and none saying how many requests moved
in all. The orchestrator now logs each request's move at DEBUG and reports it here; the first
report of a loss (a worker slot and its generation) opens a tally that is logged once,
``WINDOW_S`` later: how many requests moved, how many of them mid-stream, how many failed past
the migration limit, and a few of their ids to grep for. Moves reported after the window open
a new one (a request that waited for a worker to come back), so nothing goes unsaid.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

WINDOW_S = 1.0   # a loss's requests all notice it within Ray's death notice (~0.1 s)
EXAMPLES = 3     # request ids named in the line


@dataclass(slots=True)
class _Tally:
    moved: int = 0
    mid_stream: int = 0        # had sent the client tokens: the stream goes on elsewhere
    failed: int = 0            # past the migration limit: the client got UNAVAILABLE
    examples: list[str] = field(default_factory=list)

    def note(self, req_id: str) -> None:
        if len(self.examples) < EXAMPLES:
            self.examples.append(req_id)


class LossLog:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._open: dict[tuple[str, int], _Tally] = {}

    def moved(self, worker_id: str, generation: int, req_id: str, tokens_sent: int) -> None:
        """A request on ``worker_id``'s ``generation`` moves to another attempt."""
        tally = self._tally(worker_id, generation)
        tally.moved += 1
        tally.mid_stream += tokens_sent > 0
        tally.note(req_id)

    def failed(self, worker_id: str, generation: int, req_id: str) -> None:
        """A request on it failed instead: its migration limit was reached."""
        tally = self._tally(worker_id, generation)
        tally.failed += 1
        tally.note(req_id)

    def _tally(self, worker_id: str, generation: int) -> _Tally:
        key = (worker_id, generation)
        tally = self._open.get(key)
        if tally is None:
            tally = self._open[key] = _Tally()
            asyncio.get_running_loop().call_later(self.window_s, self._flush, key)
        return tally

    def _flush(self, key: tuple[str, int]) -> None:
        tally = self._open.pop(key)
        worker_id, generation = key
        failed = f"; {tally.failed} failed (migration limit reached)" if tally.failed else ""
        logger.warning("worker %s (generation %d): its loss moved %d request(s) to another worker "
                       "(%d mid-stream)%s; e.g. %s", worker_id, generation, tally.moved, tally.mid_stream,
                       failed, ", ".join(tally.examples))
