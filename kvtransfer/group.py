"""Joining the workers' torch.distributed group (gloo on CPU, NCCL on GPU) from a worker actor.

Life cycle: the launcher asks rank 0 for the rendezvous ``address`` (on rank 0's node, where its
store listens from then on), every KV-moving worker calls ``join`` at once (it blocks until all have joined),
transfers run; after a member is replaced, every member calls ``join`` again with a fresh address
(the old group is left once its transfers in flight end); ``leave`` at shutdown.
"""

from __future__ import annotations

import asyncio

from kvtransfer import group_store
from kvtransfer.torch_dist import default_backend, destroy_kv_group, init_kv_group


# The rendezvous's bound (and the group's own op timeout; each transfer passes its own): a member
# that never comes (it died during the forming) holds the others this long before the router's
# next try. A transfer's 30 s (prefill_worker TRANSFER_TIMEOUT_S) fits in it.
JOIN_TIMEOUT_S = 30.0


def host_rendezvous(hostname: str) -> str:
    """Rank 0's: a rendezvous address on ``hostname`` (this worker's node), its store bound now."""
    return group_store.host(hostname, JOIN_TIMEOUT_S)


async def join(address: str, world_size: int, rank: int, device: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Join the group at ``address`` (rank 0's ``host_rendezvous``: hosted before the joins went out)."""
    await asyncio.to_thread(init_kv_group, address, world_size, rank, backend=default_backend(device),
                            timeout_s=timeout_s, hosted=True)


def leave() -> None:
    destroy_kv_group()
