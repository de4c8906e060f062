"""Scheduler scripted step by step with fake sampled tokens (no model): budget, chunking,
decode-first, priority, preemption, abort and stop conditions. Each ends with a leak check."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, EngineRole
from engine.kv_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.stop import StopChecker
from engine.types import FinishReason, RequestSpec, SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=8, role=EngineRole.COLOCATED, tokenizer=None):
    config = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs, role=role)
    return Scheduler(config, KVCacheManager(num_blocks, block_size), StopChecker((EOS,), 128, tokenizer))


def req(req_id, prompt_len, max_tokens=4, priority=0, arrival=0.0, **sampling):
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return Request(RequestSpec(req_id, tuple(range(10, 10 + prompt_len)), params, priority=priority, arrival_s=arrival))


def step(s: Scheduler, token=7):
    out, aborted = s.schedule()
    sampled = {x.request.req_id: (token, None) for x in out.scheduled if x.sample}
    finished = s.update_from_output(out, sampled)
    return {x.request.req_id: x.num_new_tokens for x in out.scheduled}, finished, out, aborted


def drain(s: Scheduler, limit=200):
    for _ in range(limit):
        if not (s.waiting or s.running or s._pending_aborts):
            return
        step(s)
    raise AssertionError("scheduler did not drain")


def assert_empty(s: Scheduler):
    assert s.num_unfinished == 0 and not s.requests
    assert s.kv.num_free_blocks == s.kv.num_total_blocks and not s.kv.block_tables


def test_token_budget_and_chunked_prefill():
    s = make_scheduler(budget=16)
    s.add(req("a", 40))
    plan, *_ = step(s)
    assert plan == {"a": 16}
    plan, *_ = step(s)
    assert plan == {"a": 16}
    plan, finished, out, _ = step(s)
    assert plan == {"a": 8} and out.scheduled[0].sample  # the last chunk samples the first token
    assert s.requests["a"].output_token_ids == [7]
    drain(s)
    assert_empty(s)


def test_running_decodes_before_waiting_prefills():
    s = make_scheduler(budget=16)
    s.add(req("a", 8, max_tokens=10))
    step(s)
    s.add(req("b", 30))
    plan, *_ = step(s)
    assert plan == {"a": 1, "b": 15}, "decode first, then the new prompt fills the rest of the budget"
    drain(s)
    assert_empty(s)


def test_max_num_seqs_limits_admission():
    s = make_scheduler(budget=64, max_seqs=2)
    for name in "abc":
        s.add(req(name, 4))
    plan, *_ = step(s)
    assert set(plan) == {"a", "b"}
    drain(s)
    assert_empty(s)


def test_priority_orders_waiting_queue():
    s = make_scheduler(budget=4)
    s.add(req("low", 4, priority=5, arrival=0.0))
    s.add(req("high", 4, priority=0, arrival=1.0))
    plan, *_ = step(s)
    assert plan == {"high": 4}
    drain(s)
    assert_empty(s)


def test_preemption_by_recompute_when_blocks_run_out():
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    s.add(req("a", 8, max_tokens=8, arrival=0.0))
    s.add(req("b", 8, max_tokens=8, arrival=1.0))
    step(s)                      # both prefilled: 2 blocks each, pool full
    plan, _, out, _ = step(s)    # each decode needs a third block: the latest arrival is preempted
    assert out.preempted_req_ids == ["b"] and plan == {"a": 1}
    b = s.requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.output_token_ids == [7]
    drain(s)
    assert b.num_preemptions >= 1 and len(b.output_token_ids) == 8
    assert_empty(s)


def test_abort_frees_blocks_at_next_step_boundary():
    s = make_scheduler()
    s.add(req("a", 10, max_tokens=50))
    s.add(req("w", 10, max_tokens=50))
    step(s)
    s.abort("a")
    assert s.kv.block_tables.get("a"), "abort waits for the step boundary"
    _, _, _, aborted = step(s)
    assert [r.req_id for r in aborted] == ["a"] and aborted[0].finish_reason is FinishReason.ABORT
    assert "a" not in s.kv.block_tables
    s.abort("w")
    step(s)
    s.abort("unknown")           # unknown ids are ignored
    drain(s)
    assert_empty(s)


@pytest.mark.parametrize(
    "sampling, token, reason, num_out",
    [
        ({"max_tokens": 3}, 7, FinishReason.LENGTH, 3),
        ({"max_tokens": 9}, EOS, FinishReason.STOP, 1),
        ({"max_tokens": 9, "ignore_eos": True}, EOS, FinishReason.LENGTH, 9),
        ({"max_tokens": 9, "stop_token_ids": (7,)}, 7, FinishReason.STOP, 1),
    ],
)
def test_stop_conditions(sampling, token, reason, num_out):
    s = make_scheduler()
    s.add(req("a", 5, **sampling))
    finished = []
    while not finished:
        _, finished, *_ = step(s, token=token)
    assert finished[0].finish_reason is reason and len(finished[0].output_token_ids) == num_out
    assert_empty(s)


def test_model_max_length_stops_generation():
    s = make_scheduler(num_blocks=64)
    s.stop.max_model_len = 12
    s.add(req("a", 10, max_tokens=50))
    drain(s)
    assert_empty(s)


class _CharTokenizer:
    """Fake tokenizer for the stop-string check: token id i decodes to chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _feed_until_finished(s, token_ids) -> list:
    """Step ``s``, sampling ``token_ids`` in order, until a request finishes: the finished ones."""
    tokens = iter(token_ids)
    finished = []
    while not finished:
        out, _ = s.schedule()
        sampled = {x.request.req_id: (next(tokens), None) for x in out.scheduled if x.sample}
        finished = s.update_from_output(out, sampled)
    return finished


def test_stop_string():
    s = make_scheduler(tokenizer=_CharTokenizer())
    s.add(req("a", 3, max_tokens=20, stop=("cd",)))
    finished = _feed_until_finished(s, [ord(c) for c in "abcdef"])
    assert finished[0].finish_reason is FinishReason.STOP
    assert bytes(finished[0].output_token_ids).decode() == "abcd"
    assert_empty(s)


@pytest.mark.parametrize("min_tokens, text, out, reason", [
    (2, "cdxcdy", "cdxcd", FinishReason.STOP),    # completed by tokens 2 (within min_tokens) and 5: 5 stops it
    (1, "cdxx", "cd", FinishReason.STOP),         # begun within min_tokens, completed after: it counts
    (4, "cdcdx", "cdcdx", FinishReason.LENGTH),   # each completed within min_tokens: none counts
])
def test_stop_strings_count_from_the_token_after_min_tokens(min_tokens, text, out, reason):
    s = make_scheduler(tokenizer=_CharTokenizer())
    s.add(req("a", 3, max_tokens=len(text) if reason is FinishReason.LENGTH else 20, stop=("cd",),
              min_tokens=min_tokens))
    finished = _feed_until_finished(s, [ord(c) for c in text])
    assert bytes(finished[0].output_token_ids).decode() == out and finished[0].finish_reason is reason
    assert_empty(s)


class _ByteLevelTokenizer:
    """Fake byte-level tokenizer: token id i is the byte i, so one character may take up to four
    tokens, as in GPT-2-style BPE (SmolLM2 splits "😀" into 3 tokens, each decoding to U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop, text", [("😀", "ab😀cd"), ("中", "x中y"), ("é!", "caté!zz"), ("a😀", "ba😀c")])
def test_stop_string_spread_over_more_tokens_than_characters(stop, text):
    """The check decodes a tail window of the output; that window must hold the stop string's
    UTF-8 bytes, not just as many tokens as it has characters (a 1-character emoji is 4 bytes)."""
    s = make_scheduler(tokenizer=_ByteLevelTokenizer())
    s.add(req("a", 3, max_tokens=20, stop=(stop,)))
    finished = _feed_until_finished(s, text.encode("utf-8"))
    assert finished[0].finish_reason is FinishReason.STOP
    assert bytes(finished[0].output_token_ids).decode() == text[:text.index(stop) + len(stop)]
    assert_empty(s)


def _sentencepiece_tokenizer():
    """A real HF fast tokenizer with SentencePiece's (Llama's) word-leading-space rule, built
    locally: "▁Paris" decodes to "Paris" at the start of a text and to " Paris" after a word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "▁The", "▁capital", "▁is", "▁Paris", ".", "▁Par", "is", "▁a", "▁city"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("stop, output, num_out", [
    (" Paris", ["▁Paris", ".", "▁a"], 1),                      # the very first generated token
    (" Paris", ["▁a", "▁city", "▁Paris", "."], 3),            # later: the window had context already
    ("is Paris", ["▁Paris", "."], None),                      # across the prompt: not the output's text
    (" Par", ["▁Par", "is", "."], 1),
])
def test_stop_string_with_a_sentencepiece_leading_space(stop, output, num_out):
    """The output's text is decoded with the prompt before it (the router's detokenizer does,
    and so does vLLM): a first token "▁Paris" is " Paris" there. The engine's stop check must
    see the same text, or a stop string the client sees is missed at the first token. A match
    must still lie in the output alone."""
    tokenizer = _sentencepiece_tokenizer()
    s = make_scheduler(tokenizer=tokenizer)
    prompt = tuple(tokenizer.convert_tokens_to_ids(["▁The", "▁capital", "▁is"]))
    s.add(Request(RequestSpec("a", prompt, SamplingParams(max_tokens=len(output), stop=(stop,)))))
    finished = _feed_until_finished(s, tokenizer.convert_tokens_to_ids(output))
    expected = FinishReason.STOP if num_out else FinishReason.LENGTH
    assert finished[0].finish_reason is expected
    assert len(finished[0].output_token_ids) == (num_out or len(output))
    assert_empty(s)


def test_prefill_role_holds_blocks_until_released():
    s = make_scheduler(role=EngineRole.PREFILL)
    s.add(req("a", 10, max_tokens=5))
    _, finished, *_ = step(s)
    assert finished[0].req_id == "a" and "a" in s.held
    assert s.kv.block_tables["a"], "blocks stay allocated for export"
    s.release_held("a")
    assert_empty(s)


def test_decode_role_parks_until_kv_lands():
    s = make_scheduler(role=EngineRole.DECODE)
    blocks = s.park(req("a", 10, max_tokens=3))
    assert len(blocks) == 3
    plan, *_ = step(s)
    assert plan == {}, "a parked request does not run"
    s.unpark("a", 7)
    plan, *_ = step(s)
    assert plan == {"a": 1}
    drain(s)
    assert_empty(s)


def test_a_preempted_request_is_readmitted_whole_and_does_not_hold_up_the_line():
    """Found by a probe (5 frozen readers' long streams outgrowing the decode pool): a preempted
    request re-admitted with its first chunk alone was the newest running one again, so its own
    next chunk preempted it, forever, at the head of the line; short requests queued behind it
    stalled for thousands of steps while it recomputed millions of tokens. Now it comes back with
    room for all it recomputes, and the requests behind it go first while that room is not there."""
    s = make_scheduler(num_blocks=40, block_size=4, budget=8, max_seqs=8)
    longs = [Request(RequestSpec(f"long{i}", tuple(range(10 + 10 * i, 14 + 10 * i)), SamplingParams(max_tokens=100),
                                 arrival_s=float(i))) for i in range(5)]   # 5 x (4 + 100) tokens: three pools
    for r in longs:
        s.add(r)
    while s.kv.num_free_blocks > 2:
        step(s)
    shorts = [Request(RequestSpec(f"short{j}", (60 + j, 61 + j), SamplingParams(max_tokens=4), arrival_s=10.0 + j))
              for j in range(2)]
    for r in shorts:
        s.add(r)
    for num_steps in range(1, 1000):
        step(s)
        if all(r.status is RequestStatus.FINISHED for r in shorts):
            break
    # Measured: 12 steps and 4 preemptions until the shorts ended, 14 in all (was 164, 29, 30).
    assert num_steps <= 30, f"short requests waited {num_steps} steps behind a preempted one"
    assert s.num_preemptions <= 8, f"{s.num_preemptions} preemptions before the short requests ended"
    drain(s, limit=5000)
    assert s.num_preemptions <= 20
    assert all(len(r.output_token_ids) == 100 for r in longs), "every preempted request still ends whole"
    assert_empty(s)
