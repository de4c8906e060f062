"""CUDA IPC transport: two processes on one GPU; the prefill worker copies into the decode
worker's cache directly (device-to-device, no staging).

Life cycle:

1. decode: handles carry ``receiver.locator(cache)``, a torch-free ``CudaIpcLocator`` made
   from ``reduce_tensor(cache)`` (``storage._share_cuda_()``: the cudaMalloc block's IPC
   handle, offsets, a producer ref-counter slot and an event). Each export takes a fresh
   ref-counter slot, as torch.multiprocessing does when it sends a tensor again.
2. prefill: ``sender.send(cache, sender.bind(handle, src_ids))`` rebuilds the tensor with
   torch's ``rebuild_cuda_tensor``: the first time it opens the IPC handle
   (``cudaIpcOpenMemHandle``); later, torch's cache returns the same mapping and releases
   the extra ref-counter slot. The sender keeps the opened tensor alive per IPC handle so
   the mapping is opened once. It copies the blocks and synchronizes its stream, so when
   send returns the bytes are in the decode worker's blocks.
3. decode: ``receiver.receive(cache, handle)`` only checks.
4. shutdown: prefill ``sender.close()`` drops the mappings before (or while) the decode worker
   frees its cache; torch's producer-side ref counters keep the memory valid until every
   consumer released it.

Both processes must see the same physical GPU (mind Ray's CUDA_VISIBLE_DEVICES remapping;
the locator's ``device`` is the exporter's index; workers name their GPU by UUID so the router
pairs only workers that share one). Tested on a GPU only (tests/test_cuda.py, test_kvtransfer.py).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from engine.dtypes import dtype_name, torch_dtype
from engine.errors import KVTransferError
from kvtransfer.blocks import check_side, copy_blocks
from kvtransfer.connector import TransferResult
from kvtransfer.handle import CudaIpcLocator, KVBlocksHandle


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise KVTransferError("cuda_ipc needs a CUDA device")


def export_cache(cache: torch.Tensor) -> CudaIpcLocator:
    """Describe ``cache`` (a CUDA tensor this process keeps alive) for another process."""
    _require_cuda()
    if not cache.is_cuda:
        raise KVTransferError(f"cuda_ipc exports CUDA tensors, got one on {cache.device}")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(cache)
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset,
     _, rc_handle, rc_offset, event_handle, event_sync) = args
    return CudaIpcLocator(
        device=int(device), handle=bytes(handle), storage_size_bytes=int(storage_size),
        storage_offset_bytes=int(storage_offset), ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=int(rc_offset), event_handle=bytes(event_handle) if event_handle else b"",
        event_sync_required=bool(event_sync), shape=tuple(size), stride=tuple(stride),
        offset=int(offset), dtype=dtype_name(dtype),
    )


def open_cache(loc: CudaIpcLocator) -> torch.Tensor:
    """The exporter's cache tensor, mapped into this process (torch caches the mapping)."""
    _require_cuda()
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dtype = torch_dtype(loc.dtype)
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(loc.shape), loc.stride, loc.offset, torch.storage.TypedStorage,
        dtype, loc.device, loc.handle, loc.storage_size_bytes, loc.storage_offset_bytes, False,
        loc.ref_counter_handle, loc.ref_counter_offset, loc.event_handle or None, loc.event_sync_required,
    )


def _locator(handle: KVBlocksHandle) -> CudaIpcLocator:
    loc = handle.locator
    if not isinstance(loc, CudaIpcLocator):
        raise KVTransferError(f"{handle.req_id}: cuda_ipc locator must be a CudaIpcLocator, got {loc!r}")
    if loc.dtype != handle.layout.dtype:
        raise KVTransferError(f"{handle.req_id}: IPC cache is {loc.dtype}, handle says {handle.layout.dtype}")
    return loc


class CudaIpcSender:
    transport = "cuda_ipc"
    rendezvous = False

    def __init__(self) -> None:
        self._opened: dict[tuple[bytes, int], torch.Tensor] = {}  # keeps each mapping open
        self._lock = threading.Lock()

    def bind(self, handle: KVBlocksHandle, src_block_ids: Sequence[int]) -> KVBlocksHandle:
        return handle.with_source(src_block_ids)

    def send(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        start = time.perf_counter()
        check_side(cache, handle, "src")
        loc = _locator(handle)
        with self._lock:
            try:
                dst = open_cache(loc)
            except RuntimeError as exc:  # cudaIpcOpenMemHandle errors: other GPU, dead exporter
                raise KVTransferError(f"{handle.req_id}: cannot open the decode cache: {exc}") from exc
            self._opened[(loc.handle, loc.storage_offset_bytes)] = dst
            check_side(dst, handle, "dst")
            copy_blocks(cache, handle.src_block_ids, dst, handle.dst_block_ids)
            torch.cuda.current_stream(cache.device).synchronize()
        return TransferResult(handle, handle.num_bytes, time.perf_counter() - start)

    def close(self) -> None:
        with self._lock:
            self._opened.clear()


class CudaIpcReceiver:
    transport = "cuda_ipc"

    def locator(self, cache: torch.Tensor) -> object:
        return export_cache(cache)

    def receive(self, cache: torch.Tensor, handle: KVBlocksHandle, *, timeout_s: float | None = None) -> TransferResult:
        """Nothing to move (the sender wrote and synchronized); check the handle is ours."""
        start = time.perf_counter()
        check_side(cache, handle, "dst")
        loc = _locator(handle)
        if loc.shape != tuple(cache.shape) or torch_dtype(handle.layout.dtype) != cache.dtype:
            raise KVTransferError(
                f"{handle.req_id}: KV was written to a {loc.shape} cache, this one is {tuple(cache.shape)}"
            )
        return TransferResult(handle, handle.num_bytes, time.perf_counter() - start)

    def close(self) -> None:
        pass
