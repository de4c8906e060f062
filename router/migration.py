"""One client request across the attempts it may take when workers die under it.

Life cycle (Dynamo's request migration): the first attempt runs the client's spec. Every token
the client has been sent is recorded here. When an attempt loses its worker, ``migrate`` counts
it (past ``limit`` the request fails with UNAVAILABLE naming the cause), unless the attempt, one
begun after a move, found that worker already lost: the orchestrator says so (``found_lost``) when the attempt streamed
nothing and the worker answered nobody after the attempt began, as when a prefill and a decode
worker die together and the request, moved off the first, is placed on the second before its
death is known. One failure event then costs the request one migration, not two. Such a loss is
excused once per worker slot for the request's life (so a request whose every attempt kills
its worker at once still reaches the limit: at most one extra attempt per slot); the next attempt
runs under a fresh internal id (nothing of the lost attempt can answer for it; so does a
retry after a reservation refused for room) with the prompt
plus every token already sent, ``max_tokens`` reduced by as many, and ``num_generated`` set so
seeded sampling and stop strings continue where they were: the client sees one stream, no token
repeated and none missing, and greedy output equals an uninterrupted run. ``resumed`` is
that rule alone: a recompute after a failed KV hand-off continues after the first token the
prefill worker already streamed in the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.errors import WorkerFailedError
from engine.types import RequestSpec, TokenDelta

DEFAULT_MIGRATION_LIMIT = 3


@dataclass(slots=True)
class RequestMigration:
    spec: RequestSpec
    limit: int = DEFAULT_MIGRATION_LIMIT
    sent_token_ids: list[int] = field(default_factory=list)
    num_migrations: int = 0   # moves counted against ``limit``
    num_refusals: int = 0   # reservations refused for room since the last migration
    excused: set[str] = field(default_factory=set)   # worker slots found already lost (not counted)

    @property
    def num_moves(self) -> int:
        """Attempts begun after a lost worker, counted or excused."""
        return self.num_migrations + len(self.excused)

    def attempt_spec(self) -> RequestSpec:
        """What the current attempt runs."""
        if not self.num_moves and not self.num_refusals:
            return self.spec
        req_id = (self.spec.req_id + (f".m{self.num_moves}" if self.num_moves else "")
                  + (f".r{self.num_refusals}" if self.num_refusals else ""))
        return resumed(self.spec, tuple(self.sent_token_ids), req_id)

    def refused(self) -> None:
        """The attempt's reservation was refused for room: the next try runs under a fresh id,
        because the refused attempt's free may still be on its way to a decode worker (which
        then refuses any later reserve under that id)."""
        self.num_refusals += 1

    def sent(self, delta: TokenDelta) -> TokenDelta:
        """Record a delta on its way to the client, under the client's request id."""
        self.sent_token_ids.extend(delta.token_ids)
        return delta if delta.req_id == self.spec.req_id else dataclasses.replace(delta, req_id=self.spec.req_id)

    def migrate(self, cause: str, found_lost: str | None = None) -> bool:
        """The current attempt lost its worker: move on, or give up past the limit. ``found_lost``:
        the slot of a worker the attempt found already lost (see above; excused only once the
        request has moved). True when counted."""
        self.num_refusals = 0
        # Only a loss after a move is of the failure event that caused the move: the first
        # attempt's loss always counts (--migration-limit 0 still fails the request at once).
        if found_lost is not None and self.num_moves and found_lost not in self.excused:
            self.excused.add(found_lost)
            return False
        if self.num_migrations >= self.limit:
            raise WorkerFailedError(f"worker lost and the migration limit ({self.limit}) is reached: {cause}")
        self.num_migrations += 1
        return True


def resumed(spec: RequestSpec, sent: tuple[int, ...], req_id: str | None = None) -> RequestSpec:
    """``spec`` continued after ``sent``, the tokens its client already has: they join the
    prompt, ``max_tokens`` counts them, and ``num_generated`` marks them as output."""
    return dataclasses.replace(
        spec,
        req_id=spec.req_id if req_id is None else req_id,
        prompt_token_ids=spec.prompt_token_ids + sent,
        sampling=dataclasses.replace(spec.sampling, max_tokens=spec.sampling.max_tokens - len(sent)),
        num_generated=spec.num_generated + len(sent),
    )
