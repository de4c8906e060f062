"""The Triton paged decode-attention kernel (engine/triton_attention.py), on a GPU (CI has none:
these skip there; the lent GPU machine runs them through benchmarks/cuda_checks.sh). The kernel's
float32 and float16 results are also checked on CPU under Triton's interpreter (TRITON_INTERPRET=1).

- The kernel equals attention over each request's own keys computed directly (SDPA on the
  request's gathered context, no padding), for float32 within rounding and bfloat16 within its
  precision: grouped-query shapes (9 heads on 3 KV heads at head size 64, SmolLM2's; 4 on 2 at 16,
  the tiny test Llama's; 8 on 8 at 128; 4 on 1 at 32), contexts of
  one token, a block's, a tile's and a partition's edge, and long ones; block tables scattered over the pool,
  with padding past a row's context that points at live blocks (it must be masked out).
- It runs inside a CUDA graph capture and replays with new contexts (no host sync, fixed shapes).
- The engine's decode path picks it on CUDA and the torch path with ``PDSERVE_ATTENTION=torch``;
  on CPU it is never picked. The engine's output with it equals HF greedy: test_cuda.py.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from engine import attention, triton_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel's arithmetic also runs on CPU under Triton's interpreter (TRITON_INTERPRET=1 with
# Triton installed): how it can be checked on a machine without a GPU. Capture and dispatch need one.
needs_kernel = pytest.mark.skipif(
    triton_attention._kernels() is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_attention._kernels() is not None),
                               reason="needs a CUDA device and Triton")
BLOCK = 16


def make_case(num_heads: int, kv_heads: int, ctx_lens: list[int], dtype: torch.dtype, seed: int = 0,
              head_dim: int = 64):
    """A pool of random K/V, each request on scattered blocks; tables padded with live block ids."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-c // BLOCK) for c in ctx_lens) + 2
    num_blocks = sum(-(-c // BLOCK) for c in ctx_lens) + 8
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables = torch.empty(len(ctx_lens), width, dtype=torch.long)
    for i, c in enumerate(ctx_lens):
        used = -(-c // BLOCK)
        tables[i, :used] = torch.tensor(order[:used])
        tables[i, used:] = torch.tensor(random.Random(i).choices(range(num_blocks), k=width - used))
        order = order[used:]
    return q, k_cache, v_cache, tables.to(DEVICE), torch.tensor(ctx_lens).to(DEVICE)


def reference(q, k_cache, v_cache, tables, ctx_lens, scale):
    """Each request's attention over exactly its own context, in float32."""
    out = []
    kv_heads = k_cache.shape[2]
    for i, c in enumerate(ctx_lens.tolist()):
        blocks = tables[i, : -(-c // BLOCK)]
        k = k_cache[blocks].reshape(-1, kv_heads, k_cache.shape[-1])[:c].float().transpose(0, 1)
        v = v_cache[blocks].reshape(-1, kv_heads, v_cache.shape[-1])[:c].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].float()[:, None], k, v, scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


CONTEXTS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 130, 256, 333, 1000]


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 2), 16), ((8, 8), 128), ((4, 1), 32)])
def test_kernel_equals_attention_over_each_requests_own_context(dtype, tol, heads, head_dim):
    if DEVICE == "cpu" and dtype is torch.bfloat16:
        pytest.skip("Triton 3.9's CPU interpreter returns garbage (~1e8) from a bfloat16 tl.dot: GPU only")
    q, k_cache, v_cache, tables, ctx = make_case(*heads, CONTEXTS, dtype, head_dim=head_dim)
    scale = q.shape[-1] ** -0.5
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), reference(q, k_cache, v_cache, tables, ctx, scale), atol=tol, rtol=tol)


@needs_gpu
def test_kernel_is_captured_and_replays_with_new_contexts():
    q, k_cache, v_cache, tables, ctx = make_case(9, 3, [40, 7, 200, 64], torch.float32)
    scale = 0.125
    out = torch.empty_like(q)
    triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)   # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale))
    for new in ([1, 16, 17, 100], [64, 3, 150, 9]):
        ctx.copy_(torch.tensor(new))
        graph.replay()
        torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, ctx, scale), atol=1e-5, rtol=1e-5)


@needs_gpu
def test_decode_path_picks_the_kernel_on_cuda_and_the_torch_path_when_told(monkeypatch):
    q, k_cache, _, _, _ = make_case(9, 3, [5], torch.float32)
    assert attention._paged_kernel_for(q.transpose(0, 1), k_cache) is triton_attention.paged_decode_attention
    monkeypatch.setenv(triton_attention.ENV_VAR, "torch")
    assert attention._paged_kernel_for(q.transpose(0, 1), k_cache) is None


def test_never_picked_on_cpu():
    q = torch.zeros(3, 1, 64, dtype=torch.bfloat16)
    k_cache = torch.zeros(4, BLOCK, 3, 64, dtype=torch.bfloat16)
    assert not triton_attention.supports(q, k_cache)
    assert attention._paged_kernel_for(q, k_cache) is None


@pytest.mark.skipif(triton_attention._kernels() is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton, compiling (its interpreter builds no binaries; no GPU needed)")
@pytest.mark.parametrize("dtype,ieee", [("bf16", False), ("fp32", True)])
def test_kernels_compile_for_an_h100_without_one(dtype, ieee):
    """Both kernels compile to a cubin for sm_90 on any machine with Triton (its bundled ptxas), as
    the engine launches them for SmolLM2's shape (9 heads on 3 KV heads of 64, block 16, a 2,048-token
    table): the lowering the interpreter does not exercise."""
    compiler = pytest.importorskip("triton.compiler")
    backend = pytest.importorskip("triton.backends.compiler")
    import triton

    partial, combine = triton_attention._kernels()
    p = "*" + dtype
    ints = ("stride_qr", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_tr", "NUM_PARTS")
    consts = {"GROUPS": 3, "GROUPS_PAD": 16, "HEAD_DIM": 64, "BLOCK": BLOCK, "TILE": BLOCK * triton_attention.TILE_BLOCKS,
              "PART": triton_attention.PART_TOKENS, "IEEE": ieee}
    signature = {"Q": p, "K": p, "V": p, "TABLES": "*i64", "CTX": "*i64", "M_OUT": "*fp32", "L_OUT": "*fp32",
                 "ACC_OUT": "*fp32", "scale": "fp32", **{name: "i32" for name in ints}, **{c: "constexpr" for c in consts}}
    target = backend.GPUTarget("cuda", 90, 32)
    built = triton.compile(compiler.ASTSource(fn=partial, signature=signature, constexprs=consts), target=target)
    assert built.asm["cubin"]
    consts = {"HEADS": 9, "HEAD_DIM": 64, "PARTS_PAD": 16}
    signature = {"M_IN": "*fp32", "L_IN": "*fp32", "ACC_IN": "*fp32", "OUT": p, "stride_or": "i32", "stride_oh": "i32",
                 "NUM_PARTS": "i32", **{c: "constexpr" for c in consts}}
    built = triton.compile(compiler.ASTSource(fn=combine, signature=signature, constexprs=consts), target=target)
    assert built.asm["cubin"]
