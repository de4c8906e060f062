"""Request ids ended on a worker before a call for them arrived, remembered for a while.

Two callers, so Ray orders nothing between their calls: on a decode worker, the prefill worker
submits a request's ``reserve`` and the router frees the request (``abort``) when it ends early
or its prefill worker dies; on a prefill worker, the router's direct submission (a unix socket)
and its ``abort`` (Ray). An end that overtakes the call it ends leaves the id here, and the call
that arrives later is refused, instead of holding blocks (a reservation nobody will commit or
free until its lease ends) or starting a request nobody waits for.

Life cycle of an id: ``add`` when the request is ended there -> every late call for it meanwhile
is refused -> forgotten ``ttl_s`` later (past it no such call can still be on its way: a
reservation's lease, a direct submission's join window).
"""

from __future__ import annotations

import time
from collections import OrderedDict


class EndedRequests:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._until: OrderedDict[str, float] = OrderedDict()   # req_id -> monotonic expiry, oldest first

    def add(self, req_id: str) -> None:
        now = time.monotonic()
        self._expire(now)
        self._until.pop(req_id, None)
        self._until[req_id] = now + self.ttl_s

    def __contains__(self, req_id: str) -> bool:
        self._expire(time.monotonic())
        return req_id in self._until

    def __len__(self) -> int:
        self._expire(time.monotonic())
        return len(self._until)

    def _expire(self, now: float) -> None:
        while self._until and next(iter(self._until.values())) <= now:
            self._until.popitem(last=False)
