"""Allocating a worker's paged KV cache, optionally in /dev/shm so a peer can map it.

Life cycle of a shared cache file:

1. The decode worker (the owner) calls ``allocate_kv_cache(layout, n, shm_path=...)`` once at
   start. The file is created exclusively, its tmpfs pages are reserved with
   ``posix_fallocate`` (a full /dev/shm fails here with ``KVTransferError`` instead of a
   SIGBUS at first write) and touched once by zero-filling (first-touch page faults
   otherwise land inside the first transfers and halve their speed, measured).
2. A prefill worker on the same node calls ``attach_kv_cache`` (through ``ShmSender``, cached
   per path) and writes straight into the reserved blocks.
3. At shutdown the owner calls ``release_kv_cache(path)``: it unlinks the file. Mappings that
   are still open (its own tensor, attached senders) stay valid until they are dropped; the
   memory returns to the system when the last one goes. Attachers never unlink.
"""

from __future__ import annotations

import os

import torch

from engine import kv_cache
from engine.dtypes import dtype_name, torch_dtype
from engine.errors import KVTransferError
from engine.types import KVLayout

def layout_of(cache: torch.Tensor) -> KVLayout:
    """The ``KVLayout`` a cache tensor actually has (checked against handles on both sides)."""
    if cache.dim() != 6 or cache.shape[1] != 2:
        raise KVTransferError(
            f"KV cache must be [layers, 2, blocks, block_size, heads, head_dim], got {tuple(cache.shape)}"
        )
    num_layers, _, _, block_size, num_kv_heads, head_dim = cache.shape
    dtype = dtype_name(cache.dtype)
    return KVLayout(num_layers, num_kv_heads, head_dim, block_size, dtype)


def _numel(layout: KVLayout, num_blocks: int) -> int:
    return num_blocks * layout.block_size * layout.bytes_per_token // layout.dtype_bytes


def allocate_kv_cache(
    layout: KVLayout, num_blocks: int, *, shm_path: str | None = None, device: str = "cpu"
) -> torch.Tensor:
    """A zeroed cache of ``layout.cache_shape(num_blocks)``; file-backed when ``shm_path`` is set
    (else the engine's own pool: ``engine.kv_cache.allocate``)."""
    if shm_path is None:
        return kv_cache.allocate(layout, num_blocks, device)
    if torch.device(device).type != "cpu":
        raise KVTransferError(f"a /dev/shm cache lives in host memory, not on {device}")
    _create_file(shm_path, _numel(layout, num_blocks) * layout.dtype_bytes)
    cache = _map(layout, num_blocks, shm_path)
    cache.zero_()  # touch every page once, now rather than during the first transfers
    return cache


def attach_kv_cache(layout: KVLayout, num_blocks: int, shm_path: str) -> torch.Tensor:
    """Map a cache that another process allocated with ``shm_path``; the sizes must agree."""
    want = _numel(layout, num_blocks) * layout.dtype_bytes
    try:
        have = os.stat(shm_path).st_size
    except FileNotFoundError as exc:
        raise KVTransferError(f"no shared KV cache at {shm_path}") from exc
    if have != want:  # from_file(shared=True) would silently grow a short file
        raise KVTransferError(f"{shm_path} holds {have} bytes, layout x {num_blocks} blocks needs {want}")
    return _map(layout, num_blocks, shm_path)


def release_kv_cache(shm_path: str) -> None:
    """Unlink the cache file (owner only, at shutdown). Idempotent."""
    try:
        os.unlink(shm_path)
    except FileNotFoundError:
        pass


def _create_file(path: str, num_bytes: int) -> None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise KVTransferError(f"{path} already exists (another worker's cache, or a stale one)") from exc
    try:
        os.posix_fallocate(fd, 0, num_bytes)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise KVTransferError(f"cannot reserve {num_bytes} bytes at {path}: {exc}") from exc
    os.close(fd)


def _map(layout: KVLayout, num_blocks: int, path: str) -> torch.Tensor:
    flat = torch.from_file(path, shared=True, size=_numel(layout, num_blocks), dtype=torch_dtype(layout.dtype))
    return flat.view(layout.cache_shape(num_blocks))
