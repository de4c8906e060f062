"""Keeps the engine's freed activation memory in its process instead of handing it back to the OS.

Why: glibc serves an allocation over its mmap threshold (128 KB, raised only as far as the
largest buffer freed so far) with fresh pages and gives freed heap tops back to the OS past its
trim threshold. A forward allocates every activation anew (a 512-token prefill's MLP output alone
is 6 MB), so each step page-faults its working set in again: 60-100 thousand minor faults per
512-token prefill of SmolLM2 on CPU, measured; with freed memory kept, ~none, and the prefill
840-951 -> 798-849 ms (separate processes; tests/test_freed_memory.py counts the faults). vLLM's CPU backend gets the same effect
by preloading tcmalloc; this needs no preload.

What it costs: the process's heap keeps its high-water mark of activations (tens of MB for a
2,048-token step of a small model; buffers over 32 MB, such as the KV cache, are still mapped
and unmapped on their own). Only glibc has ``mallopt``; elsewhere (musl, macOS) nothing changes.

Life cycle: ``keep()`` once per process, by the LLMEngine on CPU before its first step;
later calls do nothing. Off with ``PDSERVE_KEEP_FREED_MEMORY=off`` (comparison runs).
"""

from __future__ import annotations

import ctypes
import logging
import threading

from engine.switches import switched_off

logger = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20   # glibc's largest on 64-bit: bigger buffers are always mapped on their own
NEVER_TRIM = 2**31 - 1

_lock = threading.Lock()
_outcome: bool | None = None   # None: not tried in this process yet


def keep() -> bool:
    """Tell glibc to keep freed memory (tried once per process); True if it is in effect."""
    global _outcome
    if switched_off(ENV_VAR):
        return bool(_outcome)
    with _lock:
        if _outcome is None:
            _outcome = _mallopt()
            if not _outcome:
                logger.info("freed memory stays with the allocator's defaults (no glibc mallopt here)")
        return _outcome


def _mallopt() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
    except (OSError, AttributeError):   # not glibc
        return False
