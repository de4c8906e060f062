"""Request ids the router has ended on this decode worker, remembered for a reservation's lease.

The prefill worker asks this worker to ``reserve`` a request's blocks while it prefills, and the
router frees what is left of the request here (``abort``) when it ends early or its prefill
worker dies: two callers, so Ray orders nothing between those two calls. A free that overtakes
its reserve leaves the id here, and the reserve that arrives later is refused, instead of
holding blocks that nobody will commit or free until the lease ends.

Life cycle of an id: ``add`` when the router ends the request here -> every ``reserve`` for it
meanwhile is refused -> forgotten ``ttl_s`` later (a prefill worker never starts a write later
than the lease allows, so no reserve of that request can matter after it).
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
