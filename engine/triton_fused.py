"""The lean forward's elementwise work on CUDA as three Triton kernels: residual add + RMSNorm,
rotary embedding + KV-cache write, SiLU-and-multiply.

Why: a decode step of a small model on a big GPU is its kernels' count, not their work. On an
H100, SmolLM2's graph-replayed decode step at batch 64 ran 1,358 kernels (bf16): its four GEMMs
and two attention kernels per layer took 1.3 ms of GPU time, the other ~34 per layer 2.2 ms
(Hugging Face's RMSNorm is six, its rotary embedding ten, the KV write two, the residual adds and
the MLP's activation four) plus a launch gap each (benchmarks/results/cuda/profile_decode_bfloat16.txt).
Fused as vLLM and SGLang fuse them, a layer is ten kernels: add+norm, the q/k/v GEMM, rotary+KV
write, two attention kernels, o_proj, add+norm, the gate/up GEMM, SiLU-and-multiply, down_proj.

Each kernel computes in float32 and rounds to the model's dtype exactly where Hugging Face's ops
round (the residual sum; the normalized activations before the weight's multiply; each rotary
product; the SiLU before its multiply), so bfloat16 results stay within a rounding of the model's
own, and float32 greedy output equals HF's (tests/test_cuda.py on the GPU). Float32 products are
not contracted into FMAs (``enable_fp_fusion=False``): the rotary embedding of float32 keys gives
the bits torch's separate multiplies and add give. The norm's sum of squares runs in another order
than torch's mean: float32 activations may differ in their last bit.

Life cycle: the ModelRunner on CUDA calls ``usable`` once at start-up: each kernel runs on a small
case against the model's ops, and one that fails to compile, launch or compute turns all three
off for the process with a warning (the model's ops then serve: a GPU or Triton version the
kernels were never run on costs speed, never a request). engine.lean_forward then takes them per
forward where ``applies``; ``PDSERVE_TRITON_FUSED=off`` sends the forward down the model's own
ops instead (comparisons, tests). Outputs are new tensors (never written in place), so a CUDA
graph captures the calls as they are. Under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter) the
kernels also run on CPU tensors: how tests/test_triton_fused.py checks them on a machine without
a GPU where Triton is installed (it also compiles them for sm_90 and sm_80 there).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine import triton_support
from engine.switches import switched_off

logger = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_TRITON_FUSED"   # "off": the model's own norms, rotary, KV write and activation
# A kernel's result off the model's ops by more than this share of their scale fails the start-up
# check: it looks for a kernel that miscompiles or misreads its inputs, not for rounding.
CHECK_TOLERANCE = 2e-2


@triton_support.kernels
def _kernels(triton, tl):
    """The Triton kernels (compiled on first launch), or None where Triton does not import."""

    @triton.jit
    def add_rms_norm(X, RES, RES_OUT, W, OUT, stride_x, stride_res, stride_out, n, eps,
                     HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr):
        """One row: (x + residual, rounded to the model's dtype, stored as the new residual), then
        weight * (row * rsqrt(mean(row^2) + eps)) rounded as Hugging Face's RMSNorm rounds it."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < n
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            x = x.to(RES_OUT.dtype.element_ty)   # the model adds in its dtype
            tl.store(RES_OUT + row * stride_out + cols, x, mask=mask)
            x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
        normed = (x * rstd).to(OUT.dtype.element_ty).to(tl.float32)   # HF: hidden.to(input_dtype)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_out + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_write_kv(Q, K, V, COS, SIN, K_CACHE, V_CACHE, SLOTS, Q_OUT,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                      heads, kv_heads, ROWS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF: tl.constexpr):
        """One token: its query heads and key heads as the rows of one tile, each rotated
        (x*cos + rotate_half(x)*sin, each product rounded to x's dtype); the queries into Q_OUT
        [T, heads, 2*HALF], the keys and the copied values into the caches' slot (caches
        contiguous: [slots, kv_heads, 2*HALF])."""
        t = tl.program_id(0).to(tl.int64)
        half = tl.arange(0, HALF)[None, :]
        c1 = tl.load(COS + t * stride_ct + half).to(tl.float32)
        c2 = tl.load(COS + t * stride_ct + HALF + half).to(tl.float32)
        s1 = tl.load(SIN + t * stride_ct + half).to(tl.float32)
        s2 = tl.load(SIN + t * stride_ct + HALF + half).to(tl.float32)
        r = tl.arange(0, ROWS_PAD)[:, None]
        is_q = r < heads
        is_k = (r >= heads) & (r < heads + kv_heads)
        qh = tl.where(is_q, r, 0)
        kh = tl.where(is_k, r - heads, 0)
        src_q = Q + t * stride_qt + qh * stride_qh
        src_k = K + t * stride_kt + kh * stride_kh
        x1 = tl.where(is_q, tl.load(src_q + half, mask=is_q, other=0.0), tl.load(src_k + half, mask=is_k, other=0.0))
        x2 = tl.where(is_q, tl.load(src_q + HALF + half, mask=is_q, other=0.0),
                      tl.load(src_k + HALF + half, mask=is_k, other=0.0))
        dtype = x1.dtype
        a1 = (x1.to(tl.float32) * c1).to(dtype).to(tl.float32)
        b1 = (x2.to(tl.float32) * s1).to(dtype).to(tl.float32)
        a2 = (x2.to(tl.float32) * c2).to(dtype).to(tl.float32)
        b2 = (x1.to(tl.float32) * s2).to(dtype).to(tl.float32)
        y1 = (a1 - b1).to(dtype)
        y2 = (a2 + b2).to(dtype)
        dst_q = Q_OUT + (t * heads + qh) * (2 * HALF)
        tl.store(dst_q + half, y1, mask=is_q)
        tl.store(dst_q + HALF + half, y2, mask=is_q)
        slot = tl.load(SLOTS + t).to(tl.int64)
        dst_k = K_CACHE + (slot * kv_heads + kh) * (2 * HALF)
        tl.store(dst_k + half, y1, mask=is_k)
        tl.store(dst_k + HALF + half, y2, mask=is_k)
        vh = tl.arange(0, KV_PAD)[:, None]
        full = tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(V + t * stride_vt + vh * stride_vh + full, mask=vh < kv_heads, other=0.0)
        tl.store(V_CACHE + (slot * kv_heads + vh) * (2 * HALF) + full, v, mask=vh < kv_heads)

    @triton.jit
    def silu_mul(G, U, OUT, stride_g, stride_u, stride_out, n, BLOCK: tl.constexpr):
        """One row's block of columns: silu(gate) rounded to the dtype, times up."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(OUT + row * stride_out + cols, (act * u).to(OUT.dtype.element_ty), mask=mask)

    return add_rms_norm, rope_write_kv, silu_mul


def enabled() -> bool:
    """Triton imports and ``PDSERVE_TRITON_FUSED=off`` does not switch the kernels off."""
    return not switched_off(ENV_VAR) and _kernels() is not None


def _runs_on(x: torch.Tensor) -> bool:
    """CUDA tensors; CPU ones too under Triton's interpreter (tests without a GPU)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def applies(hidden: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """The lean forward may take these kernels for this forward: on the GPU, Triton present, the
    norm weights in the activations' dtype (Hugging Face's product then keeps that dtype), and the
    kernels passed their check on this device and dtype."""
    return (_runs_on(hidden) and norm_weight.dtype == hidden.dtype and enabled()
            and usable(hidden.device, hidden.dtype))


def usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Each kernel runs once on a small case against the model's ops (the first time per device and
    dtype: the ModelRunner asks at start-up, before any graph capture). A kernel that fails to
    compile or to launch on this GPU and Triton, or gives a wrong result, turns the three off for
    the process with a warning saying why: the model's own ops still serve every request."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" (the ModelRunner's start-up call) and "cuda:0" (each forward's) are one GPU: one check.
        device = torch.device("cuda", torch.cuda.current_device())
    return _checked(device, dtype)


@functools.cache
def _checked(device: torch.device, dtype: torch.dtype) -> bool:
    """``usable``'s verdict, once per GPU and dtype."""
    try:
        reason = _check(device, dtype)
    except Exception as exc:   # noqa: BLE001 - any failure of a kernel is the reason to keep the model's ops
        reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        logger.warning("Triton fused kernels off on %s for %s (%s): the model's own ops run instead",
                       device, dtype, reason)
    return reason is None


def _check(device: torch.device, dtype: torch.dtype) -> str | None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head_dim, n = 3, 4, 2, 16, 48

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    x, residual, weight = rand(1, tokens, n), rand(1, tokens, n), rand(n)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    want_sum = (x + residual).float()
    want = weight.float() * want_sum * torch.rsqrt(want_sum.pow(2).mean(-1, keepdim=True) + 1e-6)
    q, k, v = rand(tokens, heads, head_dim), rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    cos, sin = rand(tokens, head_dim), rand(tokens, head_dim)
    k_cache, v_cache = rand(2, 4, kv_heads, head_dim), rand(2, 4, kv_heads, head_dim)
    slots = torch.tensor([5, 0, 3], device=device)
    q_rot = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)

    def rotate(t):
        half = head_dim // 2
        turned = torch.cat((-t[..., half:], t[..., :half]), dim=-1).float()
        return t.float() * cos[:, None].float() + turned * sin[:, None].float()

    gate, up = rand(tokens, n), rand(tokens, n)
    checks = {
        "add_rms_norm": (normed, want), "residual": (summed, want_sum),
        "rope_write_kv (queries)": (q_rot, rotate(q)),
        "rope_write_kv (keys)": (k_cache.view(-1, kv_heads, head_dim)[slots], rotate(k)),
        "rope_write_kv (values)": (v_cache.view(-1, kv_heads, head_dim)[slots], v),
        "silu_mul": (silu_mul(gate, up), torch.nn.functional.silu(gate.float()) * up.float()),
    }
    for name, (got, expected) in checks.items():
        scale = expected.float().abs().max().item()
        err = (got.float() - expected.float()).abs().max().item()
        if not err <= CHECK_TOLERANCE * scale:
            return f"{name} off by {err:.3g} at scale {scale:.3g}"
    return None


def rope_supports(head_dim: int, cos: torch.Tensor) -> bool:
    """A power-of-two head size (the kernel's halves are tiles) rotated in full."""
    return head_dim >= 4 and triton_support.is_pow2(head_dim) and cos.shape[-1] == head_dim


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``, or ``(norm(x), x)`` without a residual: what
    ``hidden = residual + x; norm(hidden)`` gives in the model's ops. x and residual [..., n]
    with unit-stride rows; weight [n]."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else rows
    res = residual.reshape(-1, n) if residual is not None else rows
    kernel = _kernels()[0]
    block = triton_support.next_pow2(n)
    with triton_support.launch_device(x):
        kernel[(rows.shape[0],)](rows, res, res_out, weight, out, rows.stride(0), res.stride(0), out.stride(0),
                                 n, float(eps), HAS_RES=residual is not None, BLOCK_N=block,
                                 num_warps=4 if block >= 1024 else 2)
    shape = x.shape
    return out.view(shape), (res_out.view(shape) if residual is not None else x)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """engine.paged_kernel.rope_write_kv's contract on the GPU: q [T, heads, d], k and v
    [T, kv_heads, d] (unit-stride d, e.g. views of the fused projection's output); cos, sin
    [T, d]; caches [num_blocks, block_size, kv_heads, d] contiguous; slots [T] flat slots.
    Returns the rotated queries [T, heads, d] (contiguous); the rotated keys and the values are
    written into the caches."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    kernel = _kernels()[1]
    with triton_support.launch_device(q):
        kernel[(tokens,)](q, k, v, cos, sin, k_cache, v_cache, slots, q_out,
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
                          heads, kv_heads, ROWS_PAD=max(2, triton_support.next_pow2(heads + kv_heads)),
                          KV_PAD=max(2, triton_support.next_pow2(kv_heads)),   # tiles of one row avoided
                          HALF=head_dim // 2, num_warps=2, enable_fp_fusion=False)
    return q_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as the model's ops round it; gate and up [..., n] with unit-stride rows
    (e.g. the column halves of the fused gate/up projection's output)."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton_support.next_pow2(n))
    kernel = _kernels()[2]
    with triton_support.launch_device(gate):
        kernel[(g.shape[0], -(-n // block))](g, u, out, g.stride(0), u.stride(0), out.stride(0), n, BLOCK=block,
                                            num_warps=4, enable_fp_fusion=False)
    return out.view(gate.shape)
