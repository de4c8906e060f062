"""A prefill worker's door for prefill calls straight from the router on its node: a unix
socket beside Ray, best effort (``engine.types.PrefillSubmission``).

Why: a Ray actor call reaching the worker is the largest piece of the first token's path left
outside the engine (~2 ms on a quiet machine, ~7 ms at load 3.6: benchmarks/results/
disagg_overhead.txt); a line on a unix socket takes ~0.4 ms. The router writes the submission
here and then makes the same call on Ray as always; the worker starts the request on
whichever arrives first and the other joins it (its calls are idempotent per request id), so
Ray's call still delivers the result and reports a dead worker exactly as before. A line lost
or refused costs only the speed-up.

Life cycle: ``start`` (a unix server in the worker's event loop, in a private directory: only
this user can connect; ``engine.unix_listen``) -> each whole line is decoded and handed to
``on_submit`` (a line that does not decode is dropped) -> ``close`` (server and connections
down, directory removed).
"""

from __future__ import annotations

import logging
from typing import Callable

from engine.types import PrefillSubmission
from engine.unix_listen import UnixLineServer

logger = logging.getLogger(__name__)

MAX_LINE_BYTES = 16 << 20   # a 128k-token prompt as JSON is ~1 MB


class SubmissionServer:
    def __init__(self, on_submit: Callable[[PrefillSubmission], None]) -> None:
        self.on_submit = on_submit
        self._listener = UnixLineServer("pdserve-submit-", "prefill.sock", self._submit, MAX_LINE_BYTES)

    @property
    def path(self) -> str | None:
        return self._listener.path

    async def start(self) -> str:
        return await self._listener.start()

    def _submit(self, line: bytes) -> None:
        try:
            submission = PrefillSubmission.from_json(line)
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("unreadable prefill submission dropped: %s", exc)
            return
        self.on_submit(submission)

    def close(self) -> None:
        self._listener.close()
