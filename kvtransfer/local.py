"""In-process fake transport for tests of the workers and the engine: fails or stalls on demand.

Both "workers" live in one process. Life cycle: ``LocalReceiver.locator(cache)`` registers
the destination cache under a fresh key (the locator); ``LocalSender.send`` copies into it;
``receive`` only checks; ``LocalReceiver.close()`` forgets its caches.

Fault injection by design, not by luck:

- ``LocalSender(fail_next=n)``: the next ``n`` sends raise ``KVTransferError`` and copy nothing.
- ``LocalSender(gate=threading.Event())``: each send waits for the event (a stalled peer);
  with ``timeout_s`` it raises ``KVTransferError`` when the event is not set in time.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Sequence

import torch

from engine.errors import KVTransferError
from kvtransfer.blocks import check_side, copy_blocks
from kvtransfer.connector import TransferResult
from kvtransfer.handle import KVBlocksHandle

_CACHES: dict[str, torch.Tensor] = {}  # locator key -> destination cache, this process only


class LocalSender:
    transport = "local"
    rendezvous = False

    def __init__(self, *, fail_next: int = 0, gate: threading.Event | None = None) -> None:
        self.fail_next = fail_next
        self.gate = gate
        self.num_sent = 0

    def bind(self, handle: KVBlocksHandle, src_block_ids: Sequence[int]) -> KVBlocksHandle:
        return handle.with_source(src_block_ids)

    def send(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        start = time.perf_counter()
        check_side(cache, handle, "src")
        if self.gate is not None and not self.gate.wait(timeout_s):
            raise KVTransferError(f"{handle.req_id}: local transfer stalled past {timeout_s} s")
        if self.fail_next > 0:
            self.fail_next -= 1
            raise KVTransferError(f"{handle.req_id}: injected transfer failure")
        dst = _CACHES.get(handle.locator)
        if dst is None:
            raise KVTransferError(f"{handle.req_id}: no local cache registered as {handle.locator!r}")
        check_side(dst, handle, "dst")
        copy_blocks(cache, handle.src_block_ids, dst, handle.dst_block_ids)
        self.num_sent += 1
        return TransferResult(handle, handle.num_bytes, time.perf_counter() - start)

    def close(self) -> None:
        pass


class LocalReceiver:
    transport = "local"

    def __init__(self) -> None:
        self._keys: dict[int, str] = {}  # id(cache) -> key

    def locator(self, cache: torch.Tensor) -> object:
        key = self._keys.get(id(cache))
        if key is None:
            key = self._keys[id(cache)] = f"local-{uuid.uuid4().hex}"
            _CACHES[key] = cache
        return key

    def receive(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        start = time.perf_counter()
        check_side(cache, handle, "dst")
        if _CACHES.get(handle.locator) is not cache:
            raise KVTransferError(f"{handle.req_id}: KV was sent to {handle.locator!r}, not this cache")
        return TransferResult(handle, handle.num_bytes, time.perf_counter() - start)

    def close(self) -> None:
        for key in self._keys.values():
            _CACHES.pop(key, None)
        self._keys.clear()
