"""Joining the workers' torch.distributed group (gloo on CPU, NCCL on GPU) from a worker actor.

Life cycle: the launcher asks rank 0 for the rendezvous ``address`` (on rank 0's node, where its
store listens), every KV-moving worker calls ``join`` at once (it blocks until all have joined),
transfers run; after a member is replaced, every member calls ``join`` again with a fresh address
(the old group is left once its transfers in flight end); ``leave`` at shutdown.
"""

from __future__ import annotations

import asyncio

from kvtransfer.torch_dist import default_backend, destroy_kv_group, init_kv_group


# The rendezvous's bound (and the group's own op timeout; each transfer passes its own): a member
# that never comes (it died during the forming) holds the others this long before the router's
# next try. A transfer's 30 s (prefill_worker TRANSFER_TIMEOUT_S) fits in it.
JOIN_TIMEOUT_S = 30.0


async def join(address: str, world_size: int, rank: int, device: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    await asyncio.to_thread(init_kv_group, address, world_size, rank, backend=default_backend(device), timeout_s=timeout_s)


def leave() -> None:
    destroy_kv_group()
