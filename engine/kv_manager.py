"""Per-request block tables over a BlockPool: which blocks hold which request's tokens.

Life cycle: ``allocate_slots`` grows a request's table before a step that computes new
tokens (or reserves room for KV arriving from a prefill worker); ``free`` returns every block
at finish, abort or preemption. ``slot`` maps a token position to its flat slot in the cache.
"""

from __future__ import annotations

from engine.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_needed(self, req_id: str, num_tokens_total: int) -> int:
        have = len(self.block_tables.get(req_id, ()))
        return max(0, cdiv(num_tokens_total, self.block_size) - have)

    def can_allocate(self, req_id: str, num_tokens_total: int) -> bool:
        return self.num_blocks_needed(req_id, num_tokens_total) <= self.pool.num_free

    def allocate_slots(self, req_id: str, num_tokens_total: int) -> list[int]:
        """Make the table cover ``num_tokens_total`` tokens; return the newly added block ids."""
        new = self.pool.allocate(self.num_blocks_needed(req_id, num_tokens_total))
        self.block_tables.setdefault(req_id, []).extend(new)
        return new

    def free(self, req_id: str) -> None:
        blocks = self.block_tables.pop(req_id, None)
        if blocks:
            self.pool.free(blocks)

    def slot(self, req_id: str, position: int) -> int:
        table = self.block_tables[req_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size
