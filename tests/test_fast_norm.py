"""F.rms_norm in place of the model's RMSNorm: the same bits in float32 on CPU, only inside the
engine's forward, never for a Hugging Face reference sharing (or copying) the model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine import fast_norm
from engine.config import EngineConfig
from engine.engine import LLMEngine


@pytest.mark.parametrize("rows", [1, 7, 64, 512, 2048])
@pytest.mark.parametrize("threads", [1, 2])
def test_same_bits_as_the_model_norm(rows, threads):
    """SmolLM2's hidden size, decode batches to a 2048-token prefill step, a few scales."""
    g = torch.Generator().manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    fast = copy.deepcopy(norm)
    assert fast_norm.install(fast) == 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode(), fast_norm.active():
            for scale in (1e-3, 1.0, 30.0):
                x = torch.randn(1, rows, 576, generator=g) * scale
                assert torch.equal(fast(x), norm(x))
    finally:
        torch.set_num_threads(before)


def test_only_inside_active_and_copies_stay_plain(tiny_model, monkeypatch):
    # A fresh model of the tiny config: engines built by earlier tests installed into the shared
    # one (and set its config's attention to the engine's paged kernel).
    config = copy.deepcopy(tiny_model.model.config)
    config._attn_implementation = "sdpa"
    model = type(tiny_model.model)(config).eval()
    count = fast_norm.install(model)
    assert count == 2 * model.config.num_hidden_layers + 1   # two per layer, plus the final norm
    assert fast_norm.install(model) == 0                      # installing twice changes nothing
    norm = model.model.norm
    assert isinstance(norm, LlamaRMSNorm) and type(norm) is not LlamaRMSNorm
    calls = []
    real = torch.nn.functional.rms_norm
    monkeypatch.setattr(torch.nn.functional, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.inference_mode():
        plain = norm(x)
        reference = copy.deepcopy(model)      # as test references are made: a deep copy, outside active()
        reference(input_ids=torch.tensor([[5, 6, 7]]))
        assert not calls
        with fast_norm.active():
            fused = norm(x)
    assert calls == [1]
    assert torch.equal(fused, plain)


def test_engine_uses_it_unless_switched_off(tiny_model, monkeypatch):
    assert LLMEngine(copy.deepcopy(tiny_model), EngineConfig(num_kv_blocks=8)).runner.fast_norm
    monkeypatch.setenv(fast_norm.ENV_VAR, "off")
    assert not LLMEngine(copy.deepcopy(tiny_model), EngineConfig(num_kv_blocks=8)).runner.fast_norm
