"""The Triton paged prefill-attention kernel (engine/triton_prefill.py): every prompt segment of a
step in one launch per layer. On a GPU it runs as compiled; on CPU its arithmetic is checked under
Triton's interpreter (TRITON_INTERPRET=1 with Triton installed); CI has neither, so those skip
there (the lent GPU machine runs this file through benchmarks/cuda_checks.sh).

- The kernel equals causal attention over each segment's own context computed directly (SDPA on
  the segment's gathered keys with the offset causal mask of engine.attention): whole prompts and
  later chunks (after computed tokens), lengths at and around its tiles' edges, grouped-query
  shapes, block tables scattered over the pool; the step's decode rows are left as they were.
- engine.attention runs all segments in one call on ``PrefillPath.TRITON`` and gives what the SDPA
  path gives; the engine with it (chunked prefill, a cached prefix, several requests in a step)
  equals Hugging Face greedy, with no leak.
- Its plan packs a step's segments into one tensor (runs everywhere); the runner picks the path on
  CUDA only, SDPA with ``PDSERVE_ATTENTION=torch``; the kernel compiles for an H100 without one.
"""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import attention, triton_prefill
from engine.attention import AttentionMetadata, PrefillPath, PrefillSegment
from engine.triton_prefill import SegmentBounds
from tests.conftest import assert_no_leaks, greedy_workload, hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(
    triton_prefill._kernels() is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_prefill._kernels() is not None),
                               reason="needs a CUDA device and Triton")
BLOCK = 16
# (computed tokens before the segment, new tokens): whole prompts and later chunks around the
# kernel's tile edges (64 rows, 64 keys) and the block edge (16).
SEGMENTS = [(0, 1), (0, 17), (0, 64), (0, 65), (0, 130), (16, 48), (33, 95), (5, 1), (200, 70), (63, 2)]


def make_step(segments, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A packed step: each segment's rows follow one decode token's row (rows the kernel must not
    touch); each segment's context on scattered blocks of one pool of random K/V."""
    gen = torch.Generator().manual_seed(seed)
    blocks_of = [-(-(start + n) // BLOCK) for start, n in segments]
    num_blocks = sum(blocks_of) + 4
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    bounds, row = [], 0
    for (start, n), used in zip(segments, blocks_of):
        row += 1                                               # a decode token's row before each segment
        bounds.append(SegmentBounds(row, n, start + n, order[:used]))
        order, row = order[used:], row + n
    # [heads, tokens, head_dim] strided as the q projection's view
    q = torch.randn(row, num_heads, head_dim, generator=gen).to(dtype).transpose(0, 1)
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), bounds


def reference(q, k_cache, v_cache, seg: SegmentBounds, scale: float) -> torch.Tensor:
    """[q_len, heads, head_dim]: the segment's attention over exactly its own context, float32."""
    kv_heads, head_dim = k_cache.shape[-2:]
    ids = torch.tensor(seg.block_ids, device=k_cache.device)
    k = k_cache[ids].reshape(-1, kv_heads, head_dim)[: seg.ctx_len].float().transpose(0, 1)
    v = v_cache[ids].reshape(-1, kv_heads, head_dim)[: seg.ctx_len].float().transpose(0, 1)
    qs = q[:, seg.q_start : seg.q_start + seg.q_len].float()
    start = seg.ctx_len - seg.q_len
    mask = attention.offset_causal_mask(start, seg.q_len, torch.float32, q.device)
    o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 2), 16), ((8, 8), 128), ((4, 1), 32)])
def test_kernel_equals_causal_attention_over_each_segments_own_context(dtype, tol, heads, head_dim):
    if DEVICE == "cpu" and dtype is torch.bfloat16:
        pytest.skip("Triton 3.9's CPU interpreter returns garbage (~1e8) from a bfloat16 tl.dot: GPU only")
    q, k_cache, v_cache, bounds = make_step(SEGMENTS, *heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = torch.full((q.shape[1], *q.shape[::2]), 7.0, dtype=dtype, device=DEVICE)   # [tokens, heads, d]
    triton_prefill.paged_prefill_attention(q, k_cache, v_cache, triton_prefill.plan(bounds, q.device, dtype), scale, out)
    for seg in bounds:
        got = out[seg.q_start : seg.q_start + seg.q_len].float()
        torch.testing.assert_close(got, reference(q, k_cache, v_cache, seg, scale), atol=tol, rtol=tol)
    decode_rows = [seg.q_start - 1 for seg in bounds]
    assert bool((out[decode_rows] == 7.0).all()), "the kernel wrote rows that are not its segments'"


def _layer_call(dtype=torch.float32):
    """One layer's attention call as the engine makes it for a step of several segments and decode
    tokens, the segments' own K/V (re)written into the cache by the call."""
    q, k_cache, v_cache, bounds = make_step(SEGMENTS[:6], 9, 3, 64, dtype, seed=3)
    tokens = q.shape[1]
    slots = torch.full((tokens,), (k_cache.shape[0] - 1) * BLOCK, dtype=torch.long)   # decode rows: a spare slot
    key = torch.zeros(tokens, 3, 64, dtype=dtype)
    value = torch.zeros(tokens, 3, 64, dtype=dtype)
    for seg in bounds:
        pos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len)
        ids = torch.tensor(seg.block_ids)
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        slots[rows] = ids[pos // BLOCK] * BLOCK + pos % BLOCK
        key[rows] = k_cache[ids].reshape(-1, 3, 64)[pos]
        value[rows] = v_cache[ids].reshape(-1, 3, 64)[pos]
    cache = torch.stack([torch.stack([k_cache, v_cache])])            # [layers=1, 2, blocks, bs, kv_heads, d]
    layer = torch.nn.Module()
    layer.layer_idx = 0
    return layer, q[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], bounds, cache, slots


@needs_kernel
def test_attention_runs_every_segment_in_one_call_and_equals_the_sdpa_path(monkeypatch):
    layer, query, key, value, bounds, cache, slots = _layer_call()
    calls = []
    kernel = triton_prefill.paged_prefill_attention
    monkeypatch.setattr(triton_prefill, "paged_prefill_attention", lambda *a: calls.append(1) or kernel(*a))
    outs = {}
    for path in (PrefillPath.TRITON, PrefillPath.SDPA):
        plan = triton_prefill.plan(bounds, cache.device, cache.dtype)
        segments = [PrefillSegment(
            s.q_start, s.q_len, s.ctx_len, torch.tensor(s.block_ids),
            attention.offset_causal_mask(s.ctx_len - s.q_len, s.q_len, cache.dtype, cache.device)
            if s.ctx_len > s.q_len else None) for s in bounds]
        meta = AttentionMetadata(cache.clone(), slots, prefills=segments, decode_groups=[], prefill_path=path,
                                 prefill_plan=plan if path is PrefillPath.TRITON else None)
        outs[path], _ = attention.paged_attention(layer, query, key, value, None, scaling=0.125, pdserve_attn=meta)
    assert len(calls) == 1, "one kernel call for all of the step's segments"
    rows = torch.cat([torch.arange(s.q_start, s.q_start + s.q_len) for s in bounds])
    torch.testing.assert_close(outs[PrefillPath.TRITON][0, rows], outs[PrefillPath.SDPA][0, rows], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_engine_on_the_triton_prefill_equals_hf_greedy(tiny_model, hf_reference, monkeypatch):
    """Chunked prefill (a 24-token budget), a cached prefix and several requests in one step, every
    prompt step's segments on the kernel: tokens equal HF greedy, nothing leaked."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.types import RequestSpec, SamplingParams

    monkeypatch.setattr(ModelRunner, "_prefill_path", lambda self: PrefillPath.TRITON)
    engine = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=8 << 20, max_num_batched_tokens=24, device=DEVICE))
    seen, prepare = [], engine.runner.prepare
    engine.runner.prepare = lambda out: seen.append(prepare(out)) or seen[-1]
    prompts, max_tokens, refs = greedy_workload(hf_reference, seed=11, num=4, prompt_len=(5, 40), output_len=(2, 6))
    shared = prompts[0][:32] + [7, 8, 9]                 # a cached prefix of prompt 0's first two blocks
    prompts.append(shared)
    max_tokens.append(4)
    refs.append(hf_greedy(hf_reference, shared, 4))
    specs = [RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True))
             for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    first = engine.generate(specs[:4])
    later = engine.generate(specs[4:])
    assert [first[f"r{i}"] for i in range(4)] + [later["r4"]] == refs
    prompt_steps = [inputs.metadata for inputs in seen if hasattr(inputs, "metadata") and inputs.metadata.prefills]
    assert prompt_steps and all(m.prefill_path is PrefillPath.TRITON for m in prompt_steps)
    assert any(s.ctx_len > s.q_len for m in prompt_steps for s in m.prefills), "no later chunk was run"
    assert any(len(m.prefills) > 1 for m in prompt_steps), "no step with several segments"
    assert_no_leaks(engine)


@needs_kernel
def test_start_up_check_passes_the_kernel_and_turns_a_wrong_one_off(monkeypatch, caplog):
    device = torch.device(DEVICE)
    shape = triton_prefill.HeadShape(num_heads=9, kv_heads=3, head_dim=64, block_size=BLOCK)   # SmolLM2's
    triton_prefill._checked.cache_clear()
    assert triton_prefill.usable(device, torch.float32, shape)
    assert triton_prefill.usable(device, torch.float32, triton_prefill.HeadShape(4, 1, 32, 8))
    triton_prefill._checked.cache_clear()
    kernel = triton_prefill.paged_prefill_attention

    def off_by_one(q, k_cache, v_cache, prefill, scale, out):
        kernel(q, k_cache, v_cache, prefill, scale, out)
        out[2] += 1.0                                   # a miscompiled kernel's wrong row

    monkeypatch.setattr(triton_prefill, "paged_prefill_attention", off_by_one)
    with caplog.at_level("WARNING", logger="engine.triton_prefill"):
        assert not triton_prefill.usable(device, torch.float32, shape)
    assert "SDPA runs prompt segments instead" in caplog.text and "off SDPA by" in caplog.text
    triton_prefill._checked.cache_clear()


def test_plan_packs_a_steps_segments_into_one_tensor():
    bounds = [SegmentBounds(1, 130, 130, [4, 2, 9, 7, 5, 1, 3, 8, 6]), SegmentBounds(132, 5, 40, [11, 0, 10])]
    for dtype, rows in ((torch.float32, 32), (torch.bfloat16, 64)):
        plan = triton_prefill.plan(bounds, torch.device("cpu"), dtype)
        assert plan.tables.tolist() == [4, 2, 9, 7, 5, 1, 3, 8, 6, 11, 0, 10]
        assert plan.segments.tolist() == [[1, 130, 130, 0], [132, 5, 40, 9]]
        assert plan.shape.rows == rows and plan.tiles.tolist() == [[0, r] for r in range(0, 130, rows)] + [[1, 0]]
    assert plan.tables.untyped_storage().data_ptr() == plan.tiles.untyped_storage().data_ptr(), "one copy"


def test_runner_never_picks_it_on_cpu(tiny_model):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    engine = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=8 << 20))
    assert engine.runner._prefill_path() is not PrefillPath.TRITON
    assert not triton_prefill.supports(torch.device("cpu"), 64, BLOCK)


@needs_gpu
def test_runner_picks_it_on_cuda_and_sdpa_when_told(tiny_model, monkeypatch):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    engine = LLMEngine(tiny_model, EngineConfig(kv_cache_bytes=8 << 20, device="cuda"))
    assert engine.runner._prefill_path() is PrefillPath.TRITON
    monkeypatch.setenv(triton_prefill.ENV_VAR, "torch")
    assert engine.runner._prefill_path() is PrefillPath.SDPA


@pytest.mark.skipif(triton_prefill._kernels() is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton, compiling (its interpreter builds no binaries; no GPU needed)")
@pytest.mark.parametrize("dtype,ieee", [("bf16", False), ("fp32", True)])
def test_kernel_compiles_for_an_h100_without_one(dtype, ieee, tmp_path):
    """The kernel compiles to a cubin for sm_90 on any machine with Triton (its bundled ptxas), as
    the engine launches it for SmolLM2's shape (9 heads on 3 KV heads of 64, block 16), and its
    tiles spill no registers to the stack (Triton's bundled cuobjdump reads the cubin)."""
    compiler = pytest.importorskip("triton.compiler")
    backend = pytest.importorskip("triton.backends.compiler")
    import triton

    p = "*" + dtype
    tiles = triton_prefill.FP32_TILES if ieee else triton_prefill.HALF_TILES
    consts = {"GROUPS": 3, "HEAD_DIM": 64, "BLOCK": BLOCK, "TILE_M": tiles.rows, "TILE_N": tiles.keys, "IEEE": ieee}
    ints = ("stride_qh", "stride_qt", "stride_ot", "stride_oh", "stride_kb", "stride_kt", "stride_kh")
    signature = {"Q": p, "K": p, "V": p, "OUT": p, "TABLES": "*i64", "SEGMENTS": "*i64", "TILES": "*i64",
                 "scale": "fp32", **{name: "i32" for name in ints}, **{c: "constexpr" for c in consts}}
    source = compiler.ASTSource(fn=triton_prefill._kernels(), signature=signature, constexprs=consts)
    built = triton.compile(source, target=backend.GPUTarget("cuda", 90, 32), options={"num_warps": tiles.warps})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cuobjdump.exists():
        cubin = tmp_path / "prefill.cubin"
        cubin.write_bytes(built.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        assert " STACK:0 " in usage, usage
