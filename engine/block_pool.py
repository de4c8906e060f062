"""A pool of fixed-size KV blocks with a free list.

Life cycle of a block: free -> allocated to one request -> freed at finish, abort or
preemption. The pool only counts ids; the bytes live in the KV cache tensor.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._allocated.update(ids)
        return ids

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if b not in self._allocated:
                raise RuntimeError(f"block {b} freed twice or never allocated")
            self._allocated.remove(b)
        # Freed blocks go to the front so the most recently used (warm) memory is reused first.
        self._free.extendleft(reversed(block_ids))
