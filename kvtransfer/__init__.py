"""Moving a request's KV blocks from a prefill worker's cache into a decode worker's.

- ``handle``: ``KVBlocksHandle`` (torch-free: it crosses the router) and ``check_layout``.
- ``connector``: the ``KVSender`` / ``KVReceiver`` protocols, ``TransferResult``, the call
  sequence of one hand-off.
- ``cache_alloc``: the cache tensor, optionally a /dev/shm file another process can map.
- ``blocks``: byte-exact block copies, gather/scatter to staging, the checks both sides run.
- backends: ``shm`` (same node, CPU), ``torch_dist`` (gloo / NCCL p2p), ``object_store``
  (Ray fallback), ``cuda_ipc`` (same GPU), ``local`` (in-process fake with fault injection).
- ``select``: ``choose_transport`` and the registry (``make_sender`` / ``make_receiver``).

Importing this package, ``handle``, ``connector`` or ``select`` does not import torch.
"""

from __future__ import annotations

from kvtransfer.connector import KVReceiver, KVSender, TransferResult
from kvtransfer.handle import (
    CudaIpcLocator,
    DistPeers,
    KVBlocksHandle,
    KVLayoutMismatchError,
    blocks_needed,
    check_layout,
)
from kvtransfer.select import TRANSPORTS, choose_transport, make_receiver, make_sender

__all__ = [
    "CudaIpcLocator", "DistPeers", "KVBlocksHandle", "KVLayoutMismatchError", "KVReceiver",
    "KVSender", "TRANSPORTS", "TransferResult", "blocks_needed", "check_layout",
    "choose_transport", "make_receiver", "make_sender",
]
