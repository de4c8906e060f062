"""Content hashes of full KV blocks (vLLM v1's prefix-caching key). Torch-free: the router
computes the same hashes to guess which worker holds a prompt's prefix.

A block's hash covers its parent block's hash and its own token ids, so equal hashes mean
(barring a collision) an equal whole prefix up to and including that block. Only full blocks
are hashed: a partial block is still being written. A hash is a key to look a block up, never
proof: the engine confirms every hit against the tokens it stored (``engine.block_pool``), so a
collision costs a recompute, never wrong KV. The function is injectable (``HashFn``) so tests
can force collisions.

Rule written once: a request's cached prefix may cover at most ``max_cached_tokens`` of its
tokens, because the last one must be computed to give the logits of the next token.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Callable, Sequence

# (parent block hash or None for the first block, this block's token ids) -> hash
HashFn = Callable[[int | None, tuple[int, ...]], int]


def default_block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """64-bit blake2b of the parent hash and the token ids: the same in every process and on
    every machine (Python's ``hash`` is too, for ints, but is not specified to stay so)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((-1 if parent is None else parent).to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def block_hashes(token_ids: Sequence[int], block_size: int, hash_fn: HashFn = default_block_hash,
                 known: Sequence[int] = ()) -> list[int]:
    """Hashes of every full block of ``token_ids``; ``known`` (a prefix of the answer, from an
    earlier call on a prefix of these tokens) is extended, not recomputed."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_fn(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


def max_cached_tokens(num_tokens: int) -> int:
    """At most this many of a request's tokens may come from the cache: the last is computed."""
    return max(0, num_tokens - 1)
