"""The connector interface: a sender in the prefill worker, a receiver in the decode worker.

One hand-off, whatever the backend:

    decode worker                                prefill worker
    -------------                                --------------
    reserve dst blocks
    handle = KVBlocksHandle(req_id, (), dst_ids,
        num_tokens, layout, transport,
        locator=receiver.locator(cache))  ──▶    handle = sender.bind(handle, src_ids)
                                                 result = sender.send(cache, handle)
    receiver.receive(cache, result.handle) ◀──   (hand result.handle over)
    admit the request; on error free the blocks   free src blocks once send returned

When ``sender.rendezvous`` is true (``torch_dist``) ``send`` blocks until the receiver is
inside ``receive`` with the bound handle, so the decode side's ``receive`` must be started
first (e.g. a non-blocking Ray call) and run concurrently. Every method raises
``KVTransferError`` on a layout or block-count mismatch, a failure or a timeout; after one,
the request must not be decoded from those blocks.

Senders and receivers are per worker, serialize their own transfers, and own only
transport resources (mappings, staging buffers, peer state): ``close()`` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from kvtransfer.handle import KVBlocksHandle

if TYPE_CHECKING:  # keep this module torch-free at run time
    import torch


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What one side of a transfer did. ``handle`` is what the receiver must be given."""

    handle: KVBlocksHandle
    num_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class KVSender(Protocol):
    """Prefill side: moves blocks out of this worker's cache."""

    transport: str
    rendezvous: bool  # True: send() waits for the receiver's receive() (start that first)

    def bind(self, handle: KVBlocksHandle, src_block_ids: Sequence[int]) -> KVBlocksHandle:
        """Fill in the source side of a handle made by the decode worker."""
        ...

    def send(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        """Move ``handle.src_block_ids`` of ``cache``; the source blocks are free to reuse on return."""
        ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """Decode side: lands blocks in the reserved blocks of this worker's cache."""

    transport: str

    def locator(self, cache: torch.Tensor) -> object:
        """What the decode worker puts in new handles so the sender finds this cache."""
        ...

    def receive(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        """Return once ``handle.dst_block_ids`` of ``cache`` hold the request's KV."""
        ...

    def close(self) -> None: ...
