"""The C++ paged decode-attention kernel against a plain reference (gathered K/V, float64 softmax),
and the engine's dispatch to it. Skipped only where the kernel cannot be built (never under CI)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import attention, cpu_kernels, paged_kernel
from engine.attention import DecodeGroup
from tests.conftest import require_kernel


@pytest.fixture(scope="module")
def kernel():
    require_kernel(paged_kernel.available(),
                   f"paged attention kernel cannot be built here: {paged_kernel.unavailable_reason()}")
    return paged_kernel


def reference(q, k_cache, v_cache, tables, ctx_lens, scale):
    """Per request: gather its blocks, cut to its context, repeat KV heads per group, softmax in float64."""
    n, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    groups = heads // kv_heads
    out = []
    for i in range(n):
        length = int(ctx_lens[i])
        ids = tables[i, : -(-length // block_size)]
        k = k_cache[ids].reshape(-1, kv_heads, d)[:length].double().repeat_interleave(groups, dim=1)
        v = v_cache[ids].reshape(-1, kv_heads, d)[:length].double().repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.stack(out).float()


def make_case(ctx_lens, groups, head_dim=64, kv_heads=3, block_size=16, seed=0, q_scale=1.0):
    """Caches with more blocks than needed; each request's table is a shuffled, non-contiguous
    draw from the pool, padded past its length with a block id that must never be read (0)."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.tensor(ctx_lens, dtype=torch.long)
    needed = [-(-c // block_size) for c in ctx_lens]
    pool = 2 * sum(needed) + 3
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(pool, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(pool, generator=g).tolist()
    tables = torch.zeros(len(ctx_lens), max(needed) + 2, dtype=torch.long)
    at = 0
    for i, nb in enumerate(needed):
        tables[i, :nb] = torch.tensor(perm[at : at + nb])
        at += nb
    q = torch.randn(len(ctx_lens), kv_heads * groups, head_dim, generator=g) * q_scale
    return q, k_cache, v_cache, tables, ctx


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


CTX = [1, 2, 15, 16, 17, 31, 32, 33, 100, 640, 1000]


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 16, 128, 24])
def test_matches_reference(kernel, groups, head_dim, portable):
    q, kc, vc, tables, ctx = make_case(CTX, groups, head_dim=head_dim)
    scale = head_dim**-0.5
    got = kernel.paged_decode_attention(q, kc, vc, tables, ctx, scale, portable=portable)
    assert rel_err(got, reference(q, kc, vc, tables, ctx, scale)) < 1e-5


@pytest.mark.parametrize("groups", range(1, 10))
def test_query_head_tiles(kernel, groups):
    """Every group size (query heads per KV head, 1-9: tiled kernels split them unevenly), blocks
    ending 1-3 keys past a multiple of 4 (the SIMD path scores keys 4 at a time), whole requests
    (many) and requests split per KV head (few)."""
    lens = [1, 2, 3, 5, 6, 7, 16, 18, 35, 63, 200, 401]
    q, kc, vc, tables, ctx = make_case(lens, groups, kv_heads=2, seed=10 + groups)
    want = reference(q, kc, vc, tables, ctx, 0.125)
    assert rel_err(kernel.paged_decode_attention(q, kc, vc, tables, ctx, 0.125), want) < 1e-5
    few = kernel.paged_decode_attention(q[-2:], kc, vc, tables[-2:], ctx[-2:], 0.125)
    assert rel_err(few, want[-2:]) < 1e-5


@pytest.mark.parametrize("block_size", [1, 3, 16, 32])
def test_block_sizes(kernel, block_size):
    lens = [1, block_size, block_size + 1, 5 * block_size - 1, 77]
    q, kc, vc, tables, ctx = make_case(lens, 3, block_size=block_size, seed=block_size)
    got = kernel.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    assert rel_err(got, reference(q, kc, vc, tables, ctx, 0.125)) < 1e-5


def test_large_scores_stay_finite(kernel):
    """Scores in the hundreds, maxima late in the context: the online softmax must rescale, not overflow."""
    q, kc, vc, tables, ctx = make_case([5, 40, 300, 700], 3, q_scale=40.0, seed=3)
    got = kernel.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    assert torch.isfinite(got).all()
    assert rel_err(got, reference(q, kc, vc, tables, ctx, 0.125)) < 1e-5


def test_single_request_and_threads_agree(kernel):
    """One request (items split per KV head) and many; 1 and 2 threads give identical bits."""
    q, kc, vc, tables, ctx = make_case([1000, 3, 500, 64] * 5, 3, seed=4)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(kernel.paged_decode_attention(q, kc, vc, tables, ctx, 0.125))
            one = kernel.paged_decode_attention(q[:1], kc, vc, tables[:1], ctx[:1], 0.125)
            assert torch.equal(one, outs[-1][:1])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], reference(q, kc, vc, tables, ctx, 0.125)) < 1e-5


def test_strided_query_and_out(kernel):
    """q as the engine passes it: a [n, heads, d] transposed view of [heads, tokens, d]."""
    q, kc, vc, tables, ctx = make_case([7, 90, 33], 3, seed=5)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_view.is_contiguous()
    out = torch.full((3, 3, 9, 64), float("nan"))[:, 1].transpose(0, 1).contiguous().transpose(0, 1)
    kernel.paged_decode_attention(q_view, kc, vc, tables, ctx, 0.125, out=out)
    assert rel_err(out, reference(q, kc, vc, tables, ctx, 0.125)) < 1e-5


def test_bad_inputs_raise(kernel):
    q, kc, vc, tables, ctx = make_case([20, 40], 3)
    bad_block = tables.clone()
    bad_block[1, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_decode_attention(q, kc, vc, bad_block, ctx, 0.125)
    with pytest.raises(RuntimeError, match=">= 1"):
        kernel.paged_decode_attention(q, kc, vc, tables, torch.tensor([0, 40]), 0.125)
    with pytest.raises(RuntimeError, match="blocks"):
        kernel.paged_decode_attention(q, kc, vc, tables[:, :1], ctx, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.paged_decode_attention(q.double(), kc, vc, tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        kernel.paged_decode_attention(q[:, :4], kc, vc, tables, ctx, 0.125)


def _decode_inputs(lens, groups=3, block_size=16):
    """A padded DecodeGroup as ModelRunner builds it, and q as [heads, tokens, d]."""
    q, kc, vc, tables, ctx = make_case(lens, groups, block_size=block_size, seed=6)
    max_blocks = -(-max(lens) // block_size)
    key_mask = torch.arange(max_blocks * block_size)[None, :] < ctx[:, None]
    grp = DecodeGroup(
        q_index=torch.arange(len(lens)) * 2 + 1,   # decode tokens interleaved with other packed tokens
        block_tables=tables[:, :max_blocks].contiguous(),
        key_mask=key_mask[:, None, None, :],
        context_lens=ctx,
    )
    packed = torch.randn(q.shape[1], 2 * len(lens) + 1, q.shape[2])
    packed[:, grp.q_index] = q.transpose(0, 1)
    return packed, kc, vc, grp, groups


def test_attention_dispatch_matches_torch_path(kernel, monkeypatch):
    packed, kc, vc, grp, groups = _decode_inputs([1, 16, 17, 250, 333])
    monkeypatch.delenv(paged_kernel.ENV_VAR, raising=False)
    assert paged_kernel.enabled()
    got = attention._decode(packed, kc, vc, grp, groups, 0.125)
    monkeypatch.setenv(paged_kernel.ENV_VAR, "torch")
    assert not paged_kernel.enabled()
    want = attention._decode(packed, kc, vc, grp, groups, 0.125)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-5


def test_dispatch_falls_back_without_context_lens(kernel, monkeypatch):
    """Metadata built without context lengths (or non-float32) takes the torch path unchanged."""
    monkeypatch.delenv(paged_kernel.ENV_VAR, raising=False)
    packed, kc, vc, grp, groups = _decode_inputs([5, 40])
    with_kernel = attention._decode(packed, kc, vc, grp, groups, 0.125)
    grp.context_lens = None
    plain = attention._decode(packed, kc, vc, grp, groups, 0.125)
    assert rel_err(with_kernel, plain) < 1e-5
    grp.context_lens = torch.tensor([5, 40])
    half = attention._decode(packed.double(), kc.double(), vc.double(), grp, groups, 0.125)
    assert half.dtype == torch.float64


def test_torch_path_builds_the_mask_a_group_left_out(monkeypatch):
    """The ModelRunner leaves the key mask out where the CPU paged kernel runs; should the torch
    path take such a group after all (another q dtype), it builds the same mask from context_lens."""
    monkeypatch.setenv(paged_kernel.ENV_VAR, "torch")
    packed, kc, vc, grp, groups = _decode_inputs([1, 16, 17, 250, 333])
    masked = attention._decode(packed, kc, vc, grp, groups, 0.125)
    unmasked = attention._decode(packed, kc, vc, dataclasses.replace(grp, key_mask=None), groups, 0.125)
    assert torch.equal(masked, unmasked)


def test_runner_groups_decodes_for_the_cpu_kernel(tiny_model, monkeypatch):
    """With the CPU paged kernel: one group in step order, no mask, and a decode-only step's group
    reads q as it is (every_token); on the torch path the mask is built."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.types import RequestSpec, SamplingParams

    monkeypatch.delenv(paged_kernel.ENV_VAR, raising=False)
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64))
    for i, n in enumerate([40, 3, 21]):
        engine.add_request(RequestSpec(f"r{i}", tuple(range(5, 5 + n)), SamplingParams(max_tokens=4)))
    engine.step()   # the prompts
    out, _ = engine.scheduler.schedule()
    groups = engine.runner.prepare(out).metadata.decode_groups
    if paged_kernel.enabled():
        assert len(groups) == 1 and groups[0].every_token and groups[0].key_mask is None
        assert groups[0].q_index.tolist() == [0, 1, 2]
    monkeypatch.setenv(paged_kernel.ENV_VAR, "torch")
    assert all(g.key_mask is not None for g in engine.runner.prepare(out).metadata.decode_groups)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_every_token_group_equals_the_gathered_one(kernel, monkeypatch, path):
    """A decode-only step's one group (``every_token``: its queries are the step's tokens in order)
    attends on q as it is and returns the rows as they are: the same values as gathering q by
    q_index and scattering the output back, through paged_attention itself."""
    if path == "torch":
        monkeypatch.setenv(paged_kernel.ENV_VAR, "torch")
    lens = [1, 16, 17, 250, 333]
    packed, kc, vc, grp, groups = _decode_inputs(lens)
    q = packed[:, grp.q_index]                                        # [heads, tokens, d]: only decode tokens
    query = q.transpose(0, 1).contiguous().transpose(0, 1)[None]       # strided as a model's q_proj view is
    kv_heads, d = kc.shape[-2:]
    key = torch.zeros(1, kv_heads, len(lens), d)
    cache = torch.stack([torch.stack([kc, vc])])                      # [layers=1, 2, blocks, bs, kv_heads, d]
    spare = next(b for b in range(kc.shape[0]) if b not in set(grp.block_tables.flatten().tolist()))   # no table reads it
    slots = torch.arange(len(lens)) + spare * kc.shape[1]
    layer = torch.nn.Module()
    layer.layer_idx = 0
    results = {}
    for every_token in (False, True):
        group = dataclasses.replace(grp, q_index=torch.arange(len(lens)), every_token=every_token)
        meta = attention.AttentionMetadata(cache.clone(), slots, prefills=[], decode_groups=[group])
        results[every_token], _ = attention.paged_attention(layer, query, key, key, None, scaling=0.125,
                                                            pdserve_attn=meta)
    assert results[True].shape == results[False].shape == (1, len(lens), q.shape[0], d)
    assert torch.equal(results[True], results[False])


def test_build_failure_falls_back_to_torch(monkeypatch, caplog):
    """A machine where the kernel cannot build: one warning, enabled() is False, attention works."""
    import torch.utils.cpp_extension as cpp_extension

    def broken_load(*args, **kwargs):
        raise RuntimeError("Error building extension: no compiler")

    monkeypatch.setattr(cpu_kernels, "_module", None)
    monkeypatch.setattr(cpu_kernels, "_error", None)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    monkeypatch.delenv(paged_kernel.ENV_VAR, raising=False)
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        assert not paged_kernel.available()
        assert not paged_kernel.enabled()
        packed, kc, vc, grp, groups = _decode_inputs([5, 40])
        out = attention._decode(packed, kc, vc, grp, groups, 0.125)
    assert torch.isfinite(out).all()
    assert "no compiler" in paged_kernel.unavailable_reason()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


def test_releases_the_gil(kernel):
    """Another Python thread runs while the kernel computes (as with torch's own ops): the engine
    shares its process with gRPC / Ray / asyncio threads."""
    import threading
    import time

    g = torch.Generator().manual_seed(7)
    kc, vc = torch.randn(2, 64, 16, 3, 64, generator=g)
    tables = torch.arange(64).repeat(64, 4)                  # 64 requests x 4096 keys, 3 MB of cache
    ctx = torch.full((64,), 4096)
    q = torch.randn(64, 9, 64, generator=g)
    stamps, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.02)
        start = time.perf_counter()
        kernel.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
    margin = 0.2 * (end - start)
    inside = [s for s in stamps if start + margin < s < end - margin]
    assert end - start > 0.005 and len(inside) > 10, (end - start, len(inside))


def test_build_directory_follows_the_kernel_sources(tmp_path, monkeypatch):
    """Two checkouts with different kernel sources (git worktrees) on one machine build into
    different directories instead of rebuilding over each other."""
    for name in ("paged_attention.cpp", "module.cpp"):
        (tmp_path / name).write_text(f"// {name}\n")
    monkeypatch.setattr(cpu_kernels, "CSRC", tmp_path)
    before = cpu_kernels.build_directory()
    assert cpu_kernels.build_directory() == before, "the tag is stable for the same sources"
    (tmp_path / "module.cpp").write_text("// module.cpp, edited\n")
    assert cpu_kernels.build_directory() != before
    edited = cpu_kernels.build_directory()
    (tmp_path / "simd.h").write_text("// simd.h, the kernels' shared header\n")
    assert cpu_kernels.build_directory() != edited, "headers count too"
