"""engine.sliding_window: a model whose attention window binds is served only up to its window,
where the engine's full attention equals the model's windowed attention; past it requests are
refused (InvalidRequestError -> INVALID_ARGUMENT) instead of answered with the wrong tokens."""

from __future__ import annotations

import copy

import pytest
import transformers

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.model_loader import random_model
from engine.sliding_window import binding_window
from engine.types import RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy
from tests.test_engine_exact import run_staggered

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=3)
WINDOW = 12


def _mistral(window):
    return random_model(transformers.MistralConfig(**SMALL, sliding_window=window), seed=21)


def _qwen2(use_window: bool):
    config = transformers.Qwen2Config(**SMALL, use_sliding_window=use_window, sliding_window=WINDOW,
                                      max_window_layers=1)
    return random_model(config, seed=22)


@pytest.mark.parametrize("make, capped", [
    (lambda: _mistral(WINDOW), True),
    (lambda: _mistral(None), False),
    (lambda: _mistral(4096), False),       # Mistral's default window over a 256-position model never binds
    (lambda: _qwen2(True), True),           # layers past max_window_layers attend within the window
    (lambda: _qwen2(False), False),
])
def test_a_binding_window_caps_the_served_context(make, capped):
    loaded = make()
    assert (binding_window(loaded.config) is not None) is capped
    assert loaded.max_model_len == (WINDOW if capped else SMALL["max_position_embeddings"])


def test_the_window_changes_tokens_past_it():
    """Why the cap: HF's windowed model and the same weights with full attention part ways past the window."""
    windowed = _mistral(WINDOW).model
    full = copy.deepcopy(windowed)
    full.config.sliding_window = None
    prompt = list(range(40, 60))   # 20 tokens: past the window of 12
    assert hf_greedy(windowed, prompt, 8) != hf_greedy(full, prompt, 8)


def test_within_the_window_the_engine_equals_hf_generate():
    loaded = _mistral(WINDOW)
    reference = copy.deepcopy(loaded.model)
    prompts, outputs = [[5, 9, 17, 33, 2], list(range(60, 67)), [7]], [7, 5, 11]   # each ends at <= 12 tokens
    refs = [hf_greedy(reference, p, n) for p, n in zip(prompts, outputs)]
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=8))
    got = run_staggered(engine, prompts, outputs)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    assert_no_leaks(engine)


@pytest.mark.parametrize("prompt_len, max_tokens, field", [(12, 1, "prompt"), (8, 5, "max_tokens")])
def test_past_the_window_the_request_is_refused(prompt_len, max_tokens, field):
    engine = LLMEngine(_mistral(WINDOW), EngineConfig(num_kv_blocks=32, block_size=4))
    spec = RequestSpec("past", tuple(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    with pytest.raises(InvalidRequestError, match=field):
        engine.add_request(spec)
    assert_no_leaks(engine)
