"""The requests admission queued for KV room, in the order room goes to them.

Order: priority first (lower runs first, vLLM's rule; every request is 0 under FCFS), then when
each began to wait. The first one holds the room it waits for against the others
(``Admission._hold``), as an engine's waiting queue would. Kept per priority class, each class
in waiting order, so the first is found among the few classes present, not by a sort of the
line (which may hold thousands in a burst).

Life cycle per request: ``place`` at each decision that queues it for room (the first sets its
place: at the back of its class, or where an earlier ``since`` puts it, a retry keeping its
arrival) -> ``leave`` once admitted, refused, gone, or queued for something else.
"""

from __future__ import annotations

from typing import Iterator

from router.pair_search import RoomHold


class RoomLine:
    def __init__(self) -> None:
        self._classes: dict[int, dict[str, RoomHold]] = {}   # priority -> its requests in waiting order
        self._priority_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._priority_of)

    def __iter__(self) -> Iterator[str]:
        for priority in sorted(self._classes):
            yield from self._classes[priority]

    def __getitem__(self, req_id: str) -> RoomHold:
        return self._classes[self._priority_of[req_id]][req_id]

    def get(self, req_id: str) -> RoomHold | None:
        priority = self._priority_of.get(req_id)
        return None if priority is None else self._classes[priority][req_id]

    def first(self) -> tuple[str, RoomHold, int] | None:
        """The request room goes to next, its hold and its priority."""
        if not self._classes:
            return None
        priority = min(self._classes)
        req_id, hold = next(iter(self._classes[priority].items()))
        return req_id, hold, priority

    def place(self, req_id: str, hold: RoomHold, priority: int) -> None:
        """Queue ``req_id`` (or update what it waits for, keeping its place)."""
        waiting = self._classes.setdefault(priority, {})
        new = req_id not in waiting
        last = next(reversed(waiting.values()), None) if new else None
        waiting[req_id] = hold
        self._priority_of[req_id] = priority
        if last is not None and hold.since < last.since:   # a retry keeps its arrival: its place is earlier
            self._classes[priority] = dict(sorted(waiting.items(), key=lambda item: item[1].since))

    def leave(self, req_id: str) -> bool:
        """Out of the line; whether it was the first (what it held may now go to the next)."""
        priority = self._priority_of.pop(req_id, None)
        if priority is None:
            return False
        first = self.first()
        was_first = first is not None and first[0] == req_id
        waiting = self._classes[priority]
        del waiting[req_id]
        if not waiting:
            del self._classes[priority]
        return was_first
