"""Who a request is: the router's own id for it, and the client's label.

Every Generate call runs under an id the router makes (``req_id``, uuid4 hex): that is what
``RequestSpec.req_id`` carries to the workers, what streams are demultiplexed by and what
aborts name, so no client can choose an id that reaches another client's request. The
client's ``request_id`` is only a label echoed back in its responses (the router makes one
when it is unset). One live request per label: a second call with a label already live gets
ALREADY_EXISTS and the running one is left untouched.

Life cycle: ``claim`` when the call arrives (before tokenizing, so a duplicate or a call over
``max_concurrent_streams`` costs nothing), ``release`` when it ends, whatever way it ends. A
call whose label is live waits for its release (``released``) a moment (``RACE_WAIT_S``), and
on while that request is ending (its handler cancelled: the client left, its deadline passed;
up to ``ENDING_WAIT_S``), before it is refused: a client that retries under the same id right
after it disconnected gets its request, not a conflict with its own last one, whose
disconnect the server may not have read yet (found by a probe: 17 of 20 such HTTP retries got
409 while the first unwound, 1.3-1.7 ms after the close, at most 15 ms).
At shutdown ``drain`` refuses every later call (``ShuttingDownError``: UNAVAILABLE, so a client
goes to another replica) and ``drained`` waits for the live ones to end; ``cut`` (the stop, once
the drain is over) cancels the task of each request still live with ``CUT_AT_STOP``, which its
handler answers as a ``ShuttingDownError`` (gRPC UNAVAILABLE, HTTP 503 or an SSE error event)
instead of a connection torn down by the server's own stop.
Single-threaded: only the router's event loop touches it.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from engine.errors import CapacityError, PdserveError


class DuplicateRequestError(PdserveError):
    """A client request_id already live (maps to ALREADY_EXISTS)."""


class ShuttingDownError(PdserveError):
    """The server is draining before it stops: no new request, or a live one cut at the stop
    (maps to UNAVAILABLE)."""


RACE_WAIT_S = 0.05    # how long a call waits for a live label's release before it is a duplicate
ENDING_WAIT_S = 2.0   # ... and on, while that request is ending

CUT_AT_STOP = "pdserve: cut at stop"   # the cancel message a request's handler answers as ShuttingDownError


@dataclass(frozen=True, slots=True)
class RequestIdentity:
    label: str    # the client's request_id, or one made for it: echoed, never routed by
    req_id: str   # the router's own id: what workers, streams and aborts see


class LiveRequests:
    def __init__(self, max_live: int) -> None:
        self.max_live = max_live
        # label -> (req_id, the task that claimed it: its handler, which ``cut`` cancels)
        self._live: dict[str, tuple[str, asyncio.Task | None]] = {}
        self._emptied: asyncio.Event | None = None   # set once draining and nothing is live
        self._released: dict[str, asyncio.Event] = {}   # label -> set at its release (only while awaited)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, label: str) -> bool:
        return label in self._live

    def claim(self, label: str | None) -> RequestIdentity:
        """Raises DuplicateRequestError, CapacityError (max_concurrent_streams) or ShuttingDownError."""
        if self._emptied is not None:
            raise ShuttingDownError("the server is shutting down: send the request to another replica")
        if label is not None and label in self._live:
            raise DuplicateRequestError(f"request_id: {label!r} is already live on this server")
        if len(self._live) >= self.max_live:
            raise CapacityError(f"max_concurrent_streams: {self.max_live} requests are live; retry later",
                                "max_streams")
        identity = RequestIdentity(label if label is not None else uuid.uuid4().hex, uuid.uuid4().hex)
        self._live[identity.label] = (identity.req_id, asyncio.current_task())
        return identity

    def released(self, label: str | None) -> asyncio.Event | None:
        """The event set when ``label`` is released; None if it is not live."""
        if label is None or label not in self._live:
            return None
        return self._released.setdefault(label, asyncio.Event())

    def ending(self, label: str) -> bool:
        """Whether ``label`` is live under a request that is ending (its handler cancelled: the
        client left, its deadline passed)."""
        task = self._live.get(label, (None, None))[1]
        return task is not None and (task.done() or task.cancelling() > 0)

    def release(self, identity: RequestIdentity) -> None:
        if self._live.get(identity.label, ("",))[0] == identity.req_id:
            del self._live[identity.label]
            released = self._released.pop(identity.label, None)
            if released is not None:
                released.set()
            if self._emptied is not None and not self._live:
                self._emptied.set()

    def drain(self) -> None:
        """Refuse every request from now on; ``drained`` then waits for the live ones."""
        if self._emptied is None:
            self._emptied = asyncio.Event()
            if not self._live:
                self._emptied.set()

    async def drained(self) -> None:
        self.drain()
        await self._emptied.wait()

    def cut(self) -> int:
        """Refuse every request from now on and cancel the live ones' handlers with
        ``CUT_AT_STOP`` (each task once: an HTTP request with n choices holds n labels). Returns
        how many were live; ``drained`` waits for their answers."""
        self.drain()
        for task in {task for _, task in self._live.values()}:
            if task is not None and not task.done():
                task.cancel(CUT_AT_STOP)
        return len(self._live)
