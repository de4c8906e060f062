"""Engine API: bad input raises typed errors and the engine keeps serving; sampling settings;
abort; decode-role hand-off entry points; stats. Each ends with a leak check."""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig, EngineRole
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.types import FinishReason, RequestSpec, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy


@pytest.fixture()
def engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128))


BAD = [
    ("prompt", (), {}),
    ("prompt", tuple([5] * 512), {}),                       # tiny model's max length is 512
    ("max_tokens", (5, 6), {"max_tokens": 0}),
    ("max_tokens", tuple([5] * 500), {"max_tokens": 20}),   # prompt + max_tokens beyond the model
    ("temperature", (5, 6), {"temperature": -0.5}),
    ("temperature", (5, 6), {"temperature": math.nan}),
    ("top_p", (5, 6), {"top_p": 0.0}),
    ("top_p", (5, 6), {"top_p": 1.5}),
    ("top_k", (5, 6), {"top_k": -1}),
    ("prompt_token_ids", (5, 512), {}),
    ("prompt_token_ids", (-1, 5), {}),
    ("stop_token_ids", (5,), {"stop_token_ids": (10**6,)}),
]


@pytest.mark.parametrize("field, prompt, sampling", BAD)
def test_bad_input_raises_typed_error_and_engine_keeps_serving(engine, hf_reference, field, prompt, sampling):
    engine.add_request(RequestSpec("good", (9, 8, 7), SamplingParams(max_tokens=5, ignore_eos=True)))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(RequestSpec("bad", prompt, SamplingParams(**sampling)))
    assert info.value.field == field and field in str(info.value)
    out: list[int] = []
    while engine.has_work():
        for d in engine.step().deltas:
            out.extend(d.token_ids)
    assert out == hf_greedy(hf_reference, [9, 8, 7], 5)
    assert_no_leaks(engine)


@pytest.mark.parametrize("role", [EngineRole.COLOCATED, EngineRole.DECODE, EngineRole.PREFILL])
def test_request_larger_than_the_kv_pool_is_refused_not_preempted_forever(tiny_model, role):
    """14 blocks of 8 hold 112 tokens: a 120-token request could never run, and preempting the
    others would not make room (it used to be preempted and rescheduled forever). Colocated and
    decode workers cap max_model_len to their pool; a prefill worker holds prompts only."""
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=14, block_size=8, role=role))
    assert engine.max_model_len == (512 if role is EngineRole.PREFILL else 112)
    too_long = RequestSpec("long", tuple(range(3, 103)), SamplingParams(max_tokens=20))
    if role is EngineRole.PREFILL:
        engine.add_request(too_long)   # 100 prompt tokens fit: the output lives on the decode worker
        engine.abort("long")
        too_long = RequestSpec("long2", tuple(range(3, 123)), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="112"):
        engine.add_request(too_long)
    engine.generate([])
    assert_no_leaks(engine)


def test_duplicate_request_id_rejected(engine):
    engine.add_request(RequestSpec("x", (1, 2), SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request(RequestSpec("x", (1, 2), SamplingParams(max_tokens=2)))
    engine.generate([])
    assert_no_leaks(engine)


def _run(engine, specs):
    return engine.generate(specs)


def test_seeded_sampling_is_batch_independent(tiny_model):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
    alone = _run(LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64)), [RequestSpec("s", (4, 5, 6), params)])
    crowd = [RequestSpec(f"c{i}", (i + 3, 9), SamplingParams(max_tokens=12, temperature=1.0, seed=i)) for i in range(5)]
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=4))
    together = _run(engine, crowd + [RequestSpec("s", (4, 5, 6), params)])
    assert alone["s"] == together["s"]
    other_seed = _run(LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64)), [RequestSpec("s", (4, 5, 6), SamplingParams(
        max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, seed=99, ignore_eos=True))])
    assert other_seed["s"] != alone["s"], "a different seed should change a 16-token sample"
    assert_no_leaks(engine)


def test_top_k_one_is_greedy(tiny_model, hf_reference):
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64))
    out = _run(engine, [RequestSpec("k", (3, 4, 5), SamplingParams(max_tokens=10, temperature=2.0, top_k=1, seed=5, ignore_eos=True))])
    assert out["k"] == hf_greedy(hf_reference, [3, 4, 5], 10)
    assert_no_leaks(engine)


def test_logprobs_reported_per_token(engine):
    engine.add_request(RequestSpec("l", (3, 4), SamplingParams(max_tokens=4, logprobs=True, ignore_eos=True)))
    deltas = []
    while engine.has_work():
        deltas.extend(engine.step().deltas)
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(logprobs) == 4 and all(lp <= 0.0 for lp in logprobs)
    assert_no_leaks(engine)


def test_top_logprobs_are_the_models_most_likely_tokens(engine, hf_reference):
    """Per position: the N most likely tokens with their logprobs, most likely first, equal to
    HF's log-softmax over the same sequence (float32); greedy's pick is the first of them."""
    import torch

    prompt, n = (3, 4, 5), 5
    engine.add_request(RequestSpec("t", prompt, SamplingParams(max_tokens=6, logprobs=True, top_logprobs=n,
                                                               ignore_eos=True)))
    engine.add_request(RequestSpec("plain", prompt, SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)))
    deltas = []
    while engine.has_work():
        deltas.extend(engine.step().deltas)
    tokens = [t for d in deltas if d.req_id == "t" for t in d.token_ids]
    logprobs = [lp for d in deltas if d.req_id == "t" for lp in d.logprobs]
    tops = [top for d in deltas if d.req_id == "t" for top in d.top_logprobs]
    assert all(d.top_logprobs is None for d in deltas if d.req_id == "plain")
    with torch.no_grad():
        ref = torch.log_softmax(hf_reference(torch.tensor([list(prompt) + tokens])).logits[0].float(), dim=-1)
    assert len(tops) == len(tokens) == 6
    for i, (token, lp, top) in enumerate(zip(tokens, logprobs, tops)):
        row = ref[len(prompt) - 1 + i]
        values, ids = torch.topk(row, n)
        assert [t for t, _ in top] == ids.tolist() and top[0][0] == token
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4) and lp == pytest.approx(top[0][1])
    assert_no_leaks(engine)


def test_top_logprobs_bounds():
    from engine.validation import validate_sampling

    for bad in (dict(logprobs=True, top_logprobs=21), dict(logprobs=True, top_logprobs=-1), dict(top_logprobs=2)):
        with pytest.raises(InvalidRequestError) as err:
            validate_sampling(SamplingParams(**bad), prefix="sampling.")
        assert err.value.field == "sampling.top_logprobs"
    validate_sampling(SamplingParams(logprobs=True, top_logprobs=20))


def test_abort_mid_stream_reports_abort(engine):
    engine.add_request(RequestSpec("a", (3, 4, 5), SamplingParams(max_tokens=100, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.abort("a")
    deltas = engine.step().deltas
    assert deltas and deltas[-1].finish_reason is FinishReason.ABORT
    assert_no_leaks(engine)


def test_failed_forward_fails_only_its_batch(engine, monkeypatch):
    engine.add_request(RequestSpec("f", (3, 4, 5), SamplingParams(max_tokens=5)))

    def boom(inputs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", boom)
    deltas = engine.step().deltas
    assert deltas[0].finish_reason is FinishReason.ERROR and "injected fault" in deltas[0].error
    monkeypatch.undo()
    assert engine.generate([RequestSpec("ok", (3, 4, 5), SamplingParams(max_tokens=3, ignore_eos=True))])["ok"]
    assert_no_leaks(engine)


def test_prefill_then_decode_engines_hand_off(tiny_model, hf_reference):
    """Two engines in one process: the KV bytes move block by block, output equals HF."""
    prefill = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, role=EngineRole.PREFILL, max_num_batched_tokens=8))
    decode = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, role=EngineRole.DECODE))
    prompt = tuple(range(20, 45))
    spec = RequestSpec("h", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    dst = decode.reserve(spec)
    prefill.add_request(spec)
    done = []
    while not done:
        done = prefill.step().prefilled
    src = list(done[0].block_ids)
    decode.cache[:, :, dst] = prefill.cache[:, :, src]
    prefill.release("h")
    decode.commit_kv("h", done[0].first_token_id)
    out = [done[0].first_token_id]
    while decode.has_work():
        for d in decode.step().deltas:
            out.extend(d.token_ids)
    assert out == hf_greedy(hf_reference, list(prompt), 12)
    assert_no_leaks(prefill)
    assert_no_leaks(decode)


def test_stats_reflect_load(engine):
    engine.add_request(RequestSpec("s1", tuple(range(3, 40)), SamplingParams(max_tokens=3)))
    stats = engine.stats("w0")
    assert stats.num_waiting == 1 and stats.num_waiting_tokens == 37 and stats.kv_usage == 0.0
    engine.step()
    stats = engine.stats("w0")
    assert stats.num_running == 1 and stats.num_free_blocks < stats.num_total_blocks
    assert stats.recent_steps[-1].num_tokens == 37
    engine.abort("s1")
    engine.step()
    assert_no_leaks(engine)
