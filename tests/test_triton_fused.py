"""engine.triton_fused: the lean forward's fused GPU kernels against the model's own ops.

Each kernel against the ops it replaces, in float32 and bfloat16, on SmolLM2's shapes (hidden 576,
9 query heads on 3 KV heads of 64, MLP 1536) and the tiny test Llama's (4 on 2 of 16), inputs as
the forward hands them over (column views of a fused projection's output):
- add + RMSNorm: the residual sum bit for bit (it is one rounding either way); the normed output
  within float32 rounding (the sum of squares is reduced in another order), and in bfloat16 within
  one rounding of the model's own;
- rotary + KV write: the rotated queries and the cache bit for bit (no FMA contraction: the same
  multiplies and add, rounded where torch rounds them); only the step's slots are written;
- SiLU-and-multiply: within float32 rounding of exp; within one rounding in bfloat16.
Then the whole lean forward on the kernels: greedy output of the engine (eager, and through the
decode graphs) equal to Hugging Face ``generate`` with the leak check, on the tiny Llama and (slow,
interpreter only) on the embedded SmolLM2 with its real weights. The start-up check: a kernel
that fails to launch, or returns a wrong result, turns them off with a warning and the model's own
ops serve (these two run everywhere, CI included, with stand-ins for the broken kernels). Where
Triton is installed, GPU or not: each kernel compiles to a cubin for sm_90 and sm_80.

They run on a GPU (the lent machine: benchmarks/cuda_checks.sh), or on CPU under Triton's
interpreter (``TRITON_INTERPRET=1`` with Triton installed: how they were written without one);
elsewhere (CI: no GPU, no Triton) the kernels' own tests skip.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine import triton_fused
from engine.config import EngineConfig, GraphMode
from engine.engine import LLMEngine
from engine.model_loader import random_model
from engine.types import RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy
from tests.test_engine_exact import run_staggered

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    triton_fused._kernels() is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
DTYPES = [torch.float32, torch.bfloat16]
# (heads, kv_heads, head_dim): SmolLM2's, the tiny Llama's, multi-head 128, multi-query 32
ATTN_SHAPES = [(9, 3, 64), (4, 2, 16), (8, 8, 128), (4, 1, 32)]


# Triton's CPU interpreter truncates float32 to bfloat16 where a GPU rounds to nearest even: one
# more unit in the last place there, and no bit-for-bit check of bfloat16 results.
INTERPRETED = DEVICE == "cpu"


def _equal_as_rounded(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit: the kernel rounds where the model's ops round. Under the interpreter's bfloat16
    truncation, within a few ulps of the tensor's scale (a difference of close products cancels)."""
    if INTERPRETED and want.dtype is torch.bfloat16:
        scale = want.float().abs().max()
        assert bool(((got.float() - want.float()).abs() <= 4 * torch.finfo(want.dtype).eps * scale).all())
    else:
        assert torch.equal(got, want)


def _within_rounding(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> None:
    """Equal up to ``ulps`` units in the last place of ``want``'s dtype (float32 compared exactly
    to one ulp of bfloat16 when the dtype is bfloat16)."""
    eps = torch.finfo(want.dtype).eps
    ulps += INTERPRETED and want.dtype is torch.bfloat16
    tol = ulps * eps * want.float().abs().clamp_min(1e-3)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= tol).all()), f"max diff {diff.max().item():.3g} (tolerance {ulps} ulp)"


def _fused_columns(tokens: int, widths: list[int], dtype, seed: int) -> list[torch.Tensor]:
    """Column views of one [tokens, sum(widths)] tensor, as a fused projection hands them over."""
    gen = torch.Generator().manual_seed(seed)
    whole = torch.randn(tokens, sum(widths), generator=gen).to(dtype).to(DEVICE)
    return list(whole.split(widths, dim=-1))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,tokens", [(576, 7), (64, 1), (100, 33)])
def test_add_rms_norm_matches_the_model_norm(dtype, n, tokens):
    norm = LlamaRMSNorm(n, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n) + 0.5)
    norm = norm.to(dtype)
    x, residual = _fused_columns(tokens, [n, n], dtype, seed=n)
    got, got_res = triton_fused.add_rms_norm(x[None], residual[None], norm.weight, norm.variance_epsilon)
    want_res = residual + x
    _equal_as_rounded(got_res[0], want_res)
    _within_rounding(got[0], norm(got_res[0]), ulps=2 if dtype is torch.bfloat16 else 4)
    alone, same = triton_fused.add_rms_norm(x[None], None, norm.weight, norm.variance_epsilon)
    assert same.data_ptr() == x.data_ptr()   # no residual: the input is the residual
    _within_rounding(alone[0], norm(x), ulps=2 if dtype is torch.bfloat16 else 4)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", ATTN_SHAPES)
def test_rope_write_kv_matches_the_model_rotary_and_cache_write(dtype, heads, kv_heads, head_dim):
    tokens, block_size, num_blocks = 11, 4, 8
    q, k, v = _fused_columns(tokens, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dtype, seed=heads)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim)).to(DEVICE)
    positions = torch.tensor([[3, 0, 17, 5, 9, 200, 1, 2, 64, 65, 31]], device=DEVICE)
    cos, sin = rotary(q.new_empty(1), position_ids=positions)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:tokens].to(DEVICE)
    sentinel = torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    k_cache, v_cache = sentinel.clone(), sentinel.clone()

    got_q = triton_fused.rope_write_kv(q, k, v, cos[0], sin[0], k_cache, v_cache, slots)

    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    want_k_cache, want_v_cache = sentinel.clone(), sentinel.clone()
    want_k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, want_k[0].transpose(0, 1))
    want_v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    want_q = want_q[0].transpose(0, 1)
    assert got_q.is_contiguous() and got_q.shape == q.shape
    _equal_as_rounded(got_q, want_q)
    _equal_as_rounded(k_cache, want_k_cache)
    assert torch.equal(v_cache, want_v_cache)   # copied (no arithmetic), and nothing but the step's slots written


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,tokens", [(1536, 5), (128, 64), (100, 3)])
def test_silu_mul_matches_the_model_activation(dtype, n, tokens):
    gate, up = _fused_columns(tokens, [n, n], dtype, seed=n)
    got = triton_fused.silu_mul(gate[None], up[None])
    _within_rounding(got[0], F.silu(gate) * up, ulps=1 if dtype is torch.bfloat16 else 8)


TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            max_position_embeddings=256, eos_token_id=3, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[5, 9, 17, 33, 2], list(range(10, 60)), [7], list(range(100, 121))]
MAX_NEW = [12, 6, 9, 11]


def _tiny(seed: int = 0):
    loaded = random_model(transformers.LlamaConfig(**TINY), seed=seed)
    if DEVICE == "cuda":
        loaded.model.to(DEVICE)
    return loaded


# Decode steps eager, and through the decode graphs' fixed-shape body: captured on a GPU, run
# without a graph under the interpreter (engine.cuda_graphs' UNCAPTURED mode).
GRAPHS = [GraphMode.EAGER, GraphMode.AUTO if DEVICE == "cuda" else GraphMode.UNCAPTURED]


@needs_triton
@pytest.mark.parametrize("graphs", GRAPHS)
def test_lean_forward_on_the_kernels_equals_hf_greedy(graphs, monkeypatch):
    """Chunked prefill mixed with decodes, every layer on the fused kernels (counted): greedy
    output equal to HF generate on the same float32 model, then the leak check."""
    loaded = _tiny()
    reference = copy.deepcopy(loaded.model)
    refs = [hf_greedy(reference, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    assert triton_fused.usable(torch.device(DEVICE), torch.float32)   # the start-up check, before counting
    calls = {"norm": 0, "rope": 0, "silu": 0}
    for name, key in (("add_rms_norm", "norm"), ("rope_write_kv", "rope"), ("silu_mul", "silu")):
        real = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name, lambda *a, _r=real, _k=key: calls.__setitem__(_k, calls[_k] + 1) or _r(*a))
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                                            device=DEVICE, dtype="float32", decode_graphs=graphs))
    got = run_staggered(engine, PROMPTS, MAX_NEW)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == refs
    layers = TINY["num_hidden_layers"]
    assert calls["rope"] > 0 and calls["rope"] % layers == 0
    assert calls["silu"] == calls["rope"] and calls["norm"] == calls["rope"] * 2 + calls["rope"] // layers
    assert_no_leaks(engine)


def _signatures(dtype: str) -> dict[str, tuple[dict, dict, dict]]:
    """Each kernel's argument types, constexprs and launch options as the wrappers launch them
    (SmolLM2's shapes: hidden 576, 9 + 3 heads of 64, MLP 1536)."""
    p = "*" + dtype
    return {
        "add_rms_norm": ({"X": p, "RES": p, "RES_OUT": p, "W": p, "OUT": p, "stride_x": "i32", "stride_res": "i32",
                          "stride_out": "i32", "n": "i32", "eps": "fp32", "HAS_RES": "constexpr", "BLOCK_N": "constexpr"},
                         {"HAS_RES": True, "BLOCK_N": 1024}, {"num_warps": 4}),
        "rope_write_kv": ({"Q": p, "K": p, "V": p, "COS": p, "SIN": p, "K_CACHE": p, "V_CACHE": p, "SLOTS": "*i64",
                           "Q_OUT": p, "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32",
                           "stride_vt": "i32", "stride_vh": "i32", "stride_ct": "i32", "heads": "i32", "kv_heads": "i32",
                           "ROWS_PAD": "constexpr", "KV_PAD": "constexpr", "HALF": "constexpr"},
                          {"ROWS_PAD": 16, "KV_PAD": 4, "HALF": 32}, {"num_warps": 2, "enable_fp_fusion": False}),
        "silu_mul": ({"G": p, "U": p, "OUT": p, "stride_g": "i32", "stride_u": "i32", "stride_out": "i32", "n": "i32",
                      "BLOCK": "constexpr"}, {"BLOCK": 1024}, {"num_warps": 4, "enable_fp_fusion": False}),
    }


@pytest.mark.skipif(triton_fused._kernels() is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton, compiling (its interpreter builds no binaries; no GPU needed)")
@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_for_the_gpu_without_one(arch):
    """Triton compiles each kernel down to a cubin for an H100 (sm_90) and an A100 (sm_80) on any
    machine (its bundled ptxas): what the interpreter cannot check (types, layouts, lowering).
    And the float32 rotary has no fused multiply-add: each product is rounded on its own, as
    torch's separate multiplies and add round them (the bit-for-bit claim)."""
    compiler = pytest.importorskip("triton.compiler")
    backend = pytest.importorskip("triton.backends.compiler")
    import triton

    kernels = dict(zip(("add_rms_norm", "rope_write_kv", "silu_mul"), triton_fused._kernels()))
    for dtype in ("bf16", "fp32"):
        for name, (signature, constexprs, options) in _signatures(dtype).items():
            source = compiler.ASTSource(fn=kernels[name], signature=signature, constexprs=constexprs)
            built = triton.compile(source, target=backend.GPUTarget("cuda", arch, 32), options=options)
            assert built.asm["cubin"], f"{name} {dtype}: no cubin"
            if name == "rope_write_kv" and dtype == "fp32":
                ptx = built.asm["ptx"]
                assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx   # products rounded one by one


class _BrokenKernel:
    """Stands in for a Triton kernel that fails to compile or launch on some GPU."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("PTX for this kernel could not be loaded")
        return launch


@pytest.fixture
def fresh_check():
    triton_fused._checked.cache_clear()
    yield
    triton_fused._checked.cache_clear()


def test_a_kernel_that_fails_turns_them_off_and_the_model_ops_serve(fresh_check, monkeypatch, caplog):
    """A kernel that cannot launch here fails the start-up check: a warning names the error, and
    the engine serves with the model's own ops, equal to HF greedy, leaking nothing."""
    monkeypatch.setattr(triton_fused, "_kernels", lambda: (_BrokenKernel(),) * 3)
    monkeypatch.setattr(triton_fused, "_runs_on", lambda x: True)   # as if on a GPU
    calls = []
    real = triton_fused.add_rms_norm
    monkeypatch.setattr(triton_fused, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    loaded = _tiny(seed=1)
    reference = copy.deepcopy(loaded.model)
    refs = [hf_greedy(reference, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    with caplog.at_level("WARNING", logger=triton_fused.__name__):
        engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                                                device=DEVICE, dtype="float32"))
        got = run_staggered(engine, PROMPTS, MAX_NEW)
    assert "PTX for this kernel could not be loaded" in caplog.text and "model's own ops" in caplog.text
    assert len(calls) == 1   # the check's own call, never the forward's
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == refs
    assert_no_leaks(engine)


def test_a_kernel_that_misreads_its_inputs_fails_the_check(fresh_check, monkeypatch):
    """A wrong result (here SiLU-and-multiply returning zeros) is caught like a failed launch; the
    reason names the kernel."""
    if triton_fused._kernels() is None or DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Without Triton the other kernels cannot run: stand in for all three with the model's ops.
        monkeypatch.setattr(triton_fused, "add_rms_norm", _model_add_rms_norm)
        monkeypatch.setattr(triton_fused, "rope_write_kv", _model_rope_write_kv)
    monkeypatch.setattr(triton_fused, "silu_mul", lambda gate, up: torch.zeros_like(gate))
    assert triton_fused._check(torch.device(DEVICE), torch.float32).startswith("silu_mul off by")
    assert not triton_fused.usable(torch.device(DEVICE), torch.float32)


def _model_add_rms_norm(x, residual, weight, eps):
    summed = x + residual
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.device)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(summed), summed


def _model_rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots):
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k_rot[0].transpose(0, 1))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    return q_rot[0].transpose(0, 1).contiguous()


@pytest.mark.slow
@pytest.mark.skipif(triton_fused._kernels() is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the real model on the kernels under Triton's CPU interpreter (the GPU runs test_cuda)")
def test_smollm2_on_the_kernels_equals_hf_greedy(monkeypatch):
    """The embedded SmolLM2-135M (real weights, float32, 30 layers, 9 heads on 3 KV heads of 64) on
    the fused kernels, under the interpreter: greedy output equal to HF generate on two prompts,
    every layer's rotary on the kernel (~11 s here)."""
    from engine.model_loader import load_model

    loaded = load_model(None)
    reference = copy.deepcopy(loaded.model)
    reference.config._attn_implementation = "sdpa"
    prompts = [loaded.tokenizer.encode("The capital of France is"), loaded.tokenizer.encode("def fibonacci(n):\n    ")]
    refs = [hf_greedy(reference, p, 12) for p in prompts]
    assert triton_fused.usable(torch.device("cpu"), torch.float32)
    calls = []
    real = triton_fused.rope_write_kv
    monkeypatch.setattr(triton_fused, "rope_write_kv", lambda *a: calls.append(1) or real(*a))
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, enable_prefix_caching=False))
    got = engine.generate([RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=12, ignore_eos=True))
                           for i, p in enumerate(prompts)])
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert len(calls) > 0 and len(calls) % loaded.model.config.num_hidden_layers == 0
    assert_no_leaks(engine)


def test_off_switch_keeps_the_model_ops(monkeypatch):
    """``PDSERVE_TRITON_FUSED=off``: never applies, whatever the device; CPU tensors outside the
    interpreter never take the kernels either."""
    hidden = torch.zeros(1, 2, 8)
    monkeypatch.setenv(triton_fused.ENV_VAR, "off")
    assert not triton_fused.enabled()
    assert not triton_fused.applies(hidden, torch.ones(8))
    monkeypatch.delenv(triton_fused.ENV_VAR)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_fused.applies(hidden, torch.ones(8))
    assert not triton_fused.applies(hidden.to(torch.bfloat16), torch.ones(8))
