"""A pool of fixed-size KV blocks: reference counts, a free queue, and the prefix cache's index.

Life cycle of a block: free -> allocated (reference count 1) -> shared by every request whose
prompt starts with the same content (count + 1 each) -> free again when the last one lets go.
A freed block that holds a full block of cached content stays findable by its content hash
while it waits in the free queue; it is evicted (forgotten) only when ``allocate`` reuses it.
The free queue is ordered for that: blocks holding no cached content sit at the front and go
first (they are warm, and nothing is lost by reusing them), cached ones join the back and go
least recently freed first (vLLM v1's LRU eviction). The pool only counts ids; the bytes live
in the KV cache tensor.

A hash is a lookup key, never proof. Each cached block remembers its token ids and the serial
number of its parent block's cached content (serials are never reused, unlike block ids and,
under a collision, hashes), and ``lookup`` confirms both, block after block from the first: a
confirmed chain is exactly the request's tokens, so a collision costs a recompute, never wrong KV.
Invariant: every cached block's parent content is cached too. Evicting a block uncaches its
cached descendants with it (no lookup could reach them: their parent serial is gone), so no
entry is ever orphaned, holding its hash against the same content filed again after a
recomputed parent; and content whose parent has gone is never filed.

Every change to what is findable is recorded as a numbered ``KVEvent`` (stored / removed, by
hash) until ``take_events``: the worker reports them to the router's prefix index.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import count
from typing import Sequence

from engine.types import KVEvent, KVEventKind

# Events nobody takes (an engine driven in-process) are dropped oldest first past this: the
# router notices the gap in their numbers.
MAX_PENDING_EVENTS = 1 << 16


@dataclass(frozen=True, slots=True)
class CachedContent:
    block_hash: int
    token_ids: tuple[int, ...]
    parent_serial: int      # serial of the previous block's content; 0 for a prompt's first block
    serial: int             # unique per cached content, never reused


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._content: dict[int, CachedContent] = {}   # block id -> what it holds, while cached
        self._by_hash: dict[int, int] = {}             # content hash -> block id
        self._by_serial: dict[int, int] = {}           # content serial -> block id, while cached
        self._children: dict[int, set[int]] = {}       # parent serial -> cached blocks filed under it
        self._serials = count(1)
        self._events: deque[KVEvent] = deque(maxlen=MAX_PENDING_EVENTS)
        self._event_seq = count(1)
        self.num_collisions = 0    # lookups and inserts whose hash matched different content
        self.num_evictions = 0     # cached blocks reused for other content
        self.version = 0           # bumped by every change to what ``lookup`` can find

    @property
    def num_free(self) -> int:
        """Blocks no request holds, cached or not: all of them can be handed out."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._content)

    def is_free(self, block_id: int) -> bool:
        return self._ref_cnt[block_id] == 0

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self._evict(b)
            self._ref_cnt[b] = 1
        return ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Share cached blocks with one more request (taking them off the free queue if idle)."""
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. Given in token order: the tail of a prompt is the
        least shared part, so it joins the free queue first and is evicted first."""
        for b in reversed(block_ids):
            if self._ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed twice or never allocated")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None
                if b not in self._content:
                    self._free.move_to_end(b, last=False)

    # ---- the prefix cache's index ---------------------------------------------------------------
    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_serial: int) -> int | None:
        """The block holding exactly this content after that parent, or None."""
        b = self._by_hash.get(block_hash)
        if b is None:
            return None
        c = self._content[b]
        if c.token_ids != token_ids or c.parent_serial != parent_serial:
            self.num_collisions += 1
            return None
        return b

    def serial(self, block_id: int) -> int:
        return self._content[block_id].serial

    def cache(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent_serial: int) -> int | None:
        """Record that ``block_id`` (held by a request) now holds this content; return the
        content's serial. Content cached already in another block returns that block's serial
        (the request's chain goes on through it). None: this block stays uncached, and so does
        everything after it in this request, when the hash is taken by different content (a
        collision) or the parent's content is no longer cached (the request's chain went
        through another block's copy of it, since evicted)."""
        existing = self.lookup(block_hash, token_ids, parent_serial)
        if existing is not None:
            return self._content[existing].serial
        if block_hash in self._by_hash or (parent_serial and parent_serial not in self._by_serial):
            return None
        content = CachedContent(block_hash, token_ids, parent_serial, next(self._serials))
        self._content[block_id] = content
        self._by_hash[block_hash] = block_id
        self._by_serial[content.serial] = block_id
        if parent_serial:
            self._children.setdefault(parent_serial, set()).add(block_id)
        self._record(KVEventKind.STORED, block_hash)
        return content.serial

    def take_events(self) -> tuple[KVEvent, ...]:
        """The cache's changes since the last call, oldest first."""
        events = tuple(self._events)
        self._events.clear()
        return events

    def _record(self, kind: KVEventKind, block_hash: int) -> None:
        self.version += 1
        self._events.append(KVEvent(next(self._event_seq), kind, block_hash))

    def _evict(self, block_id: int) -> None:
        if block_id in self._content:
            self.num_evictions += 1
            self._uncache(block_id)

    def _uncache(self, block_id: int) -> None:
        """Forget the block's content and, with it, every cached descendant's (unreachable
        now). A descendant no request holds moves to the front of the free queue: it holds
        nothing worth keeping."""
        stack = [block_id]
        while stack:
            b = stack.pop()
            content = self._content.pop(b)
            del self._by_hash[content.block_hash]
            del self._by_serial[content.serial]
            siblings = self._children.get(content.parent_serial)
            if siblings is not None:
                siblings.discard(b)
                if not siblings:
                    del self._children[content.parent_serial]
            self._record(KVEventKind.REMOVED, content.block_hash)
            if b != block_id and b in self._free:
                self._free.move_to_end(b, last=False)
            stack.extend(self._children.pop(content.serial, ()))
