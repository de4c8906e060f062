"""The hand-off record that tells a sender where a request's KV must land. Torch-free.

Life cycle of a ``KVBlocksHandle``:

1. The decode worker reserves destination blocks and creates the handle: ``req_id``,
   ``dst_block_ids``, ``num_tokens``, its own ``layout``, the ``transport`` and the
   receiver's ``locator`` (where the destination is: a /dev/shm path, a rank, a CUDA IPC
   descriptor). ``src_block_ids`` is still empty. When the decode worker's prefix cache
   already holds the prompt's first ``num_cached_tokens`` (whole blocks), the handle names only
   the rest: ``dst_block_ids`` and ``num_tokens`` start after them, and the sender picks its
   source blocks from the same place (``source_blocks``). Every transport moves what the
   handle names, so none of them needs to know.
2. The handle crosses to the prefill worker (through the router: Ray pickles it, so it must
   stay torch-free; the router never imports torch).
3. The prefill worker's sender ``bind``s it: fills ``src_block_ids`` (and its part of the
   locator, e.g. its rank), then ``send``s. Some senders return an updated handle (the
   object store puts an ``ObjectRef`` in the locator).
4. The decode worker's receiver ``receive``s with that handle; both sides check the layout
   and the block counts against their own cache and raise ``KVTransferError`` on mismatch.

Locator types live here, not in their backends, so that unpickling a handle never imports
torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from engine.errors import KVTransferError
from engine.types import KVLayout

_LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(KVLayout))


class KVGroupChangedError(KVTransferError):
    """The hand-off was set up in a KV group formed again since: its ranks may name other
    workers now, so nothing is sent (the request is recomputed; no fault of the pair's link)."""


class KVLayoutMismatchError(KVTransferError):
    """The two sides' ``KVLayout`` differ; ``field`` names the first field that does."""

    def __init__(self, field: str, expected: object, got: object) -> None:
        super().__init__(f"KV layout mismatch: {field} expected {expected!r}, got {got!r}")
        self.field, self.expected, self.got = field, expected, got

    def __reduce__(self):  # Ray re-raises it in the caller: it must unpickle with its fields
        return type(self), (self.field, self.expected, self.got)


def check_layout(expected: KVLayout, got: KVLayout) -> None:
    """Raise ``KVLayoutMismatchError`` (a ``KVTransferError``) naming the first differing field."""
    for name in _LAYOUT_FIELDS:
        want, have = getattr(expected, name), getattr(got, name)
        if want != have:
            raise KVLayoutMismatchError(name, want, have)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return math.ceil(num_tokens / block_size)


@dataclass(frozen=True, slots=True)
class DistPeers:
    """``torch_dist`` locator: the two ranks of the pair in the default process group, and which
    group that is (ranks name other workers once the group is formed again)."""

    dst_rank: int                   # the decode worker's rank (set when the handle is made)
    src_rank: int | None = None     # the prefill worker's rank (set by the sender's bind)
    group: str = ""                 # the group the ranks are in (its rendezvous address: one per forming)


@dataclass(frozen=True, slots=True)
class CudaIpcLocator:
    """``cuda_ipc`` locator: a torch-free copy of what ``storage._share_cuda_()`` returns,
    plus the cache tensor's geometry, so the prefill worker can open the decode worker's
    cache without the router ever unpickling a tensor."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: str


_UNSET: Any = object()


@dataclass(frozen=True, slots=True)
class KVBlocksHandle:
    """Where one request's KV comes from and where it must land (see the module docstring)."""

    req_id: str
    src_block_ids: tuple[int, ...]  # prefill worker's blocks; empty until the sender binds
    dst_block_ids: tuple[int, ...]  # decode worker's reserved blocks, in token order
    num_tokens: int                 # tokens of KV to move; the last block may be partial
    layout: KVLayout                # the decode worker's layout; both sides must match it
    transport: str                  # a name in kvtransfer.select.TRANSPORTS
    locator: Any = None             # transport-specific, torch-free, picklable
    # Wall clock (time.time()) after which no writer may start: the decode side may free the
    # blocks once it passes even if it never heard from the writer. 0: no lease.
    lease_deadline_s: float = 0.0
    # Leading prompt tokens (whole blocks) whose KV the decode worker holds already: not moved.
    num_cached_tokens: int = 0

    def source_blocks(self, prompt_block_ids: Sequence[int]) -> tuple[int, ...]:
        """The prefill side's blocks to send, given all of its prompt's blocks in token order."""
        skip = self.num_cached_tokens // self.layout.block_size
        return tuple(prompt_block_ids[skip : skip + self.num_blocks])

    @property
    def num_blocks(self) -> int:
        return len(self.dst_block_ids)

    @property
    def num_bytes(self) -> int:
        """Bytes moved: whole blocks, K and V, every layer."""
        return self.num_blocks * self.layout.bytes_per_block

    def with_source(self, src_block_ids: Sequence[int], locator: Any = _UNSET) -> KVBlocksHandle:
        """A copy with the prefill side filled in (and optionally a new locator)."""
        new_locator = self.locator if locator is _UNSET else locator
        return dataclasses.replace(
            self, src_block_ids=tuple(int(b) for b in src_block_ids), locator=new_locator
        )

    def check_counts(self) -> None:
        """Raise ``KVTransferError`` unless both id lists hold ceil(num_tokens/block_size) ids."""
        if self.num_tokens <= 0:
            raise KVTransferError(f"{self.req_id}: num_tokens must be positive, got {self.num_tokens}")
        need = blocks_needed(self.num_tokens, self.layout.block_size)
        for name in ("src_block_ids", "dst_block_ids"):
            have = len(getattr(self, name))
            if have != need:
                raise KVTransferError(
                    f"{self.req_id}: {name} has {have} blocks, {self.num_tokens} tokens need {need}"
                )
