"""The router's guess of which prompt prefixes one worker's KV cache holds. Torch-free.

Life cycle: the launcher gives each worker handle an index (its block size, whether its engine
caches prefixes); every request placed there ``record``s its prompt's block hashes (computed
with the engine's own function, ``engine.prefix_hash``) and admission asks ``expected_hit`` of
the next prompts; a replacement worker starts with an empty index (its pool is fresh).

Approximate by design, as the Dynamo / llm-d / SGLang routers' indexes are. Two feeds:
the router's own placements (``record``: at once, a guess that the worker will cache the
prompt) and the worker's KV events (``apply``: Dynamo-style "block stored" / "block removed",
numbered per worker, carried by the messages the worker sends anyway: decode stream batches,
prefill results), which correct the guess: a prefix the worker evicted is forgotten, so
admission does not route to it. Events arrive in order on a decode worker's stream; prefill
results may be lost or cross, so a repeated number is skipped and a gap (a report lost, and
with it maybe a removal) clears the index: it refills from later events and placements, and
never keeps a prefix it was not told about since. Bounded to the worker's pool size
(``WorkerStats.num_total_blocks``) with least-recently-placed eviction as a backstop. A wrong
guess costs only a routing choice: the worker confirms every hit itself against the tokens it
stored. What the workers did find is reported back in WorkerStats (prefix-cache query and hit
tokens) and exported as metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from engine.prefix_hash import block_hashes, max_cached_tokens
from engine.types import KVEvent, KVEventKind

_memo: dict[int, tuple[Sequence[int], list[int]]] = {}   # block size -> (the last prompt, its hashes)


def prompt_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Full-block hashes of a prompt; the last prompt's are memoized (admission asks about the
    same prompt once per candidate worker, and again each time a queued request is re-decided)."""
    last = _memo.get(block_size)
    if last is not None and last[0] is token_ids:
        return last[1]
    hashes = block_hashes(token_ids, block_size)
    _memo[block_size] = (token_ids, hashes)
    return hashes


class PrefixIndex:
    def __init__(self, block_size: int = 16, enabled: bool = False) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._seq = 0          # the last event applied
        self.num_gaps = 0      # event reports lost (each cleared the index)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def last_seq(self) -> int:
        """The number of the last KV event applied (0: none yet)."""
        return self._seq

    def expected_hit(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens this worker probably holds the KV of (whole leading blocks, never the
        last token: the engine's own rule)."""
        if not self.enabled or not self._blocks:
            return 0
        limit = max_cached_tokens(len(token_ids)) // self.block_size
        n = 0
        for h in prompt_hashes(token_ids, self.block_size)[:limit]:
            if h not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def record(self, token_ids: Sequence[int], capacity_blocks: int | None = None) -> None:
        """The prompt was placed here: its full blocks will be cached. Most recent last, and a
        prompt's first block last of all: like the pool, evict a prefix from its tail."""
        if not self.enabled:
            return
        for h in reversed(prompt_hashes(token_ids, self.block_size)):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while capacity_blocks is not None and len(self._blocks) > capacity_blocks:
            self._blocks.popitem(last=False)

    def apply(self, events: Sequence[KVEvent]) -> None:
        """The worker's cache changed: stored blocks become expected hits, removed ones stop
        being. Events already applied are skipped; after a gap the index starts over."""
        if not self.enabled:
            return
        fresh = [e for e in events if e.seq > self._seq]
        if not fresh:
            return
        if fresh[0].seq != self._seq + 1:
            self.num_gaps += 1
            self._blocks.clear()
        for e in fresh:
            if e.kind is KVEventKind.STORED:
                self._blocks.setdefault(e.block_hash)
            else:
                self._blocks.pop(e.block_hash, None)
        self._seq = fresh[-1].seq

    def clear(self) -> None:
        self._blocks.clear()
