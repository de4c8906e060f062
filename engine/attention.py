"""Paged attention over packed (ragged) batches, plugged into transformers' attention registry.

The transformers model runs unchanged (its projections, RoPE, MLPs, norms); only the attention
call is ours. Per layer it (1) writes the step's new keys/values into the paged cache at each
token's slot (unless the lean forward's fused rotary wrote them: ``pdserve_kv_written``), then (2) attends each request's queries to that request's own KV read through its
block table — never across requests:
- prefill chunks: per request, causal over its own blocks (a chunk after already-computed tokens
  attends to them too), by the step's ``PrefillPath``: on CUDA every segment in one Triton launch
  (engine/triton_prefill.py); float32 on an AVX-512 CPU per segment on the C++ prefill kernel
  (engine/paged_kernel.py); both read the blocks in place. Otherwise one SDPA per segment on its
  gathered K/V (with a mask offset by the computed tokens for a later chunk);
- decode tokens: float32 on CPU go to the C++ paged kernel (engine/paged_kernel.py), on CUDA to
  the Triton one (engine/triton_attention.py); both read each request's blocks in place, once,
  with an online softmax. Otherwise (no kernel for the device or dtype, or PDSERVE_ATTENTION=torch)
  they are gathered in groups of similar context length into one padded SDPA per group (the
  padding is only in the gathered keys, masked out; the packed GEMMs carry none).
Grouped-query attention never repeats KV heads in memory: prefill passes SDPA ``enable_gqa``, the
torch decode path folds the query heads sharing a KV head into the query-length axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine import paged_kernel, triton_attention, triton_prefill

ATTN_IMPLEMENTATION = "pdserve_paged"


class PrefillPath(Enum):
    """How a step's prompt segments attend (the ModelRunner's choice for the device and dtype)."""
    SDPA = "sdpa"              # per segment: SDPA on its gathered K/V (with its mask for a later chunk)
    CPU_KERNEL = "cpu_kernel"  # per segment: the C++ kernel reads its blocks in place (float32, CPU)
    TRITON = "triton"          # all segments in one launch per layer (CUDA): AttentionMetadata.prefill_plan


@dataclass(slots=True)
class PrefillSegment:
    q_start: int
    q_len: int
    ctx_len: int
    block_ids: torch.Tensor     # [num_blocks] covering ctx_len tokens
    # [q_len, ctx_len] additive float (0 / -inf) for SDPA; None: the chunk starts the prompt (causal),
    # or a kernel runs it (AttentionMetadata.prefill_path: kernels need no mask)
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    q_index: torch.Tensor       # [G] packed positions of the group's decode tokens
    block_tables: torch.Tensor  # [G, max_blocks] (padded with block 0; masked out)
    # [G, 1, 1, max_blocks * block_size] bool, for the torch path; None: built there from context_lens
    # when needed (the CPU paged kernel reads context_lens and never needs it)
    key_mask: torch.Tensor | None
    context_lens: torch.Tensor | None = None  # [G] int64 keys per request (the paged kernel's bound)
    # The group's queries are the step's tokens 0..G-1 in order (a decode-only step in one group):
    # attention reads q and returns its rows as they are, no gather of q and no scatter of the output.
    every_token: bool = False


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: torch.Tensor      # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each packed token
    prefills: list[PrefillSegment]
    decode_groups: list[DecodeGroup]
    # How the prefill segments run (the ModelRunner's choice; a kernel's segments carry no mask).
    prefill_path: PrefillPath = PrefillPath.SDPA
    prefill_plan: triton_prefill.PrefillPlan | None = None   # the segments packed for PrefillPath.TRITON

    @property
    def decode_only_group(self) -> DecodeGroup | None:
        """The step's one group when it is every token in step order (a decode-only step): attention
        then reads q as it is and returns its rows as they are."""
        if not self.prefills and len(self.decode_groups) == 1 and self.decode_groups[0].every_token:
            return self.decode_groups[0]
        return None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata = kwargs["pdserve_attn"]
    k_cache, v_cache = meta.kv_cache[module.layer_idx]
    if not kwargs.get("pdserve_kv_written"):   # the lean forward's fused rotary wrote them (paged_kernel.rope_write_kv)
        _write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), meta.slot_mapping)
    q = query[0]                                   # [heads, tokens, head_dim]
    num_heads, num_tokens, head_dim = q.shape
    groups = num_heads // k_cache.shape[-2]
    if (only := meta.decode_only_group) is not None:
        return _decode(q, k_cache, v_cache, only, groups, scaling).unsqueeze(0), None
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if meta.prefill_path is PrefillPath.TRITON and meta.prefills:
        scale = scaling if scaling is not None else head_dim ** -0.5
        triton_prefill.paged_prefill_attention(q, k_cache, v_cache, meta.prefill_plan, scale, out)
    else:
        for seg in meta.prefills:
            _prefill(q, k_cache, v_cache, seg, scaling, out[seg.q_start : seg.q_start + seg.q_len],
                     meta.prefill_path is PrefillPath.CPU_KERNEL)
    for grp in meta.decode_groups:
        out[grp.q_index] = _decode(q, k_cache, v_cache, grp, groups, scaling)
    return out.unsqueeze(0), None


def offset_causal_mask(start: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """SDPA's additive [n, start + n] mask for a chunk after ``start`` computed tokens: query i sees
    keys <= start + i. Additive float, not bool: SDPA's CPU path with a bool mask runs ~1.2x slower."""
    q_pos = torch.arange(start, start + n, device=device)
    visible = torch.arange(start + n, device=device)[None, :] <= q_pos[:, None]
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def _write_kv(k_cache, v_cache, k_new, v_new, slots) -> None:
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k_new)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v_new)


def _prefill(q, k_cache, v_cache, seg: PrefillSegment, scaling, out: torch.Tensor, kernel: bool) -> None:
    """The segment's attention into ``out`` [q_len, heads, head_dim] (its rows of the step's output)."""
    qs = q[:, seg.q_start : seg.q_start + seg.q_len]              # [heads, q_len, d]
    kv_heads, head_dim = k_cache.shape[-2:]
    if kernel:
        # Reads the segment's K/V in place through its blocks: no gathered copy, no mask tensor.
        scale = scaling if scaling is not None else head_dim ** -0.5
        paged_kernel.paged_prefill_attention(qs, k_cache, v_cache, seg.block_ids, seg.ctx_len, scale, out=out)
        return
    k = _gather(k_cache, seg.block_ids).view(-1, kv_heads, head_dim)[: seg.ctx_len].transpose(0, 1)
    v = _gather(v_cache, seg.block_ids).view(-1, kv_heads, head_dim)[: seg.ctx_len].transpose(0, 1)
    # enable_gqa: heads k*g..k*g+g-1 share KV head k, never repeated in memory. A chunk that starts
    # the prompt is plain causal: is_causal takes SDPA's fused CPU kernel (~3x the masked path).
    o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=seg.mask, is_causal=seg.mask is None,
                                       scale=scaling, enable_gqa=True)
    out.copy_(o[0].transpose(0, 1))


def _decode(q, k_cache, v_cache, grp: DecodeGroup, groups: int, scaling) -> torch.Tensor:
    kernel = _paged_kernel_for(q, k_cache) if grp.context_lens is not None else None
    if kernel is not None:
        # Reads each request's blocks in place, once: no gathered copy, no padding.
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        # [G, heads, head_dim]; index_select is faster than q[:, idx]
        qd = q.transpose(0, 1) if grp.every_token else q.index_select(1, grp.q_index).transpose(0, 1)
        return kernel(qd, k_cache, v_cache, grp.block_tables, grp.context_lens, scale)
    kv_heads, head_dim = k_cache.shape[-2:]
    n = grp.q_index.numel()
    k = _gather(k_cache, grp.block_tables.view(-1)).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    v = _gather(v_cache, grp.block_tables.view(-1)).view(n, -1, kv_heads, head_dim).transpose(1, 2)
    qd = (q if grp.every_token else q[:, grp.q_index]).reshape(kv_heads, groups, n, head_dim).permute(2, 0, 1, 3)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=_key_mask(grp, k_cache.shape[1]), scale=scaling)
    return o.reshape(n, kv_heads * groups, head_dim)


def _key_mask(grp: DecodeGroup, block_size: int) -> torch.Tensor:
    """[G, 1, 1, keys]: True where a key is within its request's context (the rest is padding)."""
    if grp.key_mask is not None:
        return grp.key_mask
    key_pos = torch.arange(grp.block_tables.shape[1] * block_size, device=grp.block_tables.device)
    return (key_pos[None, :] < grp.context_lens[:, None])[:, None, None, :]


def _paged_kernel_for(q: torch.Tensor, k_cache: torch.Tensor):
    """The paged decode kernel for this device and dtype (C++ on CPU for float32, Triton on CUDA),
    or None: the torch path then gathers."""
    if q.device.type == "cpu":
        fp32 = q.dtype == torch.float32 and k_cache.dtype == torch.float32
        return paged_kernel.paged_decode_attention if fp32 and paged_kernel.enabled() else None
    if triton_attention.supports(q, k_cache) and triton_attention.enabled():
        return triton_attention.paged_decode_attention
    return None


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks out of one layer's cache; index_select on flat rows runs ~7x faster
    than advanced indexing here (a memcpy per block instead of per element)."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids)


def register() -> None:
    """Masks are built per request from block tables, so no mask function is registered: for an
    attention without one, transformers builds no mask and skips its packed-sequence check, whose
    ``.all()`` is a host sync every forward (a CUDA graph capture fails on it where transformers does
    not skip it while capturing)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def registered():
    """The attention function the model's layers resolve ATTN_IMPLEMENTATION to (``register`` first)."""
    return ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
