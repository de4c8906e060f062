"""Greedy outputs of the engine equal Hugging Face ``generate`` token for token (float32)."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.types import RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy

NUM_PROMPTS = 10
MAX_NEW = 24


@pytest.fixture(scope="module")
def workload(hf_reference):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 90))] for _ in range(NUM_PROMPTS)]
    outputs = [rng.randint(1, MAX_NEW) for _ in prompts]
    refs = [hf_greedy(hf_reference, p, n) for p, n in zip(prompts, outputs)]
    return prompts, outputs, refs


def run_staggered(engine: LLMEngine, prompts, outputs, extra_specs=()) -> dict[str, list[int]]:
    """Requests arrive at different steps: one new request every other step."""
    specs = [
        RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(zip(prompts, outputs))
    ] + list(extra_specs)
    got: dict[str, list[int]] = {s.req_id: [] for s in specs}
    step = 0
    while specs or engine.has_work():
        if specs and step % 2 == 0:
            engine.add_request(specs.pop(0))
        for d in engine.step().deltas:
            got[d.req_id].extend(d.token_ids)
        step += 1
    return got


CONFIGS = {
    "default": EngineConfig(num_kv_blocks=256),
    "chunked": EngineConfig(num_kv_blocks=256, max_num_batched_tokens=7, block_size=4),
    "preempt": EngineConfig(num_kv_blocks=14, block_size=8, max_num_batched_tokens=64),
    "tiny_groups": EngineConfig(num_kv_blocks=256, decode_attention_group=3, block_size=2),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_matches_hf(tiny_model, workload, name):
    prompts, outputs, refs = workload
    engine = LLMEngine(tiny_model, CONFIGS[name])
    got = run_staggered(engine, prompts, outputs)
    for i, ref in enumerate(refs):
        assert got[f"r{i}"] == ref, f"request r{i} differs from HF generate under config {name}"
    if name == "preempt":
        assert engine.scheduler.num_preemptions > 0, "the tiny pool must force preemption"
    assert_no_leaks(engine)


def test_greedy_unaffected_by_sampled_neighbours(tiny_model, workload):
    prompts, outputs, refs = workload
    noisy = [
        RequestSpec(f"s{i}", (5, 6, 7, i + 10), SamplingParams(max_tokens=20, temperature=1.3, top_p=0.8, top_k=50, seed=i))
        for i in range(4)
    ]
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=32))
    got = run_staggered(engine, prompts, outputs, noisy)
    for i, ref in enumerate(refs):
        assert got[f"r{i}"] == ref
    assert all(len(got[s.req_id]) == 20 for s in noisy)
    assert_no_leaks(engine)


def test_large_decode_batch_matches_hf(tiny_model, hf_reference, monkeypatch):
    """40 requests decoding together: past the skinny kernel's limit and within the panel
    kernel's on both SIMD builds, so every decode step's linears run on the panel kernel
    (counted), not MKL."""
    from engine import lean_cpu, skinny_linear

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 12))] for _ in range(40)]
    refs = [hf_greedy(hf_reference, p, 8) for p in prompts]
    rows: list[int] = []   # one entry per linear call on the panel kernel: its row count
    real = skinny_linear.panel_linear
    spy = lambda x, w: rows.append(x.shape[0]) or real(x, w)   # noqa: E731
    monkeypatch.setattr(skinny_linear, "panel_linear", spy)
    # The C++ layer stack (decode-only steps, where it is built) runs the panel kernel itself, named
    # by its code: the spy is the panel kernel there too, and each such call is its layers' linears.
    monkeypatch.setitem(lean_cpu._KERNEL_CODES, spy, lean_cpu._KERNEL_CODES[real])
    native = lean_cpu.NativeLayers.__call__

    def native_spy(self, hidden, cos, sin, kernel, metadata):
        if kernel is spy:
            rows.extend([hidden.shape[1]] * 4 * len(self.scales))   # q/k/v, o, gate/up, down per layer
        return native(self, hidden, cos, sin, kernel, metadata)
    monkeypatch.setattr(lean_cpu.NativeLayers, "__call__", native_spy)
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, max_num_seqs=64))
    specs = [RequestSpec(f"b{i}", tuple(p), SamplingParams(max_tokens=8, ignore_eos=True)) for i, p in enumerate(prompts)]
    got = engine.generate(specs)
    assert [got[f"b{i}"] for i in range(len(prompts))] == refs
    if engine.runner.skinny:
        assert skinny_linear.row_limits().skinny < 40 <= skinny_linear.row_limits().panel
        # 7 decode steps at 40, each: q/k/v (one fused call), o, gate/up (one), down per layer, and the LM head
        per_step = 4 * tiny_model.model.config.num_hidden_layers + 1
        assert rows.count(40) >= 7 * per_step, "every linear of every decode step at 40 on the panel kernel"
    assert_no_leaks(engine)


@pytest.mark.parametrize("config_name", ["Qwen2Config", "MistralConfig"])
def test_other_llama_family_models_match_hf(config_name):
    """Qwen2 (biased q/k/v projections) and Mistral run through the same paged attention."""
    import copy

    import transformers

    from engine.model_loader import random_model
    from tests.conftest import hf_greedy

    config = getattr(transformers, config_name)(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, eos_token_id=3,
    )
    loaded = random_model(config, seed=2)
    reference = copy.deepcopy(loaded.model)
    prompts = [[5, 9, 17, 33, 2], list(range(10, 60)), [7]]
    refs = [hf_greedy(reference, p, 12) for p in prompts]
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16))
    got = run_staggered(engine, prompts, [12] * len(prompts))
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert_no_leaks(engine)
