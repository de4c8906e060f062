"""Calls the C++ paged decode-attention kernel (``engine/csrc/paged_attention.cpp``).

The kernel reads each decode request's K/V blocks in place through its block table, exactly once,
instead of gathering them into a padded copy that SDPA then reads again (decode attention is
memory-bound, so that halves its traffic). float32 on CPU only; ``engine.attention`` falls back to
its torch path for anything else, when the kernels cannot be built (``engine.cpu_kernels``), or
when ``PDSERVE_ATTENTION=torch``.
"""

from __future__ import annotations

import os

import torch

from engine import cpu_kernels
from engine.cpu_kernels import available, unavailable_reason  # noqa: F401  (this kernel's availability)

ENV_VAR = "PDSERVE_ATTENTION"   # "torch": always use the torch path (comparison, tests)
SOURCE = cpu_kernels.CSRC / "paged_attention.cpp"


def simd_width() -> int:
    """Floats per SIMD vector the kernel was built with (16 AVX-512, 8 AVX2, 0 none); 0 if unavailable."""
    module = cpu_kernels.module()
    return int(module.simd_width) if module is not None else 0


def enabled() -> bool:
    """The kernel is available and not switched off with ``PDSERVE_ATTENTION=torch``."""
    return os.environ.get(ENV_VAR, "").lower() != "torch" and available()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """Decode attention of one query token per request over its paged KV.

    q [n, heads, head_dim] float32 (any strides with unit-stride head_dim); k_cache/v_cache
    [num_blocks, block_size, kv_heads, head_dim] contiguous float32; block_tables [n, max_blocks]
    int64 (entries past a request's ``ceil(context_len / block_size)`` blocks are never read);
    context_lens [n] int64, >= 1. Query head ``k * groups + g`` attends to KV head ``k``.
    Returns out [n, heads, head_dim]. ``portable=True`` forces the plain-loop path that
    machines without AVX2 (or unusual head dims) take, for tests.
    """
    module = cpu_kernels.module()
    if module is None:
        raise RuntimeError(f"paged attention kernel unavailable: {unavailable_reason()}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    module.paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, float(scale), portable)
    return out
