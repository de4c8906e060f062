"""Wakes the requests queued in admission in bounded time: the longest-waiting few, not all.

Admission re-evaluates queued requests when capacity may have changed (every worker report,
every finished request). Waking every queued request at each report costs O(queue) decisions
per step; here a report wakes at most ``n`` waiters, in rotation (oldest first, then each woken
waiter goes to the back, so every queued request is re-evaluated within len/n reports). A wake
that finds a waiter between two decisions is kept (its event stays set), so none is lost.

Waiters enter with a rank (the request's priority: lower goes first, vLLM's order; every
request is rank 0 under FCFS) and a wake walks the ranks in order, rotating within each: the
capacity a report announces is offered to the most important requests first (a probe found 6
queued priority-0 requests served after 6 priority-10 ones that had come first). The ranks
present are few (a priority range), so the walk stays bounded (``n`` checks per rank); one more
waiter each wake, in a rotation over every rank, keeps a lower rank from waiting out its
deadline behind higher ones that take every wake.

Each wake names its source: the worker whose report it is, or None when anything may have
changed (a request finished, a worker came back). The woken waiter learns it from ``wait``, so
a report from a worker that still cannot take the request costs a check of that one worker, not
a decision over every worker. Two wakes from different sources before the waiter ran read as
None (both may have changed). A waiter may bring that check (``enter(check)``): a wake naming a
source then runs it at once, and a waiter the source cannot take is not woken at all (no task
switch: the waiter would have run the same check on the same state and gone on waiting); it
goes to the back of the rotation all the same, so the next wake checks the next waiters.

Life cycle per queued request: ``enter`` (with its rank) -> ``wait`` (until woken or timed out) and decide,
as often as it stays queued -> ``leave`` (admitted, rejected or cancelled).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable


class FairWakeup:
    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Event] = {}
        self._rank_of: dict[int, int] = {}
        self._rotations: dict[int, dict[int, None]] = {}   # rank -> its tickets, next to wake first
        self._across: dict[int, None] = {}   # every ticket, rotated whatever its rank (``_turn_across``)
        self._sources: dict[int, object | None] = {}   # what the pending wake of a waiter names
        self._checks: dict[int, Callable[[object], bool]] = {}   # whether a source could take the waiter
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._waiters)

    def enter(self, check: Callable[[object], bool] | None = None, rank: int = 0) -> int:
        """``check(source)``: whether a wake naming ``source`` could let this waiter go on (None:
        every wake could). ``rank``: lower ranks are woken first."""
        ticket = next(self._tickets)
        self._waiters[ticket] = asyncio.Event()
        self._rank_of[ticket] = rank
        self._rotations.setdefault(rank, {})[ticket] = None
        self._across[ticket] = None
        if check is not None:
            self._checks[ticket] = check
        return ticket

    def leave(self, ticket: int) -> None:
        self._waiters.pop(ticket, None)
        self._sources.pop(ticket, None)
        self._checks.pop(ticket, None)
        self._across.pop(ticket, None)
        rank = self._rank_of.pop(ticket, None)
        if rank is not None:
            rotation = self._rotations[rank]
            del rotation[ticket]
            if not rotation:
                del self._rotations[rank]

    async def wait(self, ticket: int, timeout_s: float) -> object | None:
        """Return when woken or after ``timeout_s``, whichever comes first: the wake's source
        (None after a timeout, or when anything may have changed)."""
        event = self._waiters[ticket]
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):   # not wait_for: it wraps the wait in a task of its own
                await event.wait()
        except TimeoutError:
            timed_out = True
        event.clear()
        source = self._sources.pop(ticket, None)
        return None if timed_out else source

    def wake(self, n: int, source: object | None = None) -> None:
        """Up to ``n`` waiters, lowest rank first; within a rank those woken longest ago (oldest
        first at the start): a waiter woken goes to the back of its rank's rotation, so waiters
        that stay queued cannot hold every wake-up for themselves. One whose check says
        ``source`` cannot take it goes to the back unwoken, and the walk goes on: each rank has
        its next ``n`` checked until ``n`` are woken, so a lower rank is still offered what
        the higher ones could not take (at most ``n`` checks per rank present, whatever the
        queue's length). With more than one rank, one more waiter is offered each wake in a
        rotation over every rank, after them (``_turn_across``: woken last, it decides last)."""
        several_ranks = len(self._rotations) > 1
        self._walk_ranks(n, source)
        if several_ranks:
            self._turn_across(source)

    def _walk_ranks(self, n: int, source: object | None) -> None:
        woken = 0
        for rank in sorted(self._rotations):
            rotation = self._rotations[rank]
            for ticket in list(itertools.islice(rotation, n)):
                del rotation[ticket]
                rotation[ticket] = None   # to the back of its rank's rotation
                woken += self._wake_one(ticket, source)
                if woken >= n:
                    return

    def _turn_across(self, source: object | None) -> None:
        """The next waiter of the rotation over every rank: every waiter is offered a wake within
        as many wakes as there are waiters, whatever the higher ranks take (without it, 8
        waiters of a higher rank that take every wake, e.g. migrating requests with no check,
        kept a lower rank's request a worker could take queued to its deadline)."""
        ticket = next(iter(self._across))
        del self._across[ticket]
        self._across[ticket] = None
        self._wake_one(ticket, source)

    def _wake_one(self, ticket: int, source: object | None) -> bool:
        """Whether it is woken (or was already)."""
        event = self._waiters[ticket]
        pending = event.is_set()
        if not pending and source is not None and not self._may_take(ticket, source):
            return False
        if not pending or self._sources.get(ticket) is not source:
            # A second wake from another source before the waiter ran: both may have changed.
            self._sources[ticket] = None if pending else source
        event.set()
        return True

    def _may_take(self, ticket: int, source: object) -> bool:
        check = self._checks.get(ticket)
        if check is None:
            return True
        try:
            return check(source)
        except Exception:   # noqa: BLE001 - the waiter's own task checks again and meets it there,
            return True     # as it did before checks ran here: the reporter's handler never sees it
