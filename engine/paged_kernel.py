"""Calls the C++ paged attention kernels: decode (``engine/csrc/paged_attention.cpp``), causal
prefill (``engine/csrc/prefill_attention.cpp``), and the rotary embedding fused with the KV-cache
write that precedes them in the lean forward (``engine/csrc/rope_kv.cpp``).

The decode kernel reads each decode request's K/V blocks in place through its block table, exactly
once, instead of gathering them into a padded copy that SDPA then reads again (decode attention is
memory-bound, so that halves its traffic). The prefill kernel runs one prompt segment (a whole
prompt or a later chunk of it) against its request's paged K/V: no gathered copy, no mask tensor,
and register-tiled score and value products where SDPA's CPU flash kernel makes MKL calls too
small to run at the GEMM rate. float32 on CPU only; ``engine.attention`` falls back to its torch
path for anything else, when the kernels cannot be built (``engine.cpu_kernels``), or when
``PDSERVE_ATTENTION=torch``.
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


# The engine's prefill runs on the kernel where it was measured faster than SDPA: AVX-512 builds
# (1.16-1.85x at 64-2,048 tokens on a Zen 4, 2 threads: benchmarks/results/prefill_attention.txt). An
# AVX2 build computes the same values and is tested, but against SDPA with torch held to AVX2 it was
# 0.59-0.91x past 128 tokens (same file), so the engine keeps SDPA there.
PREFILL_SIMD_WIDTHS = frozenset({16})


def prefill_supports(head_dim: int) -> bool:
    """The prefill kernel is enabled and takes this head_dim (a multiple of the SIMD width)."""
    module = cpu_kernels.module()
    return enabled() and module is not None and bool(module.prefill_attention_supports(head_dim))


def prefill_preferred(head_dim: int) -> bool:
    """The engine should run prefill attention of this head_dim on the kernel (see PREFILL_SIMD_WIDTHS)."""
    return prefill_supports(head_dim) and simd_width() in PREFILL_SIMD_WIDTHS


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    ctx_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one prompt segment over its request's paged KV.

    q [heads, q_len, head_dim] float32 (any strides with unit-stride head_dim): the queries of the
    last ``q_len`` of the request's ``ctx_len`` tokens, whose K/V are already in the cache; query t
    attends to keys 0 .. ctx_len - q_len + t. block_ids [>= ceil(ctx_len / block_size)] int64;
    caches as for ``paged_decode_attention``. Returns out [q_len, heads, head_dim] (written in
    place when given, e.g. the segment's rows of the step's output).
    """
    module = cpu_kernels.module()
    if module is None:
        raise RuntimeError(f"paged attention kernel unavailable: {unavailable_reason()}")
    if out is None:
        out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
    module.paged_prefill_attention(out, q, k_cache, v_cache, block_ids, int(ctx_len), float(scale))
    return out


def rope_supports(head_dim: int) -> bool:
    """The fused rotary + KV write is enabled and takes this head_dim (a multiple of twice the SIMD width)."""
    module = cpu_kernels.module()
    return enabled() and module is not None and bool(module.rope_kv_supports(head_dim))


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``apply_rotary_pos_emb`` of q and k, bit for bit, with the rotated keys and the
    values written into the paged caches at ``slots`` (what ``engine.attention`` writes otherwise).

    q [T, heads, d], k and v [T, kv_heads, d] float32 (unit-stride d; views of the fused projection
    output); cos, sin [T, d]; caches [num_blocks, block_size, kv_heads, d]; slots [T] int64 flat
    slots. Returns the rotated queries [T, heads, d] (contiguous).
    """
    module = cpu_kernels.module()
    if module is None:
        raise RuntimeError(f"paged attention kernel unavailable: {unavailable_reason()}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    module.rope_write_kv(q_out, q, k, v, cos.contiguous(), sin.contiguous(), k_cache, v_cache, slots)
    return q_out
