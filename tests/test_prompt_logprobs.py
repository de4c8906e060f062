"""Prompt logprobs (vLLM's ``prompt_logprobs``) in the engine: each prompt token's logprob after
the first, and its position's N most likely tokens, equal to Hugging Face's log-softmax over the
prompt (float32), whatever the chunking, preemption, prefix cache or batch around it; the output
stays HF's greedy tokens; each request's first delta carries them once. Each test ends with the
leak check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.types import PromptLogprobs, RequestSpec, SamplingParams
from engine.validation import validate_sampling
from tests.conftest import assert_no_leaks, hf_greedy

PROMPTS = [tuple((7 * i + 3 * j) % 250 + 2 for j in range(length)) for i, length in enumerate((37, 5, 64, 1, 18))]
CONFIGS = {
    "default": EngineConfig(num_kv_blocks=128),
    "chunked": EngineConfig(num_kv_blocks=128, max_num_batched_tokens=8),
    "preemption": EngineConfig(num_kv_blocks=20, block_size=4, max_num_batched_tokens=16),
}


def _reference(hf_reference, prompt: tuple[int, ...], n: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
    with torch.no_grad():
        lp = torch.log_softmax(hf_reference(torch.tensor([list(prompt)])).logits[0].float(), dim=-1)
    chosen = [float(lp[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
    values, ids = torch.topk(lp[: len(prompt) - 1], n) if n else (torch.empty(0), torch.empty(0))
    return chosen, ids.tolist(), values.tolist()


TIE_EPS = 1e-5   # logprobs closer than this are a tie: batched and HF's float32 sums differ by ~1e-6


def _rank_bounds(hf_reference, prompt) -> list[tuple[int, int]]:
    """vLLM's rank (1 + how many tokens the model finds more likely at that position), as the
    range HF's logprobs allow: a token within ``TIE_EPS`` of the prompt's own may fall on either
    side of it (a clean-clone CI run saw 78 vs 79 at one position of a 250-token prompt)."""
    with torch.no_grad():
        lp = torch.log_softmax(hf_reference(torch.tensor([list(prompt)])).logits[0].float(), dim=-1)
    own = [lp[p, prompt[p + 1]] for p in range(len(prompt) - 1)]
    return [(int((lp[p] > own[p] + TIE_EPS).sum()) + 1, int((lp[p] > own[p] - TIE_EPS).sum()) + 1)
            for p in range(len(prompt) - 1)]


def _assert_matches(got: PromptLogprobs, hf_reference, prompt, n: int) -> None:
    chosen, ids, values = _reference(hf_reference, prompt, n)
    assert tuple(got.token_ids) == tuple(prompt)
    assert got.logprobs == pytest.approx(chosen, abs=1e-4)
    bounds = _rank_bounds(hf_reference, prompt)
    assert len(got.ranks) == len(bounds)
    assert all(low <= rank <= high for rank, (low, high) in zip(got.ranks, bounds)), (list(got.ranks), bounds)
    if not n:
        assert got.top == ()
        return
    assert len(got.top) == len(prompt) - 1
    with torch.no_grad():
        lp = torch.log_softmax(hf_reference(torch.tensor([list(prompt)])).logits[0].float(), dim=-1)
    for p, (top, want_ids, want_values) in enumerate(zip(got.top, ids, values)):
        # HF's token at each place, or one HF finds as likely (a tie within TIE_EPS)
        assert all(t == want or abs(float(lp[p, t]) - value) <= TIE_EPS
                   for (t, _), want, value in zip(top, want_ids, want_values)), (top, want_ids)
        assert [v for _, v in top] == pytest.approx(want_values, abs=1e-4)


def _run(engine: LLMEngine, specs: list[RequestSpec]) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Tokens per request and every delta's prompt_logprobs (first delta only is allowed to carry them)."""
    for spec in specs:
        engine.add_request(spec)
    tokens: dict[str, list[int]] = {s.req_id: [] for s in specs}
    carried: dict[str, list] = {s.req_id: [] for s in specs}
    while engine.has_work():
        for d in engine.step().deltas:
            if d.prompt_logprobs is not None:
                carried[d.req_id].append((len(tokens[d.req_id]), d.prompt_logprobs))
            tokens[d.req_id].extend(d.token_ids)
    return tokens, carried


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_prompt_logprobs_equal_hf_and_ride_on_the_first_delta_only(tiny_model, hf_reference, config):
    engine = LLMEngine(tiny_model, dataclasses.replace(CONFIGS[config]))
    asks = {f"r{i}": i % 3 * 2 for i in range(len(PROMPTS))}     # N = 0, 2, 4, 0, 2
    specs = [RequestSpec(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=asks[f"r{i}"]))
             for i, p in enumerate(PROMPTS)]
    specs.append(RequestSpec("plain", PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True)))
    tokens, carried = _run(engine, specs)
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        assert tokens[rid] == hf_greedy(hf_reference, list(prompt), 6)
        assert len(carried[rid]) == 1 and carried[rid][0][0] == 0, "once, with the first token"
        _assert_matches(carried[rid][0][1], hf_reference, prompt, asks[rid])
    assert carried["plain"] == [] and tokens["plain"] == tokens["r0"]
    if config == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the pool must be small enough to preempt"
    assert_no_leaks(engine)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(tiny_model, hf_reference):
    """The prompt's blocks are in the prefix cache: a request asking for prompt logprobs reads
    none of them (their positions' logits would not exist); one that does not ask still hits."""
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128, block_size=4))
    prompt = PROMPTS[2]
    _run(engine, [RequestSpec("warm", prompt, SamplingParams(max_tokens=2, ignore_eos=True))])
    engine.add_request(RequestSpec("asks", prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)))
    first = engine.step().deltas
    assert [d.num_cached_tokens for d in first if d.req_id == "asks"] == [0]
    _assert_matches(next(d.prompt_logprobs for d in first if d.req_id == "asks"), hf_reference, prompt, 1)
    while engine.has_work():
        engine.step()
    engine.add_request(RequestSpec("hits", prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    again = engine.step().deltas
    assert [d.num_cached_tokens for d in again if d.req_id == "hits"][0] >= 60
    while engine.has_work():
        engine.step()
    assert_no_leaks(engine)


def test_prefill_role_hands_them_over_and_a_reserved_decode_request_never_computes_them(tiny_model, hf_reference):
    """Disaggregated: the prefill engine's PrefillDone carries them; the decode engine's request
    (KV imported) owes none, even when preempted and recomputed there."""
    from engine.config import EngineRole

    prompt = PROMPTS[0]
    spec = RequestSpec("d", prompt, SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=3))
    prefill = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, role=EngineRole.PREFILL))
    prefill.add_request(spec)
    done = []
    while not done and prefill.has_work():   # a failed request ends the loop (and the test) too
        done = prefill.step().prefilled
    assert done, "the prefill engine finished without handing the request over"
    _assert_matches(done[0].prompt_logprobs, hf_reference, prompt, 3)
    prefill.release("d")
    assert_no_leaks(prefill)
    decode = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=64, role=EngineRole.DECODE))
    decode.reserve(spec)
    assert decode.scheduler.requests["d"].prompt_logprobs is None
    decode.abort("d")
    decode.step()
    assert_no_leaks(decode)


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_refused_naming_the_field(value):
    with pytest.raises(InvalidRequestError, match="sampling.prompt_logprobs"):
        validate_sampling(SamplingParams(prompt_logprobs=value), prefix="sampling.")


def test_a_failed_forward_retried_one_by_one_records_each_position_once(tiny_model, hf_reference, monkeypatch):
    """A batched forward that raises is retried request by request; the retried rows append no
    position twice."""
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128))
    real, calls = engine.runner.execute, []

    def flaky(inputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(inputs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    specs = [RequestSpec(f"f{i}", PROMPTS[i], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2))
             for i in (0, 2)]
    tokens, carried = _run(engine, specs)
    for spec in specs:
        assert len(carried[spec.req_id]) == 1
        _assert_matches(carried[spec.req_id][0][1], hf_reference, spec.prompt_token_ids, 2)
        assert tokens[spec.req_id] == hf_greedy(hf_reference, list(spec.prompt_token_ids), 3)
    assert_no_leaks(engine)


def test_rows_are_scored_a_slice_at_a_time_with_the_same_result(tiny_model, hf_reference, monkeypatch):
    """The log-softmax runs over at most ROWS_AT_ONCE rows at a time (memory bound at a large
    vocabulary): slices of 7 rows give what one pass gives."""
    from engine import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_AT_ONCE", 7)
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128))
    tokens, carried = _run(engine, [RequestSpec("s", PROMPTS[2], SamplingParams(max_tokens=2, prompt_logprobs=3))])
    _assert_matches(carried["s"][0][1], hf_reference, PROMPTS[2], 3)
    assert_no_leaks(engine)
