"""Structured output in the engine (``engine/grammar.py``, applied by ``engine/logit_adjust.py``):
greedy output under a JSON schema, any JSON object, a regex, a list of choices, a Lark and a GBNF
grammar equals Hugging Face ``generate`` with the same grammar's mask as a logits processor,
token for token, under the default, chunked-prefill and preemption configs; sampled output ends
in whole matches; a migrated request continues its grammar where it was; a bad grammar, a model
without a tokenizer and an output that left its grammar are refused or failed alone, with the
leak check after each.

The tiny random model is loaded from a directory with a real byte-level fast tokenizer
(``tiny_model_dir``): one token per byte, so a grammar constrains every character.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.grammar import choices_spec, grammar_of
from engine.types import FinishReason, GuideKind, RequestSpec, SamplingParams, StructuredOutput
from tests.conftest import assert_no_leaks
from tests.test_engine_exact import CONFIGS

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
GUIDES = {
    "json": StructuredOutput(GuideKind.JSON, json.dumps(SCHEMA)),
    "json_object": StructuredOutput(GuideKind.JSON_OBJECT),
    "regex": StructuredOutput(GuideKind.REGEX, r"[a-z]{2,5}@[a-z]{3}\.(com|org)"),
    "choice": StructuredOutput(GuideKind.CHOICE, choices_spec(["yes", "no", "maybe not"])),
    "lark": StructuredOutput(GuideKind.GRAMMAR, 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'),
    "gbnf": StructuredOutput(GuideKind.GRAMMAR, 'root ::= "a" [b-d]+ "e"'),
}
WHOLE = {   # what a finished (EOS) output must be, as text
    "json": lambda t: set(json.loads(t)) == {"name", "n"},
    "json_object": lambda t: isinstance(json.loads(t), dict),
    "regex": lambda t: re.fullmatch(r"[a-z]{2,5}@[a-z]{3}\.(com|org)", t) is not None,
    "choice": lambda t: t in ("yes", "no", "maybe not"),
    "lark": lambda t: re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", t) is not None,
    "gbnf": lambda t: re.fullmatch(r"a[b-d]+e", t) is not None,
}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from engine.model_loader import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def ll_tokenizer(loaded):
    return llguidance.hf.from_tokenizer(loaded.tokenizer, n_vocab=loaded.model.config.vocab_size, eos_token=[EOS])


class GrammarReference(LogitsProcessor):
    """HF's side: llguidance's mask after the tokens generated so far, written independently of
    the engine's matcher (only the grammar's compilation is shared)."""

    def __init__(self, ll_tokenizer, guide: StructuredOutput, prompt_len: int) -> None:
        self.matcher = llguidance.LLMatcher(ll_tokenizer, grammar_of(guide), log_level=0)
        self.prompt_len, self.seen = prompt_len, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.prompt_len:].tolist()
        assert self.matcher.consume_tokens(out[self.seen:])
        self.seen = len(out)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        return scores.masked_fill(torch.from_numpy(bits[: scores.shape[-1]] == 0), float("-inf"))


def hf_guided(model, ll_tokenizer, prompt: list[int], guide: StructuredOutput, max_new_tokens: int,
              **generate_kwargs) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                         logits_processor=LogitsProcessorList([GrammarReference(ll_tokenizer, guide, len(prompt))]),
                         **generate_kwargs)
    return out[0, len(prompt):].tolist()


def run(engine: LLMEngine, specs: list[RequestSpec]) -> dict[str, tuple[list[int], FinishReason, str | None]]:
    """Requests arriving one every other step; each one's tokens, finish reason and error."""
    specs, got, step = list(specs), {}, 0
    while specs or engine.has_work():
        if specs and step % 2 == 0:
            spec = specs.pop(0)
            engine.add_request(spec)
            got[spec.req_id] = ([], None, None)
        for d in engine.step().deltas:
            tokens, _, _ = got[d.req_id]
            got[d.req_id] = (tokens + list(d.token_ids), d.finish_reason, d.error)
            if d.error_field:
                engine_fields[d.req_id] = d.error_field
        step += 1
    return got


engine_fields: dict[str, str] = {}   # req_id -> its failure's error_field, from every run()


def text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t != EOS])


@pytest.mark.parametrize("config", ["default", "chunked", "preempt"])
def test_every_kind_of_guide_equals_hf_with_the_same_grammar(loaded, hf_reference, ll_tokenizer, config):
    rng = random.Random(7)
    specs, refs = [], {}
    for i, (name, guide) in enumerate(list(GUIDES.items()) * 2):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 40))]
        spec = RequestSpec(f"{name}-{i}", tuple(prompt), SamplingParams(max_tokens=30, structured_output=guide))
        specs.append(spec)
        refs[spec.req_id] = hf_guided(hf_reference, ll_tokenizer, prompt, guide, 30)
    engine = LLMEngine(loaded, CONFIGS[config])
    got = run(engine, specs)
    for spec in specs:
        tokens, reason, error = got[spec.req_id]
        assert error is None and tokens == refs[spec.req_id], f"{spec.req_id} under {config}"
        name = spec.req_id.rsplit("-", 1)[0]
        if reason is FinishReason.STOP:   # ended on EOS: the grammar allowed it, so a whole match
            assert tokens[-1] == EOS and WHOLE[name](text(loaded.tokenizer, tokens)), spec.req_id
    assert sum(got[s.req_id][1] is FinishReason.STOP for s in specs) >= 6   # most guides end on their own
    if config == "preempt":
        assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_sampled_outputs_end_in_whole_matches(loaded):
    """Temperature 1.5, 40 seeds a guide: whatever is drawn, an output that ends ends whole."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=256))
    names = ["choice", "regex", "gbnf", "lark"]
    specs = [RequestSpec(f"{name}-{seed}", (5, 6, 7), SamplingParams(max_tokens=40, temperature=1.5, seed=seed,
                                                                     structured_output=GUIDES[name]))
             for name in names for seed in range(40)]
    got = run(engine, specs)
    ended = [(s.req_id, got[s.req_id][0]) for s in specs if got[s.req_id][1] is FinishReason.STOP]
    assert len(ended) >= 100 and {rid.rsplit("-", 1)[0] for rid, _ in ended} == set(names)
    for req_id, tokens in ended:
        assert WHOLE[req_id.rsplit("-", 1)[0]](text(loaded.tokenizer, tokens)), (req_id, tokens)
    assert len({tuple(got[f"choice-{seed}"][0]) for seed in range(40)}) == 3   # sampling still samples
    assert_no_leaks(engine)


def test_ignore_eos_ends_a_guided_request_where_its_grammar_ends(loaded):
    """Found by a probe: with ``ignore_eos`` a guided request went on past the EOS its grammar
    allowed only at a whole match and failed ("the output left its grammar"); now the grammar's
    end is the request's (STOP, a whole match), sampled or greedy; an unguided one beside it
    still ignores EOS to its length."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=256))
    names = ["choice", "regex", "gbnf", "json"]
    specs = [RequestSpec(f"{name}-{seed}", (5, 6, 7), SamplingParams(
        max_tokens=200, ignore_eos=True, temperature=1.5 if seed else 0.0, seed=seed, structured_output=GUIDES[name]))
        for name in names for seed in range(6)]
    specs.append(RequestSpec("plain", (5, 6, 7), SamplingParams(max_tokens=30, ignore_eos=True)))
    got = run(engine, specs)
    for spec in specs[:-1]:
        name = spec.req_id.rsplit("-", 1)[0]
        tokens, finish, error = got[spec.req_id]
        # choice and regex are bounded (<= 15 characters); gbnf's and json's may run to the length
        assert finish in ((FinishReason.STOP,) if name in ("choice", "regex") else (FinishReason.STOP, FinishReason.LENGTH))
        assert error is None, (spec.req_id, finish, error)
        if finish is FinishReason.STOP:
            assert tokens[-1] == EOS and WHOLE[name](text(loaded.tokenizer, tokens)), spec.req_id
    assert sum(got[s.req_id][1] is FinishReason.STOP for s in specs[:-1]) >= 14
    assert got["plain"][1] is FinishReason.LENGTH and len(got["plain"][0]) == 30
    assert_no_leaks(engine)


TRICKY_CHOICES = ["a.b", "a*", "(x|y)", "\\d", "[1-2]", "^$", "#&-~", "naïve ☃", "a b\n", "{3}", "a", "ab", "?+"]


def test_a_choice_list_matches_exactly_its_strings_any_number_of_them(loaded, ll_tokenizer):
    """Each choice is a literal (regex characters in it mean themselves), a prefix of another
    choice is a whole match too, and lists past llguidance's 2,000 items per parser row work
    (found by a probe: 8,000 choices failed at the first token, "the output left its grammar")."""
    many = TRICKY_CHOICES + [f"option-{i}" for i in range(8000)]
    guide = StructuredOutput(GuideKind.CHOICE, choices_spec(many))
    enc = lambda t: loaded.tokenizer.encode(t, add_special_tokens=False)   # noqa: E731
    for choice in TRICKY_CHOICES + ["option-0", "option-7999"]:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar_of(guide), log_level=0)
        assert matcher.consume_tokens(enc(choice)) and matcher.is_accepting(), (choice, matcher.get_error())
    for other in ["a.c", "ax", "x", "\\", "option-8000", "naïve"]:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar_of(guide), log_level=0)
        assert not (matcher.consume_tokens(enc(other)) and matcher.is_accepting()), other
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    specs = [RequestSpec(f"c{seed}", (5, 6, 7), SamplingParams(max_tokens=40, temperature=1.5, seed=seed,
                                                               structured_output=guide)) for seed in range(4)]
    got = run(engine, specs)
    for spec in specs:
        tokens, finish, error = got[spec.req_id]
        assert finish is FinishReason.STOP and error is None, (finish, error)
        assert text(loaded.tokenizer, tokens) in many
    assert_no_leaks(engine)


def test_a_migrated_request_continues_its_grammar(loaded, hf_reference, ll_tokenizer):
    """Resumed elsewhere with its streamed tokens appended to its prompt (``num_generated``), a
    request's matcher takes them first: the rest is what it would have output unmoved."""
    guide, prompt = GUIDES["json"], [9, 40, 41, 42]
    ref = hf_guided(hf_reference, ll_tokenizer, prompt, guide, 30)
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    for moved in (1, 5, 11):
        spec = RequestSpec(f"m{moved}", tuple(prompt + ref[:moved]),
                           SamplingParams(max_tokens=30 - moved, structured_output=guide), num_generated=moved)
        assert run(engine, [spec])[spec.req_id][0] == ref[moved:]
    assert_no_leaks(engine)


def test_an_output_that_left_its_grammar_fails_alone(loaded):
    """Streamed tokens the grammar never allowed (here forged; never made by a worker, whose masks
    keep them inside) fail that request with a message; its batch goes on."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    forged = RequestSpec("forged", (5, 6, 3 + ord("x")), SamplingParams(max_tokens=8, structured_output=GUIDES["choice"]),
                         num_generated=1)
    fine = RequestSpec("fine", (5, 6), SamplingParams(max_tokens=8, structured_output=GUIDES["choice"]))
    got = run(engine, [forged, fine])
    assert got["forged"][1] is FinishReason.ERROR and "grammar" in got["forged"][2]
    assert engine_fields["forged"] == "structured_output"
    assert got["fine"][1] is FinishReason.STOP and text(loaded.tokenizer, got["fine"][0]) in ("yes", "no", "maybe not")
    assert_no_leaks(engine)


@pytest.mark.parametrize("other, blamed", [
    (dict(bad_words_token_ids=((3 + ord("y"),), (3 + ord("n"),))), "structured_output"),
    (dict(min_tokens=12), "structured_output"),   # every choice ends before 12 tokens: EOS held, nothing else left
    (dict(allowed_token_ids=(3 + ord("q"), 3 + ord("r"))), "structured_output"),
])
def test_constraints_that_leave_a_guided_request_nothing_fail_it_naming_its_grammar(loaded, other, blamed):
    """A grammar plus bad words, min_tokens or allowed_token_ids that rule out every token at some
    step: that request fails with error_field naming what to fix (INVALID_ARGUMENT at the router),
    never a token outside its grammar; a bad-words ban that leaves one path takes that path."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    guide = StructuredOutput(GuideKind.CHOICE, choices_spec(["yes", "no"]))
    stuck = RequestSpec("stuck", (5, 6), SamplingParams(max_tokens=16, structured_output=guide, **other))
    detour = RequestSpec("detour", (5, 6), SamplingParams(max_tokens=16, structured_output=GUIDES["choice"],
                                                          bad_words_token_ids=((3 + ord("y"),),)))   # "no" is left
    got = run(engine, [stuck, detour])
    assert got["stuck"][1] is FinishReason.ERROR and engine_fields["stuck"] == blamed and "ruled out" in got["stuck"][2]
    assert text(loaded.tokenizer, got["detour"][0]) == "no" and got["detour"][1] is FinishReason.STOP
    assert_no_leaks(engine)


@pytest.mark.parametrize("guide, says", [
    (StructuredOutput(GuideKind.JSON, "not json"), "json"),
    (StructuredOutput(GuideKind.JSON, "[1, 2]"), "object"),
    (StructuredOutput(GuideKind.JSON, ""), "empty"),
    (StructuredOutput(GuideKind.JSON_OBJECT, "{}"), "no spec"),
    (StructuredOutput(GuideKind.CHOICE, "[]"), "choices"),
    (StructuredOutput(GuideKind.CHOICE, '["a", ""]'), "choices"),
    (StructuredOutput(GuideKind.CHOICE, '"a"'), "choices"),
    (StructuredOutput(GuideKind.GRAMMAR, "root ::= ["), "grammar"),
])
def test_text_that_is_no_grammar_is_refused_on_add_naming_the_field(loaded, guide, says):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=16))
    for call in (engine.add_request, engine.reserve):
        with pytest.raises(InvalidRequestError) as err:
            call(RequestSpec("bad", (5, 6), SamplingParams(structured_output=guide)))
        assert err.value.field == "structured_output" and says in str(err.value).lower()
    assert_no_leaks(engine)
    assert not engine._seeds


@pytest.mark.parametrize("guide, says", [
    (StructuredOutput(GuideKind.JSON, '{"type": "objectx"}'), "objectx"),
    (StructuredOutput(GuideKind.REGEX, "a(b"), "unclosed group"),
    (StructuredOutput(GuideKind.GRAMMAR, "start: foo"), "foo"),
])
def test_a_grammar_the_compiler_refuses_fails_its_request_naming_the_field(loaded, guide, says):
    """The compile runs off the step thread, so its verdict comes at the request's first sampling
    (the router refuses these before any worker sees them: ``grammar.check``): the request fails
    with ``error_field`` naming its structured output and llguidance's reason; a request beside it
    goes on."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=16))
    bad = RequestSpec("bad", (5, 6, 7), SamplingParams(structured_output=guide))
    fine = RequestSpec("fine", (5, 6), SamplingParams(max_tokens=4, ignore_eos=True))
    got = run(engine, [bad, fine])
    assert got["bad"][1] is FinishReason.ERROR and engine_fields["bad"] == "structured_output"
    assert says in got["bad"][2].lower() and got["bad"][0] == []
    assert got["fine"][1] is FinishReason.LENGTH and len(got["fine"][0]) == 4
    assert_no_leaks(engine)


def test_a_model_without_a_tokenizer_refuses_a_guide(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=16))
    for call in (engine.add_request, engine.reserve):
        with pytest.raises(InvalidRequestError) as err:
            call(RequestSpec("g", (5, 6), SamplingParams(structured_output=GUIDES["regex"])))
        assert err.value.field == "structured_output" and "tokenizer" in str(err.value)
    assert_no_leaks(engine)
    assert not engine._seeds


def test_a_guide_survives_the_direct_submissions_json():
    """A prefill worker on the router's node gets the request as JSON (``PrefillSubmission``): its
    first token needs the same grammar; no guide stays no guide."""
    from engine.types import PrefillSubmission

    for guide in [*GUIDES.values(), None]:
        spec = RequestSpec("j", (5, 6, 7), SamplingParams(max_tokens=3, structured_output=guide))
        assert PrefillSubmission.from_json(PrefillSubmission(spec, "shm", "d0", None).to_json()).spec == spec


@pytest.fixture
def gated_compiles(monkeypatch):
    """Every grammar compile waits for the returned event (set it to let them finish)."""
    from engine.grammar import Grammars

    gate, compile_now = threading.Event(), Grammars._compile

    def compile_later(self, grammar):
        assert gate.wait(30), "the test never opened the gate"
        return compile_now(self, grammar)

    monkeypatch.setattr(Grammars, "_compile", compile_later)
    yield gate
    gate.set()


def test_a_grammar_still_compiling_holds_no_one_up_and_its_prompt_waits_at_its_last_token(
        loaded, hf_reference, ll_tokenizer, gated_compiles):
    """The compile runs off the step loop: while it lasts, the other requests step on and the
    guided one's prompt is computed but its last token (whose logits need the matcher); once it is
    ready, the guided output is HF's, as if it had been there from the start."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16))
    prompt, guide = list(range(40, 80)), GUIDES["json"]
    engine.add_request(RequestSpec("guided", tuple(prompt), SamplingParams(max_tokens=30, structured_output=guide)))
    engine.add_request(RequestSpec("plain", (5, 6, 7), SamplingParams(max_tokens=8, ignore_eos=True)))
    got: dict[str, list[int]] = {"guided": [], "plain": []}
    for _ in range(12):
        for d in engine.step().deltas:
            got[d.req_id] += d.token_ids
    guided = engine.scheduler.requests["guided"]
    assert got["plain"] and len(got["plain"]) == 8 and got["guided"] == []
    assert guided.num_computed_tokens == len(prompt) - 1
    gated_compiles.set()
    while engine.has_work():
        for d in engine.step().deltas:
            got[d.req_id] += d.token_ids
    assert got["guided"] == hf_guided(hf_reference, ll_tokenizer, prompt, guide, 30)
    assert_no_leaks(engine)


def test_a_request_aborted_while_its_grammar_compiles_frees_everything_and_the_compile_ends_harmlessly(
        loaded, hf_reference, ll_tokenizer, gated_compiles):
    """The client leaves (or its worker's request is moved) before the compile is done: the abort
    frees its blocks at once; the compile's late end touches nothing; a request with the same grammar
    afterwards is served exactly."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16))
    prompt, guide = list(range(40, 80)), GUIDES["json"]
    engine.add_request(RequestSpec("leaving", tuple(prompt), SamplingParams(max_tokens=30, structured_output=guide)))
    for _ in range(4):
        assert engine.step().deltas == []
    engine.abort("leaving")   # at the next step boundary, as any running request's
    assert [(d.req_id, d.finish_reason) for d in engine.step().deltas] == [("leaving", FinishReason.ABORT)]
    assert_no_leaks(engine)
    gated_compiles.set()
    time.sleep(0.2)   # the compile ends, its callback fires with no request left
    engine.add_request(RequestSpec("next", tuple(prompt), SamplingParams(max_tokens=30, structured_output=guide)))
    got = []
    while engine.has_work():
        got += [t for d in engine.step().deltas for t in d.token_ids]
    assert got == hf_guided(hf_reference, ll_tokenizer, prompt, guide, 30)
    assert_no_leaks(engine)


def test_an_engine_loop_waiting_on_a_compile_does_not_spin_and_wakes_when_it_ends(loaded, gated_compiles,
                                                                                   monkeypatch):
    """While the only request's grammar compiles, the loop waits (a step or two, not thousands); the
    compile's end wakes it at once (its longest wait stretched to 2 s here: only the wake-up is quick)."""
    from engine import loop as engine_loop
    from engine.loop import EngineLoop

    monkeypatch.setattr(engine_loop, "STALLED_WAIT_S", 2.0)
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    steps, ended = [], threading.Event()

    def on_step(result):
        steps.append(time.monotonic())
        if any(d.finished for d in result.deltas):
            ended.set()

    loop = EngineLoop(engine, on_step)
    loop.start()
    try:
        loop.call(lambda e: e.add_request(RequestSpec("g", (5, 6), SamplingParams(
            max_tokens=4, structured_output=GUIDES["choice"])))).result(10)
        time.sleep(0.5)
        assert len(steps) <= 3, f"{len(steps)} steps in 0.5 s: the loop spun"
        opened = time.monotonic()
        gated_compiles.set()
        assert ended.wait(10)
        first_after = next(t for t in steps if t >= opened)
        assert first_after - opened < 0.5, "the compile's end did not wake the loop"
    finally:
        loop.stop()
    assert_no_leaks(engine)
