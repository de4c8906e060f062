"""Paged decode attention on CUDA: a Triton kernel that reads each request's K/V blocks in place.

Why: the torch path gathers every decode request's blocks into a padded copy (padded to the
batch's longest context, or to a CUDA graph's captured width) that SDPA then reads again with a
mask: three passes over KV that is mostly padding at batch 64, where attention is the decode
step's largest cost on a GPU. This kernel is the GPU twin of the C++ CPU kernel
(engine/paged_kernel.py), split as flash decoding splits it: one program per (request, KV head,
partition of PART_TOKENS context tokens) walks its part of the request's block table in tiles with
an online softmax, for all the query heads that share the KV head (grouped-query attention: query
head ``k * groups + g`` reads KV head ``k``); a second kernel merges a request's partitions. At
batch 64 one program per request and head would leave the GPU's SMs waiting on a few programs'
serial walks. The partition count follows the block table's width, not the contexts, so nothing
has a data-dependent shape and no host sync happens: decode graphs capture both kernels as is. Scores and the softmax are
float32 whatever the cache dtype; float32 products run in IEEE precision (no TF32), so fp32 output
stays equal to Hugging Face's.

Used by engine.attention for decode tokens on CUDA when Triton imports; ``PDSERVE_ATTENTION=torch``
sends them down the torch path instead (comparisons, tests).
"""

from __future__ import annotations

import os

import torch

from engine import triton_steps, triton_support
from engine.paged_kernel import ENV_VAR   # one switch for both paged kernels: "torch" turns them off
TILE_BLOCKS = 4                 # KV blocks per tile of the context walk
PART_TOKENS = 128               # context tokens per program: long contexts are split over programs (flash decoding)


@triton_support.kernels
def _kernels(triton, tl):
    """The Triton kernels (compiled on first call), or None where Triton does not import."""

    # The table's width and the partitions it makes change from one eager step to the next: runtime
    # values, not specialized on, so they cost no new compile (a decode graph fixes them anyway).
    @triton.jit(do_not_specialize=["stride_tr", "NUM_PARTS"])
    def paged_decode_partial(Q, K, V, TABLES, CTX, M_OUT, L_OUT, ACC_OUT, scale,
                stride_qr, stride_qh, stride_kb, stride_kt, stride_kh, stride_tr, NUM_PARTS,
                GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                TILE: tl.constexpr, PART: tl.constexpr, IEEE: tl.constexpr):
        """One (request, KV head, partition of PART tokens): the partition's softmax max, sum and
        unnormalized output for each query head of the group; an empty partition leaves (-inf, 0, 0)."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        ctx = tl.load(CTX + row)
        g = tl.arange(0, GROUPS_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE)
        heads = kv_head * GROUPS + g
        q = tl.load(Q + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUPS)[:, None], other=0.0)
        m = tl.full([GROUPS_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUPS_PAD], tl.float32)
        acc = tl.zeros([GROUPS_PAD, HEAD_DIM], tl.float32)
        end = tl.minimum(ctx, (part + 1) * PART)
        for start in range(part * PART, end, TILE):
            pos = start + t
            valid = pos < end
            k, v = triton_steps.load_kv_tile(K, V, TABLES + row * stride_tr, pos, valid, kv_head * stride_kh, d,
                                stride_kb, stride_kt, BLOCK)
            m, denom, acc = triton_steps.attend_tile(q, k, v, valid[None, :], scale, m, denom, acc, IEEE)
        base = (row * GROUPS * tl.num_programs(1) + heads) * NUM_PARTS + part
        tl.store(M_OUT + base, m, mask=g < GROUPS)
        tl.store(L_OUT + base, denom, mask=g < GROUPS)
        tl.store(ACC_OUT + base[:, None] * HEAD_DIM + d[None, :], acc, mask=(g < GROUPS)[:, None])

    @triton.jit(do_not_specialize=["NUM_PARTS"])
    def paged_decode_combine(M_IN, L_IN, ACC_IN, OUT, stride_or, stride_oh, NUM_PARTS,
                HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PARTS_PAD: tl.constexpr):
        """One (request, query head): the partitions merged by their softmax maxima."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        parts = tl.arange(0, PARTS_PAD)
        d = tl.arange(0, HEAD_DIM)
        base = (row * HEADS + head) * NUM_PARTS + parts
        m = tl.load(M_IN + base, mask=parts < NUM_PARTS, other=float("-inf"))
        denom = tl.load(L_IN + base, mask=parts < NUM_PARTS, other=0.0)
        acc = tl.load(ACC_IN + base[:, None] * HEAD_DIM + d[None, :], mask=(parts < NUM_PARTS)[:, None], other=0.0)
        weight = tl.exp(m - tl.max(m, 0))   # the first partition always holds a token: the max is finite
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(denom * weight, 0)
        tl.store(OUT + row * stride_or + head * stride_oh + d, out.to(OUT.dtype.element_ty))

    return paged_decode_partial, paged_decode_combine


def enabled() -> bool:
    """Triton imports and ``PDSERVE_ATTENTION=torch`` does not switch the kernel off."""
    return os.environ.get(ENV_VAR, "").lower() != "torch" and _kernels() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the kernel's tiles take: power-of-two head size and tile, contiguous head rows."""
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    return (q.is_cuda and k_cache.stride(-1) == 1 and head_dim >= 16 and triton_support.is_pow2(head_dim)
            and triton_support.is_pow2(block_size * TILE_BLOCKS) and block_size * TILE_BLOCKS >= 16
            and PART_TOKENS % (block_size * TILE_BLOCKS) == 0)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [n, heads, head_dim]; k_cache/v_cache [blocks, block_size, kv_heads, head_dim] (one layer);
    block_tables [n, width]; context_lens [n], >= 1. Returns [n, heads, head_dim] in q's dtype."""
    n, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    groups = num_heads // kv_heads
    num_parts = -(-block_tables.shape[1] * block_size // PART_TOKENS)   # fixed by the table's width: capturable
    q = q.contiguous()
    out = torch.empty_like(q)
    m = q.new_empty(n, num_heads, num_parts, dtype=torch.float32)
    denom = torch.empty_like(m)
    acc = q.new_empty(n, num_heads, num_parts, head_dim, dtype=torch.float32)
    partial, combine = _kernels()
    with triton_support.launch_device(q):
        partial[(n, kv_heads, num_parts)](
            q, k_cache, v_cache, block_tables, context_lens, m, denom, acc, float(scale),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            num_parts, GROUPS=groups, GROUPS_PAD=max(16, triton_support.next_pow2(groups)), HEAD_DIM=head_dim,
            BLOCK=block_size, TILE=block_size * TILE_BLOCKS, PART=PART_TOKENS, IEEE=q.dtype == torch.float32,
        )
        combine[(n, num_heads)](m, denom, acc, out, out.stride(0), out.stride(1), num_parts, HEADS=num_heads,
                                HEAD_DIM=head_dim, PARTS_PAD=triton_support.next_pow2(num_parts))
    return out
