"""Fused q/k/v and gate/up projections: the same values as the separate layers, one GEMM per group
inside the engine's forward only, never for a deep copy (the Hugging Face references), and the
engine's greedy output equals HF ``generate`` token for token with fusion on and off."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from engine import fused_linear, skinny_linear
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import random_model
from tests.conftest import assert_no_leaks, hf_greedy
from tests.test_engine_exact import run_staggered

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _qwen2():
    """Qwen2: biased q/k/v projections (the fused bias path)."""
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, eos_token_id=3,
    )
    return random_model(config, seed=2)


def _counting(monkeypatch) -> list[int]:
    """Output widths of every linear call that reaches skinny_linear.linear (fused or not)."""
    widths: list[int] = []
    plain = skinny_linear.linear

    def counted(x, weight, bias):
        widths.append(weight.shape[0])
        return plain(x, weight, bias)

    monkeypatch.setattr(skinny_linear, "linear", counted)
    return widths


@pytest.mark.parametrize("make", [lambda: random_model(seed=0), _qwen2], ids=["llama", "qwen2_bias"])
def test_install_fuses_in_place_with_the_same_values(make):
    model = make().model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    assert fused_linear.install(model) == 2 * layers
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert sum(p.numel() for p in model.parameters()) == params
    attn = model.model.layers[0].self_attn
    group = attn.q_proj._fused_group
    assert group is attn.k_proj._fused_group is attn.v_proj._fused_group and group.intact()
    # The members' weights are row slices of the group's tensor: no copy kept.
    assert attn.q_proj.weight.data_ptr() == group.weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() == group.weight[-attn.v_proj.out_features:].data_ptr()
    assert type(attn.o_proj) is torch.nn.Linear and type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear


@pytest.mark.parametrize("make", [lambda: random_model(seed=0), _qwen2], ids=["llama", "qwen2_bias"])
def test_one_gemm_per_group_inside_active_only(make, monkeypatch):
    loaded = make()
    reference = copy.deepcopy(loaded.model)
    model = loaded.model
    fused_linear.install(model)
    ids = torch.tensor([[5, 9, 17, 33, 2, 8, 40]])
    widths = _counting(monkeypatch)
    with torch.inference_mode():
        want = reference(input_ids=ids).logits
        assert not widths, "a model never installed stays on plain nn.Linear"
        outside = model(input_ids=ids).logits
        layers = model.config.num_hidden_layers
        assert len(widths) == 5 * layers, "outside active(): q, k, v, gate, up on their own (o, down are plain)"
        widths.clear()
        with fused_linear.active():
            inside = model(input_ids=ids).logits
        assert len(widths) == 2 * layers, "inside active(): one call per group"
        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        assert set(widths) == {(cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim,
                               2 * cfg.intermediate_size}
    torch.testing.assert_close(outside, want, rtol=0, atol=0)
    torch.testing.assert_close(inside, want, rtol=1e-5, atol=1e-5)
    assert not fused_linear.active.on, "active() restores the previous state"


def test_deep_copies_stay_plain(monkeypatch):
    model = random_model(seed=0).model
    fused_linear.install(model)
    copied = copy.deepcopy(model)   # as the test references are made
    assert not copied.model.layers[0].self_attn.q_proj._fused_group.intact()
    widths = _counting(monkeypatch)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode(), fused_linear.active():
        got = copied(input_ids=ids).logits
        want = model(input_ids=ids).logits
    assert len(widths) == (5 + 2) * model.config.num_hidden_layers, "the copy: 5 plain calls a layer; the original: 2"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "off"])
@pytest.mark.parametrize("make", [lambda: random_model(seed=0), _qwen2], ids=["llama", "qwen2_bias"])
def test_engine_greedy_matches_hf(make, fused, monkeypatch):
    if not fused:
        monkeypatch.setenv(fused_linear.ENV_VAR, "off")
    loaded = make()
    reference = copy.deepcopy(loaded.model)
    prompts = [[5, 9, 17, 33, 2], list(range(10, 60)), [7], list(range(100, 140))]
    refs = [hf_greedy(reference, p, 12) for p in prompts]
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16))
    assert engine.runner.fused is fused
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, fused_linear.FusedLinear) is fused
    got = run_staggered(engine, prompts, [12] * len(prompts))
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert_no_leaks(engine)
