"""Sampling edge cases: tiny temperatures are greedy, sampling never yields NaN/inf or an
empty distribution, and one request whose sampling or forward fails fails alone: the rest of
its batch finishes equal to HF greedy. Engine tests end with a leak check."""

from __future__ import annotations

import math

import pytest
import torch

from engine import faults
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import Request
from engine.sampler import RowFailure, sample
from engine.types import GREEDY_TEMPERATURE, FinishReason, RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy

VOCAB = 50


def _request(req_id: str, **sampling) -> Request:
    return Request(RequestSpec(req_id, (1, 2), SamplingParams(**sampling)))


def test_greedy_below_vllm_threshold():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-30).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


SAMPLING_CASES = [
    dict(temperature=GREEDY_TEMPERATURE),             # the smallest sampled temperature
    dict(temperature=1e30),                           # flat
    dict(temperature=1.7e308),                        # largest double: still finite
    dict(temperature=0.7, top_p=1e-12),               # top_p leaving nothing keeps the argmax
    dict(temperature=0.7, top_k=1),
    dict(temperature=0.7, top_k=VOCAB * 10, top_p=0.5),
    dict(temperature=1e-30, top_k=3),                 # greedy
    dict(temperature=0.7, min_p=1.0),                 # min_p keeps only the likeliest
    dict(temperature=1e30, min_p=0.5, top_k=4, top_p=0.3, repetition_penalty=1e-30, frequency_penalty=2.0,
         presence_penalty=-2.0, logit_bias=((3, 100.0), (7, -100.0))),   # everything at its edge
]


@pytest.mark.parametrize("params", SAMPLING_CASES, ids=[str(p) for p in SAMPLING_CASES])
@pytest.mark.parametrize("kind", ["normal", "huge", "with_inf", "with_nan"])
def test_sampling_never_returns_nan_or_an_impossible_token(params, kind):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * (1e30 if kind == "huge" else 3.0)
    if kind == "with_inf":
        logits[:, 7] = math.inf
        logits[:, 8] = -math.inf
    if kind == "with_nan":
        logits[:, 3] = math.nan
    requests = [_request(f"r{i}", logprobs=True, top_logprobs=i, seed=i, **params) for i in range(4)]
    out = sample(logits, requests, {r.req_id: i for i, r in enumerate(requests)})
    for i, ((token, logprob, top), row) in enumerate(zip(out, logits)):
        assert 0 <= token < VOCAB and logprob is not None and not math.isnan(logprob)
        assert (top is None) if i == 0 else (len(top) == i and not any(math.isnan(v) for _, v in top))
        if (params.get("top_p", 1.0) < 1e-6 or params.get("top_k") == 1 or params["temperature"] < GREEDY_TEMPERATURE
                or params.get("min_p") == 1.0) and kind != "huge":   # huge: several rows share the top value
            finite = torch.nan_to_num(row, nan=-math.inf)
            assert token == int(finite.argmax())


def test_min_p_never_samples_a_token_below_its_share_of_the_likeliest():
    """vLLM's min_p, after the temperature: a token less likely than ``min_p`` x the likeliest
    is never drawn, whatever the seed; those above it are (it filters, it does not sharpen)."""
    logits = torch.tensor([[4.0, 3.6, 3.0, 1.0, 0.5] + [-2.0] * (VOCAB - 5)])
    probs = torch.softmax(logits[0] / 0.8, dim=-1)
    allowed = {int(t) for t in torch.nonzero(probs >= 0.25 * probs.max())}
    assert allowed == {0, 1, 2}
    drawn = set()
    for seed in range(200):
        request = _request("m", temperature=0.8, min_p=0.25, seed=seed)
        (token, _, _), = sample(logits, [request], {"m": seed})
        drawn.add(token)
    assert drawn == allowed


@pytest.mark.parametrize("temperature", [0.5, 1e30, 1.7e308])
def test_min_tokens_holds_its_tokens_back_at_any_temperature(temperature):
    """A held token is -inf: no temperature, however flat, gives it a chance (the flattest turn
    every other logit into the same value)."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = logits[0, 9] = 5.0   # EOS and a stop token id, the likeliest
    drawn = set()
    for seed in range(100):
        request = _request("h", temperature=temperature, seed=seed, max_tokens=8, min_tokens=3, stop_token_ids=(9,))
        (token, _, _), = sample(logits, [request], {"h": seed}, frozenset({2}))
        drawn.add(token)
    assert not drawn & {2, 9} and len(drawn) > 1


@pytest.mark.parametrize("min_p", [-0.1, 1.01, math.nan, math.inf])
def test_min_p_outside_0_1_is_named(min_p):
    from engine.errors import InvalidRequestError
    from engine.validation import validate_sampling

    with pytest.raises(InvalidRequestError) as err:
        validate_sampling(SamplingParams(temperature=1.0, min_p=min_p), VOCAB, prefix="sampling.")
    assert err.value.field == "sampling.min_p"


def test_a_row_without_finite_logits_fails_alone():
    logits = torch.randn(3, VOCAB)
    logits[1] = math.nan
    requests = [_request("a"), _request("b", temperature=0.5, seed=1), _request("c", temperature=0.5, seed=2)]
    out = sample(logits, requests, {"a": 0, "b": 1, "c": 2})
    assert isinstance(out[1], RowFailure)
    assert out[0][0] == int(logits[0].argmax()) and 0 <= out[2][0] < VOCAB


def _run(engine: LLMEngine, specs: list[RequestSpec]) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    for spec in specs:
        engine.add_request(spec)
    tokens: dict[str, list[int]] = {s.req_id: [] for s in specs}
    reasons: dict[str, FinishReason] = {}
    while engine.has_work():
        for d in engine.step().deltas:
            tokens[d.req_id].extend(d.token_ids)
            if d.finished:
                reasons[d.req_id] = d.finish_reason
    return tokens, reasons


PROMPTS = [[11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34, 35], [40, 41, 42]]


def test_temperature_that_used_to_overflow_is_greedy_in_a_batch(tiny_model, hf_reference):
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64))
    temps = [0.0, 1e-30, 4e-6, 0.0]   # 1e-30 overflowed float32 logits / temperature to inf
    specs = [RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=8, ignore_eos=True, temperature=t))
             for i, (p, t) in enumerate(zip(PROMPTS, temps))]
    tokens, reasons = _run(engine, specs)
    for i, p in enumerate(PROMPTS):
        assert reasons[f"r{i}"] is FinishReason.LENGTH
        assert tokens[f"r{i}"] == hf_greedy(hf_reference, p, 8)
    assert_no_leaks(engine)


@pytest.mark.parametrize("poisoned", [0, 2])
def test_one_poisoned_request_fails_alone_and_the_batch_goes_on(tiny_model, hf_reference, poisoned):
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64))
    faults.inject(engine, "poison", token_id=PROMPTS[poisoned][0])
    specs = [RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=8, ignore_eos=True))
             for i, p in enumerate(PROMPTS)]
    tokens, reasons = _run(engine, specs)
    for i, p in enumerate(PROMPTS):
        if i == poisoned:
            assert reasons[f"r{i}"] is FinishReason.ERROR and tokens[f"r{i}"] == []
        else:
            assert reasons[f"r{i}"] is FinishReason.LENGTH
            assert tokens[f"r{i}"] == hf_greedy(hf_reference, p, 8)
    assert_no_leaks(engine)


def test_poisoned_request_arriving_mid_decode_fails_alone(tiny_model, hf_reference):
    """The others are decoding when the poisoned prompt joins their batch."""
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64))
    faults.inject(engine, "poison", token_id=99)
    good = [RequestSpec(f"g{i}", tuple(p), SamplingParams(max_tokens=10, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    for spec in good:
        engine.add_request(spec)
    tokens: dict[str, list[int]] = {s.req_id: [] for s in good}
    errors = {}
    for step in range(40):
        if step == 3:
            engine.add_request(RequestSpec("bad", (99, 1, 2), SamplingParams(max_tokens=10)))
        if not engine.has_work():
            break
        for d in engine.step().deltas:
            tokens.setdefault(d.req_id, []).extend(d.token_ids)
            if d.finish_reason is FinishReason.ERROR:
                errors[d.req_id] = d.error
    assert set(errors) == {"bad"} and "poison" in errors["bad"]
    for i, p in enumerate(PROMPTS):
        assert tokens[f"g{i}"] == hf_greedy(hf_reference, p, 10)
    assert_no_leaks(engine)
