"""Per-request block tables over a BlockPool: which blocks hold which request's tokens, and the
prefix cache that lets requests share the blocks of a common prefix.

Life cycle of a request's table:
  ``find_cached`` (the longest cached, confirmed prefix of its tokens; never all of them: the
  last token is computed for its logits) -> ``admit`` (shares those blocks, allocates the rest
  for the first chunk; or, on a decode worker, for KV arriving from a prefill worker)
  -> ``allocate_slots`` before each step that computes more tokens -> ``cache_computed`` after
  it, which files every block that became full under its content hash -> ``free`` at finish,
  abort or preemption: shared blocks lose one reference, cached ones stay findable until evicted.
``slot`` maps a token position to its flat slot in the cache. With prefix caching off,
``find_cached`` finds nothing and nothing is filed: plain paging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from engine.block_pool import BlockPool
from engine.prefix_hash import HashFn, block_hashes, default_block_hash, max_cached_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _Chain:
    """What the cache knows of one request's blocks."""

    hashes: list[int] = field(default_factory=list)   # of every full block of its tokens so far
    num_filed: int = 0          # leading blocks found in, or filed into, the cache
    last_serial: int = 0        # serial of block ``num_filed - 1``'s content (0: none yet)
    broken: bool = False        # a hash collision stopped filing this request's blocks
    # The last ``find_cached`` answer and what it depended on (pool version, token count): a
    # queue head blocked for room asks every step, and the answer holds until the cache changes.
    found: tuple[int, ...] = ()
    found_key: tuple[int, int] | None = None


@dataclass(slots=True)
class PrefixCacheCounters:
    """Running totals (tokens), reported in WorkerStats."""

    queries: int = 0    # tokens of requests that looked for a cached prefix
    hits: int = 0       # of those, tokens whose KV came from the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 hash_fn: HashFn = default_block_hash) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.counters = PrefixCacheCounters()
        self._chains: dict[str, _Chain] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free ones included: they are reused on demand)."""
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_needed(self, req_id: str, num_tokens_total: int) -> int:
        have = len(self.block_tables.get(req_id, ()))
        return max(0, cdiv(num_tokens_total, self.block_size) - have)

    def covers(self, req_id: str, num_tokens_total: int) -> bool:
        """``req_id``'s table already has room for ``num_tokens_total`` tokens."""
        table = self.block_tables.get(req_id)
        return table is not None and len(table) * self.block_size >= num_tokens_total

    def can_allocate(self, req_id: str, num_tokens_total: int) -> bool:
        return self.num_blocks_needed(req_id, num_tokens_total) <= self.pool.num_free

    def allocate_slots(self, req_id: str, num_tokens_total: int) -> list[int]:
        """Make the table cover ``num_tokens_total`` tokens; return the newly added block ids."""
        new = self.pool.allocate(self.num_blocks_needed(req_id, num_tokens_total))
        self.block_tables.setdefault(req_id, []).extend(new)
        return new

    def free(self, req_id: str) -> None:
        self._chains.pop(req_id, None)
        blocks = self.block_tables.pop(req_id, None)
        if blocks:
            self.pool.free(blocks)

    def slot(self, req_id: str, position: int) -> int:
        table = self.block_tables[req_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # ---- the prefix cache ----------------------------------------------------------------------
    def find_cached(self, req_id: str, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids`` (a request not yet admitted),
        confirmed block by block against the stored tokens; at most ``max_cached_tokens``."""
        if not self.enable_prefix_caching:
            return []
        chain = self._chain(req_id, token_ids)
        key = (self.pool.version, len(token_ids))
        if chain.found_key == key:
            return list(chain.found)
        found: list[int] = []
        parent = 0
        bs = self.block_size
        for i in range(max_cached_tokens(len(token_ids)) // bs):
            b = self.pool.lookup(chain.hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]), parent)
            if b is None:
                break
            found.append(b)
            parent = self.pool.serial(b)
        chain.found, chain.found_key = tuple(found), key
        return found

    def can_admit(self, req_id: str, cached: Sequence[int], num_tokens_total: int) -> bool:
        """Room for the blocks to allocate, plus the cached ones that are idle in the free queue
        (sharing them takes them off it)."""
        new = cdiv(num_tokens_total, self.block_size) - len(cached)
        idle = sum(1 for b in cached if self.pool.is_free(b))
        return max(0, new) + idle <= self.pool.num_free

    def admit(self, req_id: str, token_ids: Sequence[int], cached: Sequence[int], num_tokens_total: int) -> int:
        """Start ``req_id``'s table with the ``cached`` blocks shared and room for
        ``num_tokens_total`` tokens; return the number of cached tokens."""
        self.pool.touch(cached)
        self.block_tables[req_id] = list(cached)
        self.allocate_slots(req_id, num_tokens_total)
        num_cached = len(cached) * self.block_size
        if self.enable_prefix_caching:
            chain = self._chain(req_id, token_ids)
            chain.num_filed = len(cached)
            chain.last_serial = self.pool.serial(cached[-1]) if cached else 0
            self.counters.queries += len(token_ids)
            self.counters.hits += num_cached
        return num_cached

    def cache_computed(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """File every block of ``req_id`` that the computed tokens filled (its KV is written)."""
        chain = self._chains.get(req_id) if self.enable_prefix_caching else None
        bs = self.block_size
        if chain is None or chain.broken or num_computed_tokens // bs <= chain.num_filed:
            return   # most decode steps: no block became full
        chain.hashes = block_hashes(token_ids[: num_computed_tokens], bs, self.hash_fn, chain.hashes)
        table = self.block_tables[req_id]
        for i in range(chain.num_filed, num_computed_tokens // bs):
            serial = self.pool.cache(table[i], chain.hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]),
                                     chain.last_serial)
            if serial is None:
                chain.broken = True
                return
            chain.num_filed, chain.last_serial = i + 1, serial

    def _chain(self, req_id: str, token_ids: Sequence[int]) -> _Chain:
        chain = self._chains.setdefault(req_id, _Chain())
        chain.hashes = block_hashes(token_ids, self.block_size, self.hash_fn, chain.hashes)
        return chain
