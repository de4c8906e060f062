"""The router's view of its workers: actor handles, placement, state, live stats, in-flight load.

Life cycle of a worker slot (``WorkerHandle``, one per worker id, owned here and changed only
through its methods): the launcher ``add``s each started worker (READY, generation 0); stats
arrive with every decode stream batch and after each prefill; the router counts what it has in
flight per worker (stats lag by a step, its own counters do not): prompt tokens still to
prefill, the long-run rate of prompt tokens sent here to prefill (the prefill load a colocated
worker will carry while a new request decodes), and the progress of every request sent here to
decode (its count is the worker's in-flight load; how much more stall each can absorb before it
misses its TPOT target). When a call or stream of generation g finds the actor dead,
``mark_down(g)`` moves the slot to RESTARTING (only the first report of that generation counts:
a late failure of an old actor never takes down its replacement) and the supervisor starts a
replacement; ``replace`` installs it as generation g+1 with fresh stats and no load (whatever
the old actor held is gone with its process). DEAD: given up (restart limit) or shut down.
Every answer from the current actor (a call's reply, a streamed item, a decode stream batch)
stamps ``heard``: ``heard_since`` tells a request whether the actor it lost was still alive
after its attempt began (router.migration: a loss of one already dead is not charged to it).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from engine.types import WorkerStats
from kvtransfer.select import choose_transport
from router.prefix_index import PrefixIndex

PREFILL_RATE_TAU_S = 60.0   # the prefill load a request decodes under: a minute, not a burst
MIN_RATE_WINDOW_S = 5.0     # a young estimate divides by at least this much history
PAIR_FAILURE_LIMIT = 2      # failed hand-offs in a row before a pair gives up on its transport

logger = logging.getLogger(__name__)


class WorkerState(str, enum.Enum):
    READY = "ready"             # serving
    RESTARTING = "restarting"   # its actor died; a replacement is on its way
    DEAD = "dead"               # gave up restarting it, or the cluster is stopping


# ``alive`` is read for every worker in every admission decision (several times): a module
# constant is read in a third of the time an enum member is through its class (Python 3.11).
_READY = WorkerState.READY


@dataclass(slots=True, eq=False)
class DecodeProgress:
    """A request decoding on a worker, as the router sees its stream: how far it is and the
    TPOT it must average, so admission can tell how much more stall it can take."""

    max_tokens: int
    tpot_target_s: float | None
    first_token_s: float | None = None
    num_tokens: int = 0
    predicted_tpot_s: float | None = None   # admission's projection at its first token
    prefill_mark: int = 0   # the worker's prompt tokens sent for prefill, up to and with its own

    def on_tokens(self, n: int, now: float | None = None) -> None:
        if n and self.first_token_s is None:
            self.first_token_s = time.perf_counter() if now is None else now
        self.num_tokens += n

    def projected_tpot(self, now: float, step_s: float, stall_s: float) -> float | None:
        """Its TPOT if it stalls ``stall_s`` (after its first token) and every remaining token
        then takes ``step_s``; before its first token, all of it is still ahead."""
        if self.max_tokens < 2:
            return None
        if self.first_token_s is None:
            return (stall_s + (self.max_tokens - 1) * step_s) / (self.max_tokens - 1)
        remaining = max(0, self.max_tokens - self.num_tokens)
        return (now - self.first_token_s + stall_s + remaining * step_s) / (self.max_tokens - 1)


@dataclass(slots=True, eq=False)
class WorkerHandle:
    worker_id: str
    role: str                     # "prefill" | "decode" | "colocated"
    actor: Any
    node_id: str
    device: str
    stats: WorkerStats | None = None
    num_prefill_tokens: int = 0   # prompt tokens sent here to prefill, first token not yet seen
    prefill_tokens_sent: int = 0  # every prompt token ever sent here to prefill (orders the queue)
    shm_path: str | None = None   # a decode worker's /dev/shm KV pool (unlinked at shutdown)
    submit_path: str | None = None   # a prefill worker's socket for direct submissions (same node only)
    decoding: dict[str, DecodeProgress] = field(default_factory=dict)  # by request id
    state: WorkerState = WorkerState.READY
    generation: int = 0           # bumped by every replacement: tells an old actor's failures apart
    restarts: int = 0
    pid: int | None = None        # the actor's process (operators and failure tests)
    prefix: PrefixIndex = field(default_factory=PrefixIndex)   # prompt prefixes its cache probably holds
    promised_blocks: int = 0      # blocks reserved for (or soon asked of) this decode worker, not yet decoding
    served: bool = False          # this generation ran engine steps: its model works (router.supervisor's backoff)
    _heard: tuple[int, float] | None = None   # (generation, monotonic time) of its last answer
    _prefill_rate: float = 0.0    # decayed prompt tokens/s assigned here (see prefill_token_rate)
    _prefill_rate_at: float = 0.0
    _first_prefill_at: float | None = None

    @property
    def alive(self) -> bool:
        """Serving now: the only state requests are sent to."""
        return self.state is _READY

    def mark_down(self, generation: int) -> bool:
        """The actor of ``generation`` died. True when this is news (the caller then gets it
        replaced); False for a stale report or a slot already down."""
        if generation != self.generation or self.state is not WorkerState.READY:
            return False
        self.state = WorkerState.RESTARTING
        return True

    def mark_dead(self) -> None:
        self.state = WorkerState.DEAD

    def replace(self, actor: Any, info: dict) -> None:
        """A fresh actor (``info``: what its ``start`` returned) takes this slot: nothing of the
        old one's load or stats carries over."""
        self.actor, self.node_id, self.device = actor, info["node_id"], info["device"]
        self.shm_path, self.pid, self.submit_path = info.get("shm_path"), info.get("pid"), info.get("submit_path")
        self.generation += 1
        self.restarts += 1
        self.stats = None
        self.prefix = PrefixIndex(self.prefix.block_size, self.prefix.enabled)   # a fresh pool
        self.num_prefill_tokens = 0
        self.promised_blocks = 0
        self.decoding.clear()
        self.served = False
        self.state = WorkerState.READY

    def heard(self, generation: int) -> None:
        """The actor of ``generation`` answered (a reply, a streamed item): it was alive now."""
        if generation == self.generation:
            self._heard = (generation, time.monotonic())

    def heard_since(self, generation: int, since_s: float) -> bool:
        """The actor of ``generation`` answered after ``since_s`` (monotonic). False when unknown:
        a replacement already answered, and the lost actor's stamp went with its slot."""
        return self._heard is not None and self._heard[0] == generation and self._heard[1] > since_s

    def observe_stats(self, stats: WorkerStats | None) -> None:
        if stats is not None:
            self.stats = stats
            self.served = self.served or bool(stats.recent_steps)   # steps are only recorded by real steps

    def observe_kv_events(self, events, generation: int) -> None:
        """Prefix-cache events from the actor of ``generation`` (an old one's are dropped: its
        cache went with it)."""
        if events and generation == self.generation:
            self.prefix.apply(events)

    def placed_prompt(self, token_ids) -> None:
        """A prompt sent here (to prefill, or to decode): its prefix will be in this worker's cache."""
        self.prefix.record(token_ids, self.stats.num_total_blocks if self.stats else None)

    def promise(self, num_prompt_tokens: int) -> int:
        """A prefill is sent whose KV will ask this decode worker for its prompt's blocks: counted
        from now until the request decodes here (``keep_promise``). Returns the blocks promised."""
        blocks = self.blocks_for(num_prompt_tokens)
        self.promised_blocks += blocks
        return blocks

    def keep_promise(self, blocks: int, generation: int) -> None:
        """The promise is over: the request decodes here (its blocks are in the reports from now
        on) or it ended; ``generation``: the actor it was made to (a replacement holds none)."""
        if generation == self.generation:
            self.promised_blocks -= blocks

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks ``num_tokens`` take in this worker's pool (0 before its first report)."""
        return -(-num_tokens // self.stats.block_size) if self.stats is not None else 0

    @property
    def free_blocks(self) -> int | None:
        """Free blocks as admission must see them: the last report's, less the reservations in
        flight the report may not show yet. The report's parked blocks are reservations already
        made: the router counts them among its promises, so they are added back (counted once)."""
        if self.stats is None:
            return None
        return self.stats.num_free_blocks + self.stats.num_parked_blocks - self.promised_blocks

    def track(self, req_id: str, progress: DecodeProgress) -> None:
        """A request sent here to decode: counted until ``untrack``."""
        self.decoding[req_id] = progress

    def untrack(self, req_id: str) -> None:
        self.decoding.pop(req_id, None)

    @property
    def num_inflight(self) -> int:
        """Requests the router has sent here to decode and not seen finish."""
        return len(self.decoding)

    def begin_prefill(self, num_tokens: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.num_prefill_tokens += num_tokens
        self.prefill_tokens_sent += num_tokens
        if self._first_prefill_at is None:
            self._first_prefill_at = now
        self._prefill_rate = self._decayed_rate(now) + num_tokens / PREFILL_RATE_TAU_S
        self._prefill_rate_at = now

    def end_prefill(self, num_tokens: int, generation: int | None = None) -> None:
        """``generation``: the actor the prompt was sent to; a replacement never counted it."""
        if generation is None or generation == self.generation:
            self.num_prefill_tokens -= num_tokens

    def prefill_token_rate(self, now: float) -> float:
        """Prompt tokens per second assigned here to prefill: an exponentially weighted average
        (time constant ``PREFILL_RATE_TAU_S``, long enough that a Poisson burst does not read as
        a new load level), divided by the share of the window traffic has been seen for, so a
        young estimate is not biased toward zero (the start of an overload reads as one)."""
        if self._first_prefill_at is None:
            return 0.0
        seen_s = max(MIN_RATE_WINDOW_S, now - self._first_prefill_at)
        return self._decayed_rate(now) / -math.expm1(-seen_s / PREFILL_RATE_TAU_S)

    def _decayed_rate(self, now: float) -> float:
        return self._prefill_rate * math.exp(-max(0.0, now - self._prefill_rate_at) / PREFILL_RATE_TAU_S)


@dataclass(slots=True)
class WorkerRegistry:
    prefill: list[WorkerHandle] = field(default_factory=list)
    decode: list[WorkerHandle] = field(default_factory=list)
    forced_transport: str | None = None
    dist_ready: bool = False      # the torch.distributed group is up
    _transports: dict[tuple[str, str], str] = field(default_factory=dict)
    _failures: dict[tuple[str, str], int] = field(default_factory=dict)   # consecutive failed hand-offs

    def add(self, handle: WorkerHandle) -> None:
        (self.prefill if handle.role == "prefill" else self.decode).append(handle)

    @property
    def all(self) -> list[WorkerHandle]:
        return self.prefill + self.decode

    def alive(self, role: str) -> list[WorkerHandle]:
        return [w for w in (self.prefill if role == "prefill" else self.decode) if w.alive]

    def recovering(self, role: str) -> list[WorkerHandle]:
        """Workers of ``role`` down now but on their way back."""
        return [w for w in (self.prefill if role == "prefill" else self.decode)
                if w.state is WorkerState.RESTARTING]

    @property
    def can_serve(self) -> bool:
        """A complete serving path exists: a decode (or colocated) worker is up; it can also
        prefill when no prefill worker is. (Asked at every admission decision: stops at the first.)"""
        return any(w.alive for w in self.decode)

    def kv_group_up(self) -> None:
        """The torch.distributed group is formed (at start, or again after a loss): pairs use it
        where it is the best transport (or everywhere, when it is forced)."""
        self.dist_ready = True
        self._transports.clear()
        self._failures.clear()

    def lose_kv_group(self) -> None:
        """A member of the torch.distributed group died, which breaks the group for everyone:
        route pairs around it (shm on one node, the object store across nodes) until it is
        formed again, once the lost member's replacement is up (router/kv_group.py)."""
        if self.dist_ready:   # a forced torch_dist gives way meanwhile (choose_transport)
            self.dist_ready = False
            self._transports.clear()
            logger.warning("the torch.distributed KV group lost a member: KV moves over shm on one node and "
                           "the object store across nodes until the group is formed again")

    def transport(self, p: WorkerHandle, d: WorkerHandle) -> str:
        key = (p.worker_id, d.worker_id)
        if key not in self._transports:
            self._transports[key] = choose_transport(
                p.node_id, d.node_id, p.device, self.forced_transport,
                decode_device=d.device, dist_ready=self.dist_ready,
            )
        return self._transports[key]

    def forget_pairs(self, worker: WorkerHandle) -> None:
        """``worker`` was replaced (maybe on another node or GPU): choose its pairs' transports anew."""
        for key in [k for k in self._transports if worker.worker_id in k]:
            del self._transports[key]
        for key in [k for k in self._failures if worker.worker_id in k]:
            del self._failures[key]

    def handoff_done(self, p: WorkerHandle, d: WorkerHandle, ok: bool) -> None:
        """A pair whose transport failed ``PAIR_FAILURE_LIMIT`` hand-offs in a row (a broken
        torch.distributed link, say) falls back to the object store, which needs no link."""
        key = (p.worker_id, d.worker_id)
        self._failures[key] = 0 if ok else self._failures.get(key, 0) + 1
        if self._failures[key] >= PAIR_FAILURE_LIMIT and self._transports.get(key) != "object_store":
            self._transports[key] = "object_store"
            self._failures[key] = 0

    def force_transport(self, name: str | None) -> None:
        """Use ``name`` for every pair from now on (None: choose from placement again)."""
        self.forced_transport = name
        self._transports.clear()

    def get(self, worker_id: str) -> WorkerHandle | None:
        return next((w for w in self.all if w.worker_id == worker_id), None)
