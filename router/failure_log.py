"""The router's log of the failures it answers with a reference: one line per distinct failure
per window, however many requests meet it.

A failure the client is told about by reference ("unavailable: ... (ref R); see router logs")
is logged with R. Once nothing can serve (the last decode slot lost for good), every request
fails the same way, and one ERROR line per request was a flood under traffic (found by the
operations probe). So a failure whose line (what failed and why) was logged within the last
``WINDOW_S`` takes that line's ref instead of a new one and is counted; the next time the same
failure comes after the window it is logged again, saying how many requests met it meanwhile
and under which ref. A client's ref always greps to a line that says what failed.

Life cycle: one per router process (``router.errors`` holds it, as it holds its logger);
``record`` per failure answered by reference. Keys are bounded (``MAX_KEYS``, oldest dropped).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 10.0
MAX_KEYS = 256


@dataclass(slots=True)
class _Logged:
    ref: str
    at: float           # when its line was written (the clock's time)
    repeats: int = 0    # failures since that line that took its ref


class FailureLog:
    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._clock = clock
        self._lines: OrderedDict[tuple[str, str], _Logged] = OrderedDict()
        self._lock = threading.Lock()   # the HTTP door and the gRPC door may answer from two threads

    def record(self, what: str, detail: str, req_id: str, exc_info: BaseException | None = None) -> str:
        """The ref to give the client for this failure; its line is written unless the same
        failure was logged within ``WINDOW_S`` (then that line's ref is the answer)."""
        key = (what, detail)
        now = self._clock()
        with self._lock:
            last = self._lines.get(key)
            if last is not None and now - last.at < WINDOW_S:
                last.repeats += 1
                return last.ref
            ref = uuid.uuid4().hex[:12]
            self._lines[key] = _Logged(ref, now)
            self._lines.move_to_end(key)
            while len(self._lines) > MAX_KEYS:
                self._lines.popitem(last=False)
        since = ""
        if last is not None and last.repeats:
            since = (f"; {last.repeats} more request(s) failed the same way in the {now - last.at:.0f} s "
                     f"before, answered with ref {last.ref}")
        self._logger.error("%s (ref %s) for request %s: %s%s", what, ref, req_id or "-", detail, since,
                           exc_info=exc_info)
        return ref
