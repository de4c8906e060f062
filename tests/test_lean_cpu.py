"""engine.lean_cpu: the lean forward's straight-line CPU layers give the general loop's logits and KV
writes bit for bit (and so the model's call: tests/test_lean_forward.py) on every forward of real
engine runs whose steps span the linear kernels' row ranges (skinny, panel, torch's linear past
them), for Llama (with and without biases everywhere) and Qwen2's biased q/k/v; decode-only steps run
as one C++ call (engine/csrc/decode_layers.cpp; biased projections on torch's linear there too), batches of 1
to past the skinny kernel's rows; they run wherever their conditions hold and nowhere else (switches
off, bfloat16, a head dim the rotary kernel does not take, fused projections off)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from engine import lean_cpu, paged_kernel
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import random_model
from engine.types import RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy, require_kernel
from tests.test_engine_exact import run_staggered

SMALL = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, intermediate_size=192,
             max_position_embeddings=1024, eos_token_id=3)
MODELS = {
    "llama_hd64": lambda: random_model(transformers.LlamaConfig(**SMALL, num_attention_heads=2,
                                                                num_key_value_heads=1), seed=7),
    "llama_hd32_all_biases": lambda: random_model(transformers.LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True), seed=9),
    "qwen2_hd32_bias": lambda: random_model(transformers.Qwen2Config(**SMALL, num_attention_heads=4,
                                                                     num_key_value_heads=2), seed=8),
}


@pytest.fixture(autouse=True)
def kernels():
    require_kernel(paged_kernel.available() and paged_kernel.rope_supports(64) and paged_kernel.rope_supports(32),
                   f"CPU kernels unavailable here: {paged_kernel.unavailable_reason() or 'no SIMD build'}")


class _Compare:
    """Stands in for the runner's lean forward: each call runs the general loop (straight-line
    layers off), then the lean forward as it is, on the same inputs from the same KV cache, and
    asserts equal logits and caches; counts the forwards the straight-line layers ran."""

    def __init__(self, runner) -> None:
        self.lean = runner.lean
        self.cpu_layers = self.lean.cpu_layers
        self.ran = 0
        self.rows: set[int] = set()

    def __call__(self, input_ids, position_ids, logits_indices, metadata):
        cache = metadata.kv_cache
        before = cache.clone()
        self.lean.cpu_layers = None
        want = self.lean(input_ids, position_ids, logits_indices, metadata)
        want_cache = cache.clone()
        cache.copy_(before)
        self.lean.cpu_layers = _Counting(self)
        got = self.lean(input_ids, position_ids, logits_indices, metadata)
        assert torch.equal(got, want), "straight-line layers' logits differ from the general loop's"
        assert torch.equal(cache, want_cache), "straight-line layers' KV writes differ from the general loop's"
        self.rows.add(input_ids.shape[1])
        return got


class _Counting:
    def __init__(self, compare: _Compare) -> None:
        self.compare = compare

    def applies(self, *args) -> bool:
        return self.compare.cpu_layers.applies(*args)

    def __call__(self, *args):
        self.compare.ran += 1
        return self.compare.cpu_layers(*args)


@pytest.fixture
def native_calls(monkeypatch):
    """The decode-only steps that ran as one C++ call (their batch sizes)."""
    calls: list[int] = []
    real = lean_cpu.NativeLayers.__call__
    monkeypatch.setattr(lean_cpu.NativeLayers, "__call__",
                        lambda self, hidden, *a: calls.append(hidden.shape[1]) or real(self, hidden, *a))
    return calls


@pytest.mark.parametrize("name", MODELS)
def test_bit_identical_to_the_general_loop_across_row_ranges(name, native_calls):
    """Prompts long enough for steps past the panel kernel's rows (torch's linear), chunks and mixed
    steps within it, decode steps of 1-6 rows (skinny kernel); greedy output == HF generate."""
    prompts = [list(range(5, 305)), list(range(20, 60)), [9, 8, 7], list(range(100, 190)), [4] * 30, [11, 12]]
    max_new = [5, 9, 7, 6, 8, 10]
    loaded = MODELS[name]()
    refs = [hf_greedy(copy.deepcopy(loaded.model), p, n) for p, n in zip(prompts, max_new)]
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=256, block_size=8, max_num_batched_tokens=512))
    assert engine.runner.lean.cpu_layers is not None
    assert engine.runner.lean.cpu_layers.native is not None
    compare = engine.runner.lean = _Compare(engine.runner)
    got = run_staggered(engine, prompts, max_new)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert compare.ran > 0 and max(compare.rows) > 256 and min(compare.rows) == 1, compare.rows
    assert native_calls and min(native_calls) == 1
    assert_no_leaks(engine)


def test_decode_batches_past_the_skinny_kernel_in_one_call(native_calls):
    """Decode-only batches of 40 (the panel kernel's rows) and fewer, as one C++ call each, equal to
    the general loop's; greedy output == HF generate."""
    prompts = [list(range(7 + i, 20 + 2 * i)) for i in range(40)]
    max_new = [4 + i % 5 for i in range(40)]
    loaded = MODELS["llama_hd64"]()
    refs = [hf_greedy(copy.deepcopy(loaded.model), p, n) for p, n in zip(prompts, max_new)]
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=512, block_size=8, max_num_seqs=64))
    engine.runner.lean = _Compare(engine.runner)
    out = engine.generate([RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True))
                           for i, (p, n) in enumerate(zip(prompts, max_new))])
    assert [list(out[f"r{i}"]) for i in range(40)] == refs
    assert max(native_calls) == 40 and min(native_calls) < 24, native_calls
    assert_no_leaks(engine)


def _forwards_on_cpu_layers(engine: LLMEngine) -> int:
    calls = []
    layers = engine.runner.lean.cpu_layers
    if layers is None:
        return 0
    real = type(layers).__call__
    layers.__class__ = type("Spied", (type(layers),), {"__call__": lambda self, *a: calls.append(1) or real(self, *a)})
    engine.generate([RequestSpec("r", tuple(range(5, 40)), SamplingParams(max_tokens=4, ignore_eos=True))])
    assert_no_leaks(engine)
    return len(calls)


def test_runs_in_the_engine_by_default():
    assert _forwards_on_cpu_layers(LLMEngine(MODELS["llama_hd64"](), EngineConfig(num_kv_blocks=64))) == 4


@pytest.mark.parametrize("switch", [("PDSERVE_FAST_NORM", "off"), ("PDSERVE_FUSED_LINEAR", "off"),
                                    ("PDSERVE_ATTENTION", "torch")])
def test_not_where_the_general_loop_runs_other_ops(switch, monkeypatch):
    monkeypatch.setenv(*switch)
    assert _forwards_on_cpu_layers(LLMEngine(MODELS["llama_hd64"](), EngineConfig(num_kv_blocks=64))) == 0


def test_linear_on_torch_still_equal(monkeypatch):
    """PDSERVE_LINEAR=torch: the straight-line layers run with torch's linear, as the general loop does."""
    monkeypatch.setenv("PDSERVE_LINEAR", "torch")
    loaded = MODELS["llama_hd64"]()
    ref = hf_greedy(copy.deepcopy(loaded.model), list(range(5, 40)), 6)
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    engine.runner.lean = _Compare(engine.runner)
    out = engine.generate([RequestSpec("r", tuple(range(5, 40)), SamplingParams(max_tokens=6, ignore_eos=True))])
    assert list(out["r"]) == ref and engine.runner.lean.ran == 6
    assert_no_leaks(engine)


def test_not_for_bfloat16_or_an_unsupported_head_dim():
    bf16 = MODELS["llama_hd64"]()
    bf16.model.to(torch.bfloat16)
    engine = LLMEngine(bf16, EngineConfig(num_kv_blocks=64, dtype="bfloat16"))
    assert engine.cache.dtype == torch.bfloat16
    assert _forwards_on_cpu_layers(engine) == 0
    # head_dim 12: a multiple of neither AVX2's 2 x 8 nor AVX-512's 2 x 16 (16 was, on AVX2: on this
    # VM, an AMD EPYC with AVX2 alone, the "unsupported" head_dim 16 ran the C++ rotary kernel).
    assert not paged_kernel.rope_supports(12)
    hd12 = random_model(transformers.LlamaConfig(**{**SMALL, "hidden_size": 96}, num_attention_heads=8,
                                                 num_key_value_heads=2), seed=7)
    assert _forwards_on_cpu_layers(LLMEngine(hd12, EngineConfig(num_kv_blocks=64))) == 0


def test_decode_batch_past_the_panel_kernel_on_torchs_linear(native_calls):
    """A decode-only step of 300 rows (past the panel kernel's 256: torch's linear inside the C++
    call) equals the general loop's."""
    engine = LLMEngine(MODELS["llama_hd64"](), EngineConfig(num_kv_blocks=2048, block_size=8, max_num_seqs=320,
                                                           max_num_batched_tokens=4096))
    engine.runner.lean = _Compare(engine.runner)
    engine.generate([RequestSpec(f"r{i}", tuple(range(7 + i % 50, 12 + i % 50)),
                                 SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(300)])
    assert 300 in native_calls
    assert_no_leaks(engine)
