"""Paged prefill attention on CUDA: one Triton launch per layer for every prompt segment of a step.

Why: the torch path runs each prompt segment (a whole prompt, or a chunk after computed tokens)
as its own gather of K, gather of V, SDPA and copy of the output rows: about five launches per
segment per layer. A W64 prompt step on an H100 packs six to thirty segments, so its prompt
segments alone launched ~1,000-4,500 kernels a step, each costing host time on a GPU that waits
for them (session 21: 1.2 of the W64 run's 1.5 s went to its ten prompt steps). This kernel reads
every segment's K/V in place through its block table, as the decode kernel does
(engine/triton_attention.py), and computes all of them in one launch.

Layout: one program per (tile of TILE_M query rows of one segment, query head). A tile walks its
segment's context in TILE_N-key steps up to its own last query's position (keys past it are
causally invisible to the whole tile) with an online softmax; the segment's new keys are in the
cache already (attention writes them before it reads). Query ``i`` of a segment of ``q_len`` new
tokens over ``ctx_len`` keys sits at position ``ctx_len - q_len + i`` and sees keys ``<=`` it:
the same offset causal rule as engine.attention.offset_causal_mask. Scores and softmax are float32
whatever the cache dtype; float32 products run in IEEE precision (no TF32), so fp32 greedy output
stays equal to Hugging Face's.

Life cycle: at start-up the ModelRunner on CUDA asks ``usable``: the kernel runs once on a small
case of the model's own head shape against SDPA (which also compiles the variant its prompt steps
launch), and one that fails to compile, launch or compute is off for the process with a warning
(SDPA then serves: a GPU or Triton version it never ran on costs speed, never a request).
Per step the ModelRunner packs the step's segments into a ``PrefillPlan`` with ``plan`` (one
host-to-device copy of every table and bound); per layer engine.attention calls
``paged_prefill_attention`` once with it. ``PDSERVE_ATTENTION=torch`` turns it off with the other
paged kernels. Under ``TRITON_INTERPRET=1`` it also runs on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import triton_steps, triton_support
from engine.paged_kernel import ENV_VAR   # one switch for every paged kernel: "torch" turns them off

logger = logging.getLogger(__name__)
# A result off SDPA's by more than this share of its scale fails the start-up check: it looks for a
# kernel that miscompiles or misreads its inputs, not for rounding.
CHECK_TOLERANCE = 2e-2


@dataclass(frozen=True, slots=True)
class Tiles:
    """A program's share: ``rows`` query rows, walking the context ``keys`` keys a step, on ``warps``
    warps. Sized so that neither dtype's kernel spills registers on sm_90 (cuobjdump
    --dump-resource-usage of the cubin compiled for SmolLM2's shape: 162 registers for 16-bit at
    64 x 64 on 8 warps; float32's IEEE products need more, 128 at 32 x 32; 4 warps spilled both)."""
    rows: int
    keys: int
    warps: int


HALF_TILES = Tiles(rows=64, keys=64, warps=8)   # bfloat16 / float16 on tensor cores
FP32_TILES = Tiles(rows=32, keys=32, warps=8)   # float32 in IEEE precision (exact greedy)


def tiles_for(dtype: torch.dtype) -> Tiles:
    return FP32_TILES if dtype == torch.float32 else HALF_TILES


@dataclass(frozen=True, slots=True)
class SegmentBounds:
    """One prompt segment as the step lays it out (host side): its rows in the packed step, its
    context and the blocks that hold that context."""
    q_start: int
    q_len: int
    ctx_len: int
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The step's segments on the device, views of one int64 tensor (one copy): ``tables`` every
    segment's block ids back to back, ``segments`` [S, 4] (q_start, q_len, ctx_len, table start),
    ``tiles`` [P, 2] (segment, first row in it) for P = the step's query tiles of ``shape``."""
    tables: torch.Tensor
    segments: torch.Tensor
    tiles: torch.Tensor
    shape: Tiles


@triton_support.kernels
def _kernels(triton, tl):
    """The Triton kernel (compiled on first launch), or None where Triton does not import."""

    @triton.jit
    def paged_prefill(Q, K, V, OUT, TABLES, SEGMENTS, TILES, scale,
                      stride_qh, stride_qt, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh,
                      GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                      TILE_M: tl.constexpr, TILE_N: tl.constexpr, IEEE: tl.constexpr):
        """One (query tile of a segment, query head): the tile's rows of attention output."""
        seg = tl.load(TILES + tl.program_id(0) * 2)
        row0 = tl.load(TILES + tl.program_id(0) * 2 + 1)
        head = tl.program_id(1)
        q_start = tl.load(SEGMENTS + seg * 4)
        q_len = tl.load(SEGMENTS + seg * 4 + 1)
        ctx = tl.load(SEGMENTS + seg * 4 + 2)
        table = TABLES + tl.load(SEGMENTS + seg * 4 + 3)
        rows = row0 + tl.arange(0, TILE_M)
        live = rows < q_len
        q_pos = ctx - q_len + rows            # each query's position; rows past q_len see key 0 at least
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + head * stride_qh + (q_start + rows)[:, None] * stride_qt + d[None, :],
                    mask=live[:, None], other=0.0)
        kv_off = (head // GROUPS) * stride_kh
        m = tl.full([TILE_M], float("-inf"), tl.float32)
        denom = tl.zeros([TILE_M], tl.float32)
        acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
        end = tl.minimum(ctx, ctx - q_len + row0 + TILE_M)   # past the tile's last query: invisible to all
        for start in range(0, end, TILE_N):
            pos = start + tl.arange(0, TILE_N)
            valid = pos < end
            k, v = triton_steps.load_kv_tile(K, V, table, pos, valid, kv_off, d, stride_kb, stride_kt, BLOCK)
            seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            m, denom, acc = triton_steps.attend_tile(q, k, v, seen, scale, m, denom, acc, IEEE)
        out = acc / denom[:, None]
        tl.store(OUT + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=live[:, None])

    return paged_prefill


def enabled() -> bool:
    """Triton imports and ``PDSERVE_ATTENTION=torch`` does not switch the kernel off."""
    return os.environ.get(ENV_VAR, "").lower() != "torch" and _kernels() is not None


def supports(device: torch.device, head_dim: int, block_size: int) -> bool:
    """A CUDA cache whose shapes the kernel's tiles take (tl.dot wants power-of-two sizes >= 16)."""
    return device.type == "cuda" and head_dim >= 16 and triton_support.is_pow2(head_dim) and block_size >= 1


def plan(segments: list[SegmentBounds], device: torch.device, dtype: torch.dtype) -> PrefillPlan:
    """The step's segments packed for the kernel on a ``dtype`` cache: one host-to-device copy."""
    shape = tiles_for(dtype)
    tables: list[int] = []
    bounds: list[int] = []
    tiles: list[int] = []
    for i, seg in enumerate(segments):
        bounds += [seg.q_start, seg.q_len, seg.ctx_len, len(tables)]
        tables += seg.block_ids
        for row in range(0, seg.q_len, shape.rows):
            tiles += [i, row]
    packed = torch.tensor(tables + bounds + tiles, dtype=torch.long, device=device)
    n_tables, n_bounds = len(tables), len(bounds)
    return PrefillPlan(tables=packed[:n_tables], segments=packed[n_tables : n_tables + n_bounds].view(-1, 4),
                       tiles=packed[n_tables + n_bounds :].view(-1, 2), shape=shape)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefill: PrefillPlan,
                            scale: float, out: torch.Tensor) -> None:
    """q [heads, tokens, head_dim] (the step's packed queries); k_cache/v_cache [blocks, block_size,
    kv_heads, head_dim] (one layer, the segments' new keys written); out [tokens, heads, head_dim]:
    every segment's rows are written, the other rows (decode tokens) are left as they are."""
    num_heads, _, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged_prefill_attention needs unit-stride head rows")
    shape = prefill.shape
    if shape != tiles_for(q.dtype):
        raise ValueError(f"the plan was made for {shape}, not for {q.dtype} queries")
    kernel = _kernels()
    with triton_support.launch_device(q):
        kernel[(prefill.tiles.shape[0], num_heads)](
            q, k_cache, v_cache, out, prefill.tables, prefill.segments, prefill.tiles, float(scale),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            GROUPS=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK=block_size, TILE_M=shape.rows, TILE_N=shape.keys,
            IEEE=q.dtype == torch.float32, num_warps=shape.warps,
        )


@dataclass(frozen=True, slots=True)
class HeadShape:
    """The attention heads a model's layers have: the kernel's compiled variant follows them."""
    num_heads: int
    kv_heads: int
    head_dim: int
    block_size: int


def usable(device: torch.device, dtype: torch.dtype, shape: HeadShape) -> bool:
    """The kernel's start-up check on this GPU and dtype, on the model's own head shape (once per
    process): see the module's life cycle. Run on that shape, it also compiles the variant the
    model's prompt steps launch, so the first request does not wait for Triton's compiler."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())   # "cuda" and "cuda:0" are one GPU: one check
    return _checked(device, dtype, shape)


@functools.cache
def _checked(device: torch.device, dtype: torch.dtype, shape: HeadShape) -> bool:
    try:
        reason = _check(device, dtype, shape)
    except Exception as exc:   # noqa: BLE001 - any failure of the kernel is the reason to keep SDPA
        reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        logger.warning("Triton prefill attention off on %s for %s (%s): SDPA runs prompt segments instead",
                       device, dtype, reason)
    return reason is None


def _check(device: torch.device, dtype: torch.dtype, shape: HeadShape) -> str | None:
    """Two segments (a whole prompt, a chunk after computed tokens) over scattered blocks, against
    SDPA on each segment's gathered context."""
    gen = torch.Generator().manual_seed(0)
    block, kv_heads, head_dim = shape.block_size, shape.kv_heads, shape.head_dim
    k_cache = torch.randn(8, block, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(8, block, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    first, later_start = block + 2, 2 * block + 1            # a prompt past one block; a chunk after two
    segments = [SegmentBounds(0, first, first, [5, 2]), SegmentBounds(first, 3, later_start + 3, [7, 0, 3])]
    tokens = first + 3
    q = torch.randn(tokens, shape.num_heads, head_dim, generator=gen).to(dtype).to(device).transpose(0, 1)
    out = torch.zeros(tokens, shape.num_heads, head_dim, dtype=dtype, device=device)
    paged_prefill_attention(q, k_cache, v_cache, plan(segments, device, dtype), head_dim ** -0.5, out)
    for seg in segments:
        ids = torch.tensor(seg.block_ids, device=device)
        k = k_cache[ids].reshape(-1, kv_heads, head_dim)[: seg.ctx_len].float().transpose(0, 1)
        v = v_cache[ids].reshape(-1, kv_heads, head_dim)[: seg.ctx_len].float().transpose(0, 1)
        start = seg.ctx_len - seg.q_len
        visible = torch.ones(seg.q_len, seg.ctx_len, dtype=torch.bool, device=device).tril(start)
        qs = q[:, seg.q_start : seg.q_start + seg.q_len].float()
        want = F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, enable_gqa=True).transpose(0, 1)
        got = out[seg.q_start : seg.q_start + seg.q_len].float()
        if not bool(((got - want).abs() <= CHECK_TOLERANCE * (want.abs().max() + 1)).all()):
            return f"segment of {seg.q_len} after {start}: off SDPA by {(got - want).abs().max().item():.3g}"
    return None
