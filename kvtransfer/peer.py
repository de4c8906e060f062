"""A minimal worker-side body for moving KV between processes: one cache, its sender and receiver.

Used by the tests and the benchmark as a Ray actor (``ray.remote(KVPeer)``), and a compact
reference of what the real workers do with a connector. Life cycle:

1. ``KVPeer(layout, num_blocks, shm_path=...)`` allocates the cache (in /dev/shm when the
   path is given; this peer then owns the file) with one torch thread.
2. For torch_dist, every peer calls ``join_group(address, world_size, rank)`` (again, with a
   fresh address, after a member died).
3. Decode side: ``new_handle(...)``; prefill side: ``bind`` then ``send``; decode side:
   ``receive``. ``send``/``receive`` also return monotonic start/end stamps (one clock for
   all processes on a Linux host) so a driver can time a transfer end to end.
4. ``close()`` drops the transports, leaves the group and unlinks an owned cache file.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from engine.types import KVLayout
from kvtransfer.cache_alloc import allocate_kv_cache, layout_of, release_kv_cache
from kvtransfer.connector import KVReceiver, KVSender, TransferResult
from kvtransfer.handle import KVBlocksHandle
from kvtransfer.select import make_receiver, make_sender
from kvtransfer.torch_dist import destroy_kv_group, init_kv_group


class KVPeer:
    def __init__(self, layout: KVLayout, num_blocks: int, *, shm_path: str | None = None, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)  # 2 shared cores: oversubscription costs 3-5x
        self.shm_path = shm_path
        self.cache = allocate_kv_cache(layout, num_blocks, shm_path=shm_path)
        self._senders: dict[str, KVSender] = {}
        self._receivers: dict[str, KVReceiver] = {}

    # ---- set-up and data ----------------------------------------------------------------
    def join_group(self, init_method: str, world_size: int, rank: int, timeout_s: float = 30.0) -> None:
        """Join a group (leaving the one this peer is in, if any)."""
        init_kv_group(init_method, world_size, rank, backend="gloo", timeout_s=timeout_s)

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """``cache[:, :, block_ids] = data`` (data shaped ``[L, 2, len(ids), ...]``)."""
        self.cache[:, :, list(block_ids)] = data

    def snapshot(self) -> torch.Tensor:
        return self.cache.clone()

    # ---- one hand-off ---------------------------------------------------------------------
    def new_handle(self, req_id: str, dst_block_ids: Sequence[int], num_tokens: int, transport: str) -> KVBlocksHandle:
        locator = self._receiver(transport).locator(self.cache)
        return KVBlocksHandle(req_id, (), tuple(dst_block_ids), num_tokens, layout_of(self.cache), transport, locator)

    def bind(self, handle: KVBlocksHandle, src_block_ids: Sequence[int]) -> KVBlocksHandle:
        return self._sender(handle.transport).bind(handle, src_block_ids)

    def send(self, handle: KVBlocksHandle, timeout_s: float | None = None) -> tuple[TransferResult, float, float]:
        start = time.perf_counter()
        result = self._sender(handle.transport).send(self.cache, handle, timeout_s=timeout_s)
        return result, start, time.perf_counter()

    def receive(self, handle: KVBlocksHandle, timeout_s: float | None = None) -> tuple[TransferResult, float, float]:
        start = time.perf_counter()
        result = self._receiver(handle.transport).receive(self.cache, handle, timeout_s=timeout_s)
        return result, start, time.perf_counter()

    def memcpy_seconds(self, num_bytes: int, repeats: int) -> list[float]:
        """``dst.copy_(src)`` of ``num_bytes`` in this process: the yardstick for transports."""
        src = torch.ones(num_bytes // 4)
        dst = torch.zeros_like(src)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return times

    def close(self) -> None:
        for name in list(self._senders) + list(self._receivers):
            self._drop(name)
        destroy_kv_group()
        if self.shm_path is not None:
            release_kv_cache(self.shm_path)

    # ---- helpers ------------------------------------------------------------------------
    def _sender(self, transport: str) -> KVSender:
        if transport not in self._senders:
            self._senders[transport] = make_sender(transport)
        return self._senders[transport]

    def _receiver(self, transport: str) -> KVReceiver:
        if transport not in self._receivers:
            kwargs = {"shm_path": self.shm_path} if transport == "shm" else {}
            self._receivers[transport] = make_receiver(transport, **kwargs)
        return self._receivers[transport]

    def _drop(self, transport: str) -> None:
        for table in (self._senders, self._receivers):
            side = table.pop(transport, None)
            if side is not None:
                side.close()
