"""engine.model_support: models the engine can serve are served exactly (greedy == HF generate,
across decoder families beyond Llama); models it cannot serve are refused when the engine is
built, naming why, instead of failing or mis-answering every request (StableLM's layers drop the
attention's metadata: every request used to end in an error; GPT-2's config has no KV-head
count: the engine used to crash on an AttributeError)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from engine import attention
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import UnsupportedModelError
from engine.model_loader import random_model
from tests.conftest import assert_no_leaks, hf_greedy
from tests.test_engine_exact import run_staggered

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=256, eos_token_id=3)
ENGINE = EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)

SERVED = {
    "gemma": lambda: transformers.GemmaConfig(**SMALL, num_key_value_heads=2, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**SMALL, num_key_value_heads=2, pad_token_id=0),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16),
    "olmo": lambda: transformers.OlmoConfig(**SMALL, num_key_value_heads=2, pad_token_id=0),
    "granite": lambda: transformers.GraniteConfig(**SMALL, num_key_value_heads=2),
}

REFUSED = {
    "stablelm": (lambda: transformers.StableLmConfig(**SMALL, num_key_value_heads=2), "forward fails"),
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256),
             "no num_key_value_heads"),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=128,
                                                    max_position_embeddings=256), "no num_key_value_heads"),
    "softcapped": (lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2, attn_logit_softcapping=30.0),
                   "soft-cap"),
    "alibi": (lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2, alibi=True), "ALiBi"),
}


@pytest.mark.parametrize("name", SERVED)
def test_other_decoder_families_are_served_exactly(name):
    loaded = random_model(SERVED[name](), seed=2)
    reference = copy.deepcopy(loaded.model)
    prompts = [[5, 9, 17, 33, 2], list(range(10, 60)), [7]]
    refs = [hf_greedy(reference, p, 12) for p in prompts]
    engine = LLMEngine(loaded, ENGINE)
    got = run_staggered(engine, prompts, [12] * len(prompts))
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert_no_leaks(engine)


@pytest.mark.parametrize("name", REFUSED)
def test_models_the_engine_cannot_serve_are_refused_with_the_reason(name):
    make, reason = REFUSED[name]
    loaded = random_model(make(), seed=2)
    with pytest.raises(UnsupportedModelError, match=reason):
        LLMEngine(loaded, ENGINE)


def test_the_probe_refuses_an_attention_that_answers_differently(monkeypatch):
    """An attention that runs but does not compute what the model's own does (here: outputs
    scaled by 1%) is caught by comparing the probe prompt's logits, not only by a crash."""
    exact = attention.paged_attention

    def skewed(*args, **kwargs):
        out, weights = exact(*args, **kwargs)
        return out * 1.01, weights

    monkeypatch.setattr(attention, "paged_attention", skewed)
    with pytest.raises(UnsupportedModelError, match="does not reproduce"):
        LLMEngine(random_model(seed=0), ENGINE)
    monkeypatch.undo()
    attention.register()   # the registry holds the exact attention again for later tests
    assert attention.registered() is attention.paged_attention


def test_the_probe_leaves_the_engine_untouched(tiny_model):
    """It runs on a cache of its own: the engine's pool is still all zeros and all free."""
    engine = LLMEngine(tiny_model, ENGINE)
    assert torch.count_nonzero(engine.cache) == 0
    assert_no_leaks(engine)
