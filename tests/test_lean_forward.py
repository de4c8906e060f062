"""engine.lean_forward: logits and KV writes bit-identical (torch.equal) to the model's own call on
every forward of real engine runs (mixed prefill + decode packed batches, chunked prefill, the
decode graphs' fixed-shape body), for Llama (GQA, MHA, tied and untied embeddings), Qwen2 (biased
q/k/v) and Mistral, with the CPU installs and kernels on and off (head dims the fused rotary + KV
write takes, and one it does not); the refusals fall back to the model's call."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import transformers

from engine import lean_forward
from engine.config import EngineConfig, GraphMode
from engine.engine import LLMEngine
from engine.model_loader import random_model
from engine.types import RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy
from tests.test_engine_exact import run_staggered

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
             max_position_embeddings=256, eos_token_id=3)
GQA = dict(num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[5, 9, 17, 33, 2], list(range(10, 60)), [7], list(range(100, 121))]
MAX_NEW = [12, 6, 9, 11]

MODELS = {
    "llama_gqa_untied": lambda: random_model(seed=0),
    "llama_mha_tied": lambda: random_model(transformers.LlamaConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True), seed=1),
    "llama_gqa_bias": lambda: random_model(transformers.LlamaConfig(
        **SMALL, num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True), seed=3),
    "qwen2": lambda: random_model(transformers.Qwen2Config(**SMALL, **GQA), seed=2),
    "mistral": lambda: random_model(transformers.MistralConfig(**SMALL, **GQA), seed=2),
    # head dims 32 and 64: the fused rotary + KV write (paged_kernel.rope_write_kv) takes them
    "llama_hd32": lambda: random_model(transformers.LlamaConfig(
        **SMALL, num_attention_heads=2, num_key_value_heads=1), seed=5),
    "qwen2_hd64": lambda: random_model(transformers.Qwen2Config(
        **{**SMALL, "hidden_size": 128}, num_attention_heads=2, num_key_value_heads=1), seed=6),
}

CONFIGS = {
    "mixed": EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16),   # chunked prefill + decodes
    "graphs": EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64,
                           decode_graphs=GraphMode.UNCAPTURED),   # decode steps through the graphs' body
}


class _Both:
    """Stands in for the runner's lean forward: every call runs the model's own call first, then
    the lean forward on the same inputs from the same KV cache, and asserts both logits and both
    caches are equal bit for bit."""

    def __init__(self, runner) -> None:
        self.runner, self.lean = runner, runner.lean
        self.kinds: Counter[str] = Counter()

    def __call__(self, input_ids, position_ids, logits_indices, metadata):
        cache = metadata.kv_cache
        before = cache.clone()
        want = self.runner.model_call(input_ids, position_ids, logits_indices, metadata)
        want_cache = cache.clone()
        cache.copy_(before)
        got = self.lean(input_ids, position_ids, logits_indices, metadata)
        assert torch.equal(got, want), "lean logits differ from the model's call"
        assert torch.equal(cache, want_cache), "lean KV writes differ from the model's call"
        kind = ("prefill" if metadata.prefills else "") + ("decode" if metadata.decode_groups else "")
        self.kinds[kind] += 1
        return got


@pytest.mark.parametrize("installs", ["on", "off"])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", MODELS)
def test_bit_identical_to_model_call(name, config, installs, monkeypatch):
    if installs == "off":
        # Every CPU install off, decode attention on torch (the path a GPU runs).
        for var, value in (("PDSERVE_FUSED_LINEAR", "off"), ("PDSERVE_LINEAR", "torch"), ("PDSERVE_FAST_NORM", "off"),
                           ("PDSERVE_ATTENTION", "torch")):
            monkeypatch.setenv(var, value)
    loaded = MODELS[name]()
    reference = copy.deepcopy(loaded.model)
    refs = [hf_greedy(reference, p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    engine = LLMEngine(loaded, CONFIGS[config])
    assert engine.runner.lean is not None
    both = engine.runner.lean = _Both(engine.runner)
    got = run_staggered(engine, PROMPTS, MAX_NEW)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == refs
    if config == "mixed":
        assert both.kinds["prefilldecode"] > 0 and both.kinds["decode"] > 0, both.kinds
    else:   # decode steps went through the graphs' fixed-shape body, which calls the same forward
        assert engine.runner.graphs.num_replays > 0 and both.kinds["decode"] > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("name,fused", [("llama_hd32", True), ("qwen2_hd64", True), ("llama_gqa_bias", False)])
def test_fused_rope_runs_where_it_applies(name, fused, monkeypatch):
    """float32 CPU with a head_dim the kernel takes (a multiple of twice the SIMD width: 32 and 64 on
    AVX2 and AVX-512 alike): every layer's rotary and KV write go through paged_kernel.rope_write_kv;
    head_dim 8 keeps the model's ops; PDSERVE_ATTENTION=torch switches it off."""
    from engine import paged_kernel

    if not paged_kernel.available():
        pytest.skip(f"CPU kernels unavailable here: {paged_kernel.unavailable_reason()}")
    calls = []
    real = paged_kernel.rope_write_kv
    monkeypatch.setattr(paged_kernel, "rope_write_kv", lambda *a: calls.append(1) or real(*a))
    loaded = MODELS[name]()
    engine = LLMEngine(loaded, CONFIGS["mixed"])
    layers = loaded.model.config.num_hidden_layers
    head_dim = loaded.model.config.hidden_size // loaded.model.config.num_attention_heads
    expected = paged_kernel.simd_width() > 0 and fused
    assert paged_kernel.rope_supports(head_dim) == expected
    engine.generate([RequestSpec("r", tuple(PROMPTS[1]), SamplingParams(max_tokens=3, ignore_eos=True))])
    assert (len(calls) > 0) == expected and len(calls) % layers == 0
    monkeypatch.setenv(paged_kernel.ENV_VAR, "torch")
    calls.clear()
    engine.generate([RequestSpec("s", tuple(PROMPTS[1]), SamplingParams(max_tokens=3, ignore_eos=True))])
    assert not calls
    assert_no_leaks(engine)


def test_off_switch(tiny_model, monkeypatch):
    monkeypatch.setenv(lean_forward.ENV_VAR, "off")
    assert lean_forward.build(tiny_model.model) is None
    assert LLMEngine(tiny_model, EngineConfig(num_kv_blocks=16)).runner.lean is None


def _qwen3():
    return random_model(transformers.Qwen3Config(**SMALL, **GQA), seed=4)


def _subclass():
    loaded = random_model(seed=5)
    loaded.model.__class__ = type("MyLlama", (transformers.LlamaForCausalLM,), {})
    return loaded


def _mistral_window():
    return random_model(transformers.MistralConfig(**SMALL, **GQA, sliding_window=64), seed=6)


def _qwen2_window():
    config = transformers.Qwen2Config(**SMALL, **GQA, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    return random_model(config, seed=7)


def _hooked():
    loaded = random_model(seed=8)
    loaded.model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: None)
    return loaded


def _instance_forward():
    """accelerate's device hooks replace a module's forward on the instance."""
    loaded = random_model(seed=9)
    attn = loaded.model.model.layers[1].self_attn
    attn.forward = attn.forward   # a bound method kept in the instance's dict, as accelerate leaves it
    return loaded


REFUSED = {
    "qwen3_qk_norm": (_qwen3, lean_forward.Refusal.ARCHITECTURE),
    "subclass": (_subclass, lean_forward.Refusal.ARCHITECTURE),
    "mistral_window": (_mistral_window, lean_forward.Refusal.SLIDING_WINDOW),
    "qwen2_window": (_qwen2_window, lean_forward.Refusal.SLIDING_WINDOW),
    "hooks": (_hooked, lean_forward.Refusal.HOOKS),
    "instance_forward": (_instance_forward, lean_forward.Refusal.HOOKS),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_models_fall_back_to_the_model_call(name):
    """Refused, the engine runs the model's own call; outputs still equal HF generate (prompts
    and outputs shorter than every window, where the windowed reference attends to everything)."""
    make, reason = REFUSED[name]
    loaded = make()
    assert lean_forward.refusal(loaded.model) is reason
    reference = copy.deepcopy(loaded.model)
    prompts, outputs = PROMPTS[:1] + PROMPTS[2:], MAX_NEW[:1] + MAX_NEW[2:]
    refs = [hf_greedy(reference, p, n) for p, n in zip(prompts, outputs)]
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16))
    assert engine.runner.lean is None
    got = run_staggered(engine, prompts, outputs)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert_no_leaks(engine)


def test_window_covering_the_context_is_accepted():
    """Mistral's default window (4096) over a 256-position model never binds."""
    loaded = MODELS["mistral"]()
    assert loaded.config.sliding_window >= loaded.config.max_position_embeddings
    assert lean_forward.refusal(loaded.model) is None
