"""The C++ causal prefill-attention kernel against a plain reference (gathered K/V, float64 softmax,
explicit causal mask offset by the computed tokens), and the engine's dispatch to it: a whole
prompt, a later chunk of it, the SDPA path it replaces. Skipped only where the kernel cannot be
built (never under CI); a head_dim it does not take must leave SDPA in use."""

from __future__ import annotations

import pytest
import torch

from engine import attention, paged_kernel
from engine.attention import AttentionMetadata, PrefillSegment
from tests.conftest import assert_no_leaks, require_kernel


@pytest.fixture(scope="module")
def kernel():
    require_kernel(paged_kernel.available(),
                   f"paged attention kernel cannot be built here: {paged_kernel.unavailable_reason()}")
    require_kernel(paged_kernel.prefill_supports(64), "this build has no SIMD path: the prefill kernel is off, SDPA runs")
    return paged_kernel


def make_case(q_len, ctx_len, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0, q_scale=1.0):
    """Caches with more blocks than needed; the request's blocks a shuffled, non-contiguous draw
    from the pool; q [heads, q_len, d] strided as the model's (a transposed [q_len, heads, d])."""
    g = torch.Generator().manual_seed(seed)
    needed = -(-ctx_len // block_size)
    pool = 2 * needed + 3
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    block_ids = torch.randperm(pool, generator=g)[:needed]
    q = (torch.randn(q_len, heads, head_dim, generator=g) * q_scale).transpose(0, 1)
    return q, k_cache, v_cache, block_ids


def reference(q, k_cache, v_cache, block_ids, ctx_len, scale):
    heads, q_len, d = q.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[block_ids].reshape(-1, kv_heads, d)[:ctx_len].double().repeat_interleave(heads // kv_heads, 1)
    v = v_cache[block_ids].reshape(-1, kv_heads, d)[:ctx_len].double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("hqd,khd->hqk", q.double(), k) * scale
    positions = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    scores = scores.masked_fill(torch.arange(ctx_len)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


# (q_len, ctx_len): whole prompts (equal) and later chunks; lengths around the kernel's chunk of
# 64 keys, its query blocks and the block size of 16.
SEGMENTS = [(1, 1), (2, 2), (15, 15), (16, 16), (17, 17), (63, 63), (64, 64), (65, 65), (100, 100),
            (333, 333), (1, 40), (7, 64), (17, 81), (64, 200), (96, 97), (250, 700)]


@pytest.mark.parametrize("q_len,ctx_len", SEGMENTS)
def test_matches_reference(kernel, q_len, ctx_len):
    q, kc, vc, ids = make_case(q_len, ctx_len, seed=q_len * 1000 + ctx_len)
    got = kernel.paged_prefill_attention(q, kc, vc, ids, ctx_len, 0.125)
    assert rel_err(got, reference(q, kc, vc, ids, ctx_len, 0.125)) < 1e-5


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7, 9])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_head_shapes(kernel, groups, head_dim):
    """Query heads per KV head 1-9 (rows of a register tile split them unevenly) and every head_dim
    the kernel takes on either SIMD width."""
    if not kernel.prefill_supports(head_dim):
        pytest.skip(f"head_dim {head_dim} is not a multiple of this build's SIMD width")
    for q_len, ctx_len in [(37, 37), (29, 150)]:
        q, kc, vc, ids = make_case(q_len, ctx_len, heads=2 * groups, kv_heads=2, head_dim=head_dim, seed=groups)
        scale = head_dim**-0.5
        got = kernel.paged_prefill_attention(q, kc, vc, ids, ctx_len, scale)
        assert rel_err(got, reference(q, kc, vc, ids, ctx_len, scale)) < 1e-5


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
def test_block_sizes(kernel, block_size):
    q, kc, vc, ids = make_case(70, 130, block_size=block_size, seed=block_size)
    got = kernel.paged_prefill_attention(q, kc, vc, ids, 130, 0.125)
    assert rel_err(got, reference(q, kc, vc, ids, 130, 0.125)) < 1e-5


def test_large_scores_stay_finite(kernel):
    """Scores in the hundreds with the maximum late: the online softmax must rescale, not overflow.
    float32 scores that large carry ~1e-5 relative error into exp whoever computes them: the kernel
    must be as close to the float64 reference as SDPA is (the path it replaces)."""
    q, kc, vc, ids = make_case(150, 300, q_scale=40.0, seed=3)
    got = kernel.paged_prefill_attention(q, kc, vc, ids, 300, 0.125)
    assert torch.isfinite(got).all()
    want = reference(q, kc, vc, ids, 300, 0.125)
    k, v = (c[ids].reshape(-1, 3, 64)[:300].transpose(0, 1)[None] for c in (kc, vc))
    mask = torch.zeros(150, 300).masked_fill_(torch.arange(300)[None, :] > torch.arange(150, 300)[:, None], float("-inf"))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    assert rel_err(got, want) <= 1.1 * rel_err(sdpa[0].transpose(0, 1), want) + 1e-6


def test_threads_agree_bit_for_bit(kernel):
    q, kc, vc, ids = make_case(300, 300, seed=4)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kernel.paged_prefill_attention(q, kc, vc, ids, 300, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_writes_into_the_given_rows_only(kernel):
    """``out`` as the engine passes it: the segment's rows of the step's [tokens, heads, d] output."""
    q, kc, vc, ids = make_case(20, 50, seed=5)
    step_out = torch.full((30, 9, 64), float("nan"))
    got = kernel.paged_prefill_attention(q, kc, vc, ids, 50, 0.125, out=step_out[4:24])
    assert got.data_ptr() == step_out[4:24].data_ptr()
    assert torch.isnan(step_out[:4]).all() and torch.isnan(step_out[24:]).all()
    assert rel_err(step_out[4:24], reference(q, kc, vc, ids, 50, 0.125)) < 1e-5


def test_bad_inputs_raise(kernel):
    q, kc, vc, ids = make_case(20, 40)
    bad = ids.clone()
    bad[1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_prefill_attention(q, kc, vc, bad, 40, 0.125)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        kernel.paged_prefill_attention(q, kc, vc, ids[:2], 40, 0.125)
    with pytest.raises(RuntimeError, match="queries but a context of"):
        kernel.paged_prefill_attention(q, kc, vc, ids, 10, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.paged_prefill_attention(q.double(), kc, vc, ids, 40, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel.paged_prefill_attention(q[:4], kc, vc, ids, 40, 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        kernel.paged_prefill_attention(q[..., :5], kc[..., :5].contiguous(), vc[..., :5].contiguous(), ids, 40, 0.125)


def _layer_call(q_len, ctx_len, seed=6):
    """One layer's attention call as the engine makes it: a prefill segment (a later chunk when
    q_len < ctx_len) packed after one other token, its own K/V (re)written into the cache by the
    call. Returns the call's arguments and the reference output of the segment."""
    q, kc, vc, ids = make_case(q_len, ctx_len, seed=seed)
    kv_heads, d = kc.shape[-2:]
    bs = kc.shape[1]
    query = torch.cat([torch.randn(9, 1, d), q], dim=1)                  # [heads, 1 + q_len, d]
    query = query.transpose(0, 1).contiguous().transpose(0, 1)[None]      # strided as a q_proj view
    pos = torch.arange(ctx_len - q_len, ctx_len)
    spare = next(b for b in range(kc.shape[0]) if b not in set(ids.tolist()))   # the other token's slot
    slots = torch.cat([torch.tensor([spare * bs]), ids[pos // bs] * bs + pos % bs])
    zero = torch.zeros(1, kv_heads, 1, d)
    key = torch.cat([zero, kc[ids].reshape(-1, kv_heads, d)[pos].transpose(0, 1)[None]], dim=2)
    value = torch.cat([zero, vc[ids].reshape(-1, kv_heads, d)[pos].transpose(0, 1)[None]], dim=2)
    start = ctx_len - q_len
    mask = attention.offset_causal_mask(start, q_len, kc.dtype, kc.device) if start else None   # as the runner's
    seg = PrefillSegment(q_start=1, q_len=q_len, ctx_len=ctx_len, block_ids=ids, mask=mask)
    cache = torch.stack([torch.stack([kc, vc])])                          # [layers=1, 2, blocks, bs, kv_heads, d]
    layer = torch.nn.Module()
    layer.layer_idx = 0
    return layer, query, key, value, seg, cache, slots, reference(q, kc, vc, ids, ctx_len, 0.125)


@pytest.mark.parametrize("q_len,ctx_len", [(48, 48), (20, 90)])
def test_engine_dispatch_matches_sdpa(kernel, q_len, ctx_len):
    """paged_attention with AttentionMetadata.prefill_path the C++ kernel and SDPA (SDPA with the runner's
    mask): both equal the reference."""
    layer, query, key, value, seg, cache, slots, want = _layer_call(q_len, ctx_len)
    for path in (attention.PrefillPath.CPU_KERNEL, attention.PrefillPath.SDPA):
        meta = AttentionMetadata(cache.clone(), slots, prefills=[seg], decode_groups=[], prefill_path=path)
        out, _ = attention.paged_attention(layer, query, key, value, None, scaling=0.125, pdserve_attn=meta)
        assert rel_err(out[0, 1:], want) < 1e-5, path


def test_runner_uses_the_kernel_and_builds_no_mask(kernel, tiny_model, monkeypatch):
    """The ModelRunner's one choice: float32 CPU, a SIMD build the kernel is preferred on and a
    head_dim it takes -> the kernel and no mask for a later chunk; PDSERVE_ATTENTION=torch, or a
    build it is not preferred on -> SDPA with the offset mask. Same tokens."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.types import RequestSpec, SamplingParams

    # Where this build's SIMD width is not preferred (AVX2), the routing is tested as if it were.
    monkeypatch.setattr(paged_kernel, "PREFILL_SIMD_WIDTHS", frozenset({paged_kernel.simd_width()}))

    def run(env: str | None) -> tuple[list[int], list[AttentionMetadata]]:
        if env is None:
            monkeypatch.delenv(paged_kernel.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(paged_kernel.ENV_VAR, env)
        engine = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=8 << 20, max_num_batched_tokens=24,
                                                    enable_prefix_caching=False))
        seen, prepare = [], engine.runner.prepare
        engine.runner.prepare = lambda out: seen.append(prepare(out)) or seen[-1]
        spec = RequestSpec("r", tuple(range(5, 65)), SamplingParams(max_tokens=3, ignore_eos=True))
        tokens = engine.generate([spec])["r"]
        assert_no_leaks(engine)
        return tokens, [inputs.metadata for inputs in seen if inputs.metadata.prefills]   # the prompt steps

    def later_chunks(metas):
        return [seg for meta in metas for seg in meta.prefills if seg.ctx_len > seg.q_len]

    with_kernel, metas = run(None)
    assert later_chunks(metas) and all(meta.prefill_path is attention.PrefillPath.CPU_KERNEL for meta in metas)
    assert all(seg.mask is None for seg in later_chunks(metas))
    with_sdpa, metas = run("torch")
    assert later_chunks(metas) and all(meta.prefill_path is attention.PrefillPath.SDPA for meta in metas)
    assert all(seg.mask is not None for seg in later_chunks(metas))
    assert len(with_kernel) == 3 and with_kernel == with_sdpa
    monkeypatch.setattr(paged_kernel, "PREFILL_SIMD_WIDTHS", frozenset())
    with_sdpa_again, metas = run(None)
    assert all(meta.prefill_path is attention.PrefillPath.SDPA for meta in metas) and with_sdpa_again == with_kernel
