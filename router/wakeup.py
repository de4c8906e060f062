"""Wakes the requests queued in admission in bounded time: the longest-waiting few, not all.

Admission re-evaluates queued requests when capacity may have changed (every worker report,
every finished request). Waking every queued request at each report costs O(queue) decisions
per step; here a report wakes at most ``n`` waiters, in rotation (oldest first, then each woken
waiter goes to the back, so every queued request is re-evaluated within len/n reports). A wake
that finds a waiter between two decisions is kept (its event stays set), so none is lost.

Life cycle per queued request: ``enter`` -> ``wait`` (until woken or timed out) and decide,
as often as it stays queued -> ``leave`` (admitted, rejected or cancelled).
"""

from __future__ import annotations

import asyncio
import itertools


class FairWakeup:
    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Event] = {}   # insertion order = arrival order
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def enter(self) -> int:
        ticket = next(self._tickets)
        self._waiters[ticket] = asyncio.Event()
        return ticket

    def leave(self, ticket: int) -> None:
        self._waiters.pop(ticket, None)

    async def wait(self, ticket: int, timeout_s: float) -> None:
        """Return when woken or after ``timeout_s``, whichever comes first."""
        event = self._waiters[ticket]
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        event.clear()

    def wake(self, n: int) -> None:
        """The ``n`` waiters woken longest ago (oldest first at the start): a waiter woken goes
        to the back, so waiters that stay queued cannot hold every wake-up for themselves."""
        for ticket in list(itertools.islice(self._waiters, n)):
            self._waiters[ticket].set()
            self._waiters[ticket] = self._waiters.pop(ticket)   # to the back of the rotation
