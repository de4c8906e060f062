"""min_tokens, logit bias and the repetition, frequency and presence penalties (engine/logit_adjust.py).

Greedy output with them equals Hugging Face ``generate`` run with the same adjustments as
logits processors (Hugging Face's own ``RepetitionPenaltyLogitsProcessor``; OpenAI's bias and
penalties written out, in vLLM's order), on one engine under every scheduling (staggered
arrivals, chunked prefill, preemption by recompute); ``repetition_penalty`` alone equals
``generate(repetition_penalty=...)``; ``min_tokens`` equals ``generate(min_new_tokens=...)``. Sampling with them draws the same tokens after
preemption. The validation names each bad value. (Through the cluster: tests/test_cluster_e2e.py;
over HTTP: tests/test_openai_api.py.) Every engine test ends with the leak check.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.logit_adjust import adjust
from engine.request import Request
from engine.types import PrefillSubmission, RequestSpec, SamplingParams
from engine.validation import validate_sampling, validate_spec
from tests.conftest import assert_no_leaks, hf_greedy
from tests.test_engine_exact import CONFIGS, run_staggered

VOCAB = 512   # the tiny random Llama's

# One request per kind of adjustment, and every kind at once; prompts drawn from few ids so
# that tokens repeat (a penalty only touches tokens already seen).
ADJUSTMENTS = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(frequency_penalty=0.9, presence_penalty=0.4),
    dict(frequency_penalty=-0.5, presence_penalty=1.5),
    dict(logit_bias=((7, 5.0), (11, -100.0), (300, 2.5))),
    dict(repetition_penalty=1.2, frequency_penalty=0.6, presence_penalty=-0.3, logit_bias=((9, 3.0), (12, -1.5))),
]


class OpenAIAdjustments(LogitsProcessor):
    """The reference: OpenAI's logit_bias, then Hugging Face's repetition penalty, then OpenAI's
    frequency and presence penalties over the generated tokens (vLLM's order)."""

    def __init__(self, prompt_len: int, params: SamplingParams) -> None:
        self.prompt_len, self.params = prompt_len, params

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        p = self.params
        scores = scores.clone()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias])
            scores[:, ids] += torch.tensor([b for _, b in p.logit_bias])
        if p.repetition_penalty != 1.0:
            scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, scores)
        generated = input_ids[0, self.prompt_len:]
        if generated.numel():
            ids, counts = generated.unique(return_counts=True)
            scores[0, ids] -= p.frequency_penalty * counts.to(scores.dtype)
            scores[0, ids] -= p.presence_penalty
        return scores


def hf_adjusted_greedy(model, prompt: list[int], max_new: int, params: SamplingParams) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0,
        logits_processor=LogitsProcessorList([OpenAIAdjustments(len(prompt), params)]),
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def adjusted_workload(hf_reference):
    rng = random.Random(23)
    prompts, params = [], []
    for i in range(2 * len(ADJUSTMENTS)):
        prompts.append([rng.randrange(3, 24) for _ in range(rng.randint(1, 70))])
        params.append(SamplingParams(max_tokens=rng.randint(8, 28), ignore_eos=True, **ADJUSTMENTS[i % len(ADJUSTMENTS)]))
    refs = [hf_adjusted_greedy(hf_reference, p, s.max_tokens, s) for p, s in zip(prompts, params)]
    plain = [hf_greedy(hf_reference, p, s.max_tokens) for p, s in zip(prompts, params)]
    return prompts, params, refs, plain


def test_the_reference_is_hf_generate_for_repetition_penalty_alone(hf_reference, adjusted_workload):
    prompts, params, refs, _ = adjusted_workload
    for prompt, sp, ref in zip(prompts, params, refs):
        if sp.repetition_penalty != 1.0 and not (sp.frequency_penalty or sp.presence_penalty or sp.logit_bias):
            out = hf_reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                        max_new_tokens=sp.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                        repetition_penalty=sp.repetition_penalty)
            assert out[0, len(prompt):].tolist() == ref


def test_the_adjustments_change_the_output(adjusted_workload):
    """Not a vacuous comparison: most adjusted references differ from plain greedy."""
    _, _, refs, plain = adjusted_workload
    assert sum(r != p for r, p in zip(refs, plain)) >= len(refs) // 2


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_with_adjustments_matches_hf(tiny_model, adjusted_workload, name):
    prompts, params, refs, plain = adjusted_workload
    engine = LLMEngine(tiny_model, CONFIGS[name])
    specs = [RequestSpec(f"a{i}", tuple(p), s) for i, (p, s) in enumerate(zip(prompts, params))]
    # Plain greedy neighbours in the same batches keep the batch's argmax.
    plain_prompts = prompts[:4]
    got = run_staggered(engine, plain_prompts, [s.max_tokens for s in params[:4]], specs)
    for i, ref in enumerate(refs):
        assert got[f"a{i}"] == ref, f"request a{i} ({params[i]}) differs from HF under config {name}"
    for i in range(4):
        assert got[f"r{i}"] == plain[i]
    if name == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_sampling_with_adjustments_redraws_the_same_tokens_after_preemption(tiny_model, adjusted_workload):
    prompts, params, _, _ = adjusted_workload
    sampled = [RequestSpec(f"s{i}", tuple(p), SamplingParams(**{**_fields(s), "temperature": 0.9, "seed": i}))
               for i, (p, s) in enumerate(zip(prompts, params))]
    outputs = {}
    for name in ("default", "preempt"):
        engine = LLMEngine(tiny_model, CONFIGS[name])
        outputs[name] = run_staggered(engine, [], [], sampled)
        assert_no_leaks(engine)
    assert outputs["default"] == outputs["preempt"]


def test_a_migrated_request_counts_the_tokens_it_streamed_before(tiny_model):
    """A request resumed elsewhere carries its streamed tokens in its prompt (``num_generated``):
    the frequency and presence penalties count them as output, the repetition penalty as seen."""
    params = SamplingParams(max_tokens=1, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5,
                            logit_bias=((3, 1.0),))
    resumed = Request(RequestSpec("m", (5, 6, 7, 7, 8), params, num_generated=3))   # 7, 7, 8 were output
    row = torch.linspace(-2.0, 2.0, VOCAB)
    out = adjust(row[None].clone(), [resumed])[0]
    expected = row.clone()
    expected[3] += 1.0
    for t in (5, 6, 7, 8):
        expected[t] = expected[t] * 1.5 if expected[t] < 0 else expected[t] / 1.5
    expected[7] -= 2 * 1.0
    expected[7] -= 0.5
    expected[8] -= 1.0
    expected[8] -= 0.5
    assert torch.equal(out, expected)
    assert torch.equal(row, torch.linspace(-2.0, 2.0, VOCAB)), "the caller's copy is what changes"


def _hf_min_new_tokens(model, prompt: list[int], max_new: int, min_new: int, eos: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, min_new_tokens=min_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["default", "chunked", "preempt"])
def test_min_tokens_holds_back_eos_and_stop_ids_as_hf_min_new_tokens_does(tiny_model, hf_reference, name):
    """vLLM's min_tokens is Hugging Face's min_new_tokens: EOS (the model's, 2 here, unless the
    request ignores it) and the stop token ids cannot be chosen before it, and end the output
    after it. Each prompt's stop token is one its plain greedy output would stop at early."""
    rng = random.Random(3)
    engine = LLMEngine(tiny_model, CONFIGS[name])
    specs, refs = [], []
    for i in range(6):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randint(3, 50))]
        plain = hf_greedy(hf_reference, prompt, 40)
        stop = plain[rng.randrange(0, 4)]
        for min_tokens in (0, 6, 25):
            specs.append(RequestSpec(f"m{i}-{min_tokens}", tuple(prompt),
                                     SamplingParams(max_tokens=40, min_tokens=min_tokens, stop_token_ids=(stop,))))
            refs.append(_hf_min_new_tokens(hf_reference, prompt, 40, min_tokens, [2, stop]))
    got = run_staggered(engine, [], [], specs)
    for spec, ref in zip(specs, refs):
        assert got[spec.req_id] == ref, spec
        assert len(ref) > spec.sampling.min_tokens or len(ref) == 40
    assert any(len(r) < 6 for r in refs[::3]), "without min_tokens some outputs stop early"
    if name == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_min_tokens_after_a_migration_counts_the_tokens_streamed_before(tiny_model):
    """A resumed request's streamed tokens count toward min_tokens: 3 out of 4, one more held."""
    params = SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=(9,))
    row = torch.zeros(VOCAB)
    held = adjust(row[None].clone(), [Request(RequestSpec("m", (5, 6, 7, 8), params, num_generated=3))], frozenset({2}))[0]
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[[2, 9]] = False
    assert held[9] == held[2] == float("-inf") and torch.equal(held[others], row[others])
    free = adjust(row[None].clone(), [Request(RequestSpec("m", (5, 6, 7, 8, 1), params, num_generated=4))], frozenset({2}))[0]
    assert torch.equal(free, row)
    ignoring = Request(RequestSpec("m", (5,), SamplingParams(max_tokens=9, min_tokens=4, ignore_eos=True)))
    assert torch.equal(adjust(row[None].clone(), [ignoring], frozenset({2}))[0], row), "an ignored EOS is not held back"


def test_a_resumed_requests_min_tokens_counts_what_it_streamed_before():
    """Found by a probe: a request migrated (or recomputed after a failed hand-off) with
    min_tokens above its remaining max_tokens was refused as INVALID_ARGUMENT mid-stream."""
    params = SamplingParams(max_tokens=10, min_tokens=60)   # 50 streamed before: 60 in all
    validate_spec(RequestSpec("m", (5, 6), params, num_generated=50), max_model_len=512, vocab_size=VOCAB)
    with pytest.raises(InvalidRequestError, match=r"must be in \[0, max_tokens \(59\)\], got 60") as err:
        validate_spec(RequestSpec("m", (5, 6), params, num_generated=49), max_model_len=512, vocab_size=VOCAB)
    assert err.value.field == "min_tokens"


@pytest.mark.parametrize("fields, name", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(frequency_penalty=2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(logit_bias=((5, 100.5),)), "logit_bias"),
    (dict(logit_bias=((5, float("nan")),)), "logit_bias"),
    (dict(logit_bias=((5, 1.0), (5, 2.0))), "logit_bias"),
    (dict(logit_bias=((VOCAB, 1.0),)), "logit_bias"),
    (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=5, min_tokens=6), "min_tokens"),
    (dict(allowed_token_ids=(3, VOCAB)), "allowed_token_ids"),
    (dict(allowed_token_ids=(0,) * (VOCAB + 1)), "allowed_token_ids"),
    (dict(bad_words_token_ids=((5,), ())), "bad_words"),
    (dict(bad_words_token_ids=((5, VOCAB),)), "bad_words"),
    (dict(allowed_token_ids=(5, 6), bad_words_token_ids=((6,), (5,), (5, 6))), "bad_words"),
])
def test_bad_values_are_named(fields, name):
    with pytest.raises(InvalidRequestError) as err:
        validate_sampling(SamplingParams(**fields), VOCAB, prefix="sampling.")
    assert err.value.field == "sampling." + name


def test_the_ranges_edges_are_accepted():
    validate_sampling(SamplingParams(repetition_penalty=1e-3, frequency_penalty=-2.0, presence_penalty=2.0,
                                     logit_bias=((0, -100.0), (VOCAB - 1, 100.0))), VOCAB)


def test_a_request_added_with_a_bad_value_is_refused_and_nothing_is_held(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=32))
    with pytest.raises(InvalidRequestError):
        engine.add_request(RequestSpec("bad", (5, 6), SamplingParams(logit_bias=((VOCAB + 7, 1.0),))))
    assert_no_leaks(engine)


def test_a_request_whose_adjustment_fails_fails_alone():
    """A bias naming a token past the logits (validation keeps it out; here it slips past) fails
    its request with a RowFailure; the other adjusted and plain rows of the batch are chosen."""
    from engine.sampler import RowFailure, sample

    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    bad = Request(RequestSpec("bad", (1, 2), SamplingParams(logit_bias=((VOCAB + 5, 1.0),))))
    good = Request(RequestSpec("good", (1, 2), SamplingParams(logit_bias=((4, 100.0),))))
    plain = Request(RequestSpec("plain", (1, 2), SamplingParams()))
    out = sample(logits, [bad, good, plain], {})
    assert isinstance(out[0], RowFailure)
    assert out[1][0] == 4 and out[2][0] == int(logits[2].argmax())


def test_the_adjustments_survive_the_direct_submissions_json():
    """A prefill worker on the router's node gets the request over a socket as JSON
    (``PrefillSubmission``): the first token it chooses needs the same adjustments."""
    spec = RequestSpec("j", (5, 6, 7), SamplingParams(max_tokens=3, stop=("x",), stop_token_ids=(9,), skip_special_tokens=False,
                                                      bad_words_token_ids=((4,), (8, 3)), **ADJUSTMENTS[-1]))
    assert PrefillSubmission.from_json(PrefillSubmission(spec, "shm", "d0", None).to_json()).spec == spec


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}


def test_allowed_token_ids_as_hf_prefix_allowed_tokens_fn(tiny_model, hf_reference):
    """vLLM's allowed_token_ids: only those can be chosen, greedy as HF's prefix_allowed_tokens_fn
    chooses; with penalties and a bias on top; sampled draws stay inside the set."""
    rng = random.Random(9)
    engine = LLMEngine(tiny_model, CONFIGS["chunked"])
    specs, refs = [], []
    for i in range(4):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(2, 40))]
        allowed = sorted(rng.sample(range(VOCAB), 12))
        extra = ADJUSTMENTS[i] if i % 2 else {}
        params = SamplingParams(max_tokens=15, ignore_eos=True, allowed_token_ids=tuple(allowed), **extra)
        specs.append(RequestSpec(f"l{i}", tuple(prompt), params))
        out = hf_reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=15,
            do_sample=False, eos_token_id=None, pad_token_id=0, prefix_allowed_tokens_fn=lambda b, ids, a=allowed: a,
            logits_processor=LogitsProcessorList([OpenAIAdjustments(len(prompt), params)]))
        refs.append(out[0, len(prompt):].tolist())
    sampled = RequestSpec("ls", (5, 6, 7), SamplingParams(max_tokens=30, temperature=1.5, seed=3, ignore_eos=True,
                                                        allowed_token_ids=(4, 8, 15, 16, 23, 42)))
    got = run_staggered(engine, [], [], [*specs, sampled])
    for spec, ref in zip(specs, refs):
        assert got[spec.req_id] == ref and set(ref) <= set(spec.sampling.allowed_token_ids)
    assert set(got["ls"]) <= {4, 8, 15, 16, 23, 42} and len(set(got["ls"])) > 1
    assert_no_leaks(engine)


def test_allowed_token_ids_all_held_back_are_refused_and_at_worst_fail_alone():
    from engine.sampler import RowFailure, sample

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    stuck = Request(RequestSpec("stuck", (1,), SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(2,))))
    fine = Request(RequestSpec("fine", (1,), SamplingParams(max_tokens=4, allowed_token_ids=(5, 6))))
    out = sample(logits, [stuck, fine], {}, frozenset({2}))   # 2: EOS, the only allowed token, held back
    assert isinstance(out[0], RowFailure) and out[1][0] == 5 + int(logits[1, 6] > logits[1, 5])
    for params, eos in [(SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=(7, 9), allowed_token_ids=(9,)), ()),
                        (SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=(2,)), (2,))]:
        with pytest.raises(InvalidRequestError) as err:   # refused up front, where the model's EOS is known
            validate_sampling(params, VOCAB, eos_token_ids=eos)
        assert err.value.field == "allowed_token_ids"
    validate_sampling(SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=(2,), ignore_eos=True), VOCAB,
                      eos_token_ids=(2,))   # an ignored EOS is not held back: allowed



@pytest.mark.parametrize("name", ["default", "chunked", "preempt"])
def test_bad_words_as_hf_bad_words_ids(tiny_model, hf_reference, name):
    """vLLM's bad words, greedy, equal to HF's ``generate(bad_words_ids=...)``: a one-token word
    is never chosen; a two- and a three-token word taken from the plain greedy output lose their
    last token where the output ends with the others (so the output changes there), whatever the
    batch, chunking or preemption. HF also matches the words' leading tokens against the prompt's
    end, vLLM (and pdserve) the output only: the prompts here end with none of them (asserted)."""
    rng = random.Random(31)
    specs, refs = [], []
    for i in range(6):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randint(3, 30))]
        plain = hf_greedy(hf_reference, prompt, 24)
        words = [[plain[2]], plain[6:8], plain[12:15]]
        assert all(prompt[-(len(w) - 1):] != w[:-1] for w in words if len(w) > 1)
        out = hf_reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                                    bad_words_ids=words)
        refs.append(out[0, len(prompt):].tolist())
        assert refs[-1] != plain and plain[2] not in refs[-1]
        params = SamplingParams(max_tokens=24, ignore_eos=True, bad_words_token_ids=tuple(map(tuple, words)),
                                **(ADJUSTMENTS[i] if i % 3 == 2 else {}))
        specs.append(RequestSpec(f"b{i}", tuple(prompt), params))
        if i % 3 == 2:   # with penalties and a bias on top: HF's processors then the bad words
            refs[-1] = hf_reference.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=24,
                do_sample=False, eos_token_id=None, pad_token_id=0, bad_words_ids=words,
                logits_processor=LogitsProcessorList([OpenAIAdjustments(len(prompt), params)]))[0, len(prompt):].tolist()
    engine = LLMEngine(tiny_model, CONFIGS[name])
    got = run_staggered(engine, [[5, 6, 7]], [20], specs)
    for spec, ref in zip(specs, refs):
        assert got[spec.req_id] == ref, f"{spec.req_id} under {name}"
    if name == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_bad_words_count_a_migrated_requests_streamed_tokens():
    """A word's leading tokens may have been streamed by the worker a request left: they count."""
    from engine.logit_adjust import _banned

    spec = RequestSpec("m", (1, 2, 9, 8), SamplingParams(bad_words_token_ids=((9, 8, 7), (8, 6), (4,))),
                       num_generated=2)   # 9, 8 were streamed before the move
    assert _banned(Request(spec)) == [4, 6, 7]
    fresh = RequestSpec("f", (1, 2, 9, 8), SamplingParams(bad_words_token_ids=((9, 8, 7), (8, 6), (4,))))
    assert _banned(Request(fresh)) == [4]   # the prompt's own tokens never complete a word
