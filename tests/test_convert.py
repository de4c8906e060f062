"""router.convert: validation (table-driven), explicit defaults, response building, incremental
detokenization on a real byte-level BPE, and the router's torch-free import."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.types import FinishReason, SamplingParams, TokenDelta, WorkerStats
from protos import pdserve_pb2 as pb
from router.limits import SchedulingPolicy, ServerLimits
from router.client import build_request
from router.convert import (
    IncrementalDetokenizer,
    RequestTimings,
    ServerDefaults,
    Usage,
    delta_to_proto,
    finish_reason_from_proto,
    finish_reason_to_proto,
    prompt_from_proto,
    req_id_from_proto,
    sampling_from_proto,
    server_info_to_proto,
    spec_from_proto,
    timings_from_proto,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = ServerDefaults(max_model_len=32, vocab_size=100, max_tokens=8)
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE built in memory: every byte is a token, so "é" (2 bytes) and
    "😀" (4 bytes) each span several tokens, exactly the case incremental decoding must handle."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", chat_template=CHAT_TEMPLATE)


def spec(defaults=DEFAULTS, **kwargs):
    """Validate a request with a token-id prompt (default [1, 2, 3]) through the real path."""
    kwargs.setdefault("token_ids", [1, 2, 3])
    req = build_request(**kwargs)
    return spec_from_proto(req, prompt_from_proto(req, tokenizer=None), defaults, req_id_from_proto(req))


# ---------------------------------------------------------------- validation

BAD_REQUESTS = [
    # (what, build_request kwargs, field named in the error)
    ("empty token prompt", dict(token_ids=[]), "token_ids"),
    ("prompt fills the model", dict(token_ids=[1] * 32), "token_ids"),
    ("token id negative", dict(token_ids=[1, -1]), "token_ids"),
    ("token id == vocab", dict(token_ids=[1, 100]), "token_ids"),
    ("max_tokens 0", dict(max_tokens=0), "sampling.max_tokens"),
    ("max_tokens negative", dict(max_tokens=-3), "sampling.max_tokens"),
    ("max_tokens past the model", dict(token_ids=[1] * 30, max_tokens=3), "sampling.max_tokens"),
    ("temperature negative", dict(temperature=-0.1), "sampling.temperature"),
    ("temperature NaN", dict(temperature=math.nan), "sampling.temperature"),
    ("temperature inf", dict(temperature=math.inf), "sampling.temperature"),
    ("top_p 0", dict(top_p=0.0), "sampling.top_p"),
    ("top_p above 1", dict(top_p=1.5), "sampling.top_p"),
    ("top_p NaN", dict(top_p=math.nan), "sampling.top_p"),
    ("top_k negative", dict(top_k=-1), "sampling.top_k"),
    ("stop string empty", dict(stop=["ok", ""]), "sampling.stop"),
    ("stop token outside vocab", dict(stop_token_ids=[100]), "sampling.stop_token_ids"),
    ("ttft hint zero", dict(ttft_ms=0.0), "ttft_ms"),
    ("ttft hint negative", dict(ttft_ms=-5.0), "ttft_ms"),
    ("tpot hint zero", dict(tpot_ms=0.0), "tpot_ms"),
    ("request id empty", dict(request_id=""), "request_id"),
    ("request id with a newline", dict(request_id="a\nforged log line"), "request_id"),
    ("request id with a NUL", dict(request_id="a\x00"), "request_id"),
    ("chat without messages", dict(token_ids=None, chat=[]), "chat.messages"),
    ("chat empty role", dict(token_ids=None, chat=[("", "hi")]), "chat.messages[0].role"),
    ("chat unknown role", dict(token_ids=None, chat=[("user", "hi"), ("wizard", "hi")]), "chat.messages[1].role"),
    ("chat missing content", dict(token_ids=None, chat=[{"role": "user"}]), "chat.messages[0].content"),
    ("empty text", dict(token_ids=None, text=""), "text"),
]


@pytest.mark.parametrize("kwargs, field", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_names_its_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        spec(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_max_tokens_beyond_model_length_message():
    with pytest.raises(InvalidRequestError, match="prompt tokens \\+ .* to generate exceed max_model_len"):
        spec(token_ids=[1] * 30, max_tokens=3)


def test_no_prompt_at_all():
    with pytest.raises(InvalidRequestError) as info:
        prompt_from_proto(pb.GenerateRequest(), tokenizer=None)
    assert info.value.field == "prompt"


def test_bad_request_is_a_value_error():
    with pytest.raises(ValueError):
        spec(top_k=-1)


# ---------------------------------------------------------------- defaults


def test_unset_fields_take_server_defaults():
    s = spec()
    assert s.sampling == SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0)
    assert s.slo.ttft_s is None and s.slo.tpot_s is None
    assert s.priority == 0 and s.prompt_token_ids == (1, 2, 3)
    assert len(s.req_id) == 32  # server-made uuid hex


def test_explicit_zero_temperature_is_not_unset():
    sampling_defaults = dataclasses.replace(DEFAULTS, temperature=0.8)
    assert sampling_from_proto(pb.SamplingParams(), sampling_defaults).temperature == 0.8
    greedy = sampling_from_proto(pb.SamplingParams(temperature=0.0), sampling_defaults)
    assert greedy.temperature == 0.0 and greedy.greedy


def test_explicit_values_are_kept():
    # Priority is honoured only under the priority scheduling policy (router/limits.py).
    limits = ServerLimits(scheduling_policy=SchedulingPolicy.PRIORITY, min_priority=-5, max_priority=5)
    s = spec(dataclasses.replace(DEFAULTS, limits=limits), request_id="r1", max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, stop="\n",
             stop_token_ids=[7], ignore_eos=True, logprobs=True, ttft_ms=250, tpot_ms=50, priority=-2)
    assert s.req_id == "r1" and s.priority == -2
    assert s.sampling == SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, stop=("\n",),
                                        stop_token_ids=(7,), ignore_eos=True, logprobs=True)
    assert s.slo.ttft_s == pytest.approx(0.25) and s.slo.tpot_s == pytest.approx(0.05)


def test_default_max_tokens_shrinks_to_fit_but_explicit_does_not():
    assert spec(token_ids=[1] * 28).sampling.max_tokens == 4  # 32 - 28, not the default 8
    assert spec(token_ids=[1] * 28, max_tokens=4).sampling.max_tokens == 4
    with pytest.raises(InvalidRequestError):
        spec(token_ids=[1] * 28, max_tokens=5)


def test_server_slo_defaults_apply_when_hints_unset():
    req = build_request(token_ids=[1], tpot_ms=20)
    s = spec_from_proto(req, [1], dataclasses.replace(DEFAULTS, ttft_s=0.5, tpot_s=0.1), "r")
    assert s.slo.ttft_s == 0.5 and s.slo.tpot_s == pytest.approx(0.02)


# ---------------------------------------------------------------- prompts through a tokenizer


def test_text_prompt_uses_encode(tokenizer):
    req = build_request(text="hello café")
    assert prompt_from_proto(req, tokenizer) == tokenizer.encode("hello café")


def test_chat_prompt_uses_chat_template_with_generation_prompt(tokenizer):
    req = build_request(chat=[{"role": "system", "content": "be brief"}, ("user", "hi")])
    ids = prompt_from_proto(req, tokenizer)
    assert tokenizer.decode(ids) == "<system>be brief<user>hi<assistant>"


def test_chat_template_options_reach_the_template(tokenizer):
    """add_generation_prompt false closes no turn; continue_final_message leaves the last message
    open (transformers cuts the render after its content); template variables are the template's."""
    chat = [("user", "hi"), ("assistant", "hel")]
    closed = build_request(chat=chat)
    closed.chat.add_generation_prompt = False
    assert tokenizer.decode(prompt_from_proto(closed, tokenizer)) == "<user>hi<assistant>hel"
    cont = build_request(chat=chat)
    cont.chat.continue_final_message = True   # add_generation_prompt unset: off with it
    assert tokenizer.decode(prompt_from_proto(cont, tokenizer)) == "<user>hi<assistant>hel"
    shouting = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>",
                                   chat_template=CHAT_TEMPLATE + "{% if shout %}!{% endif %}")
    loud = build_request(chat=[("user", "hi")])
    loud.chat.template_kwargs_json = '{"shout": true}'
    assert shouting.decode(prompt_from_proto(loud, shouting)) == "<user>hi<assistant>!"


@pytest.mark.parametrize("options, field", [
    ({"add_generation_prompt": True, "continue_final_message": True}, "chat.continue_final_message"),
    ({"template_kwargs_json": "[1, 2]"}, "chat.template_kwargs_json"),
    ({"template_kwargs_json": "{not json"}, "chat.template_kwargs_json"),
    ({"template_kwargs_json": "[" * 5000}, "chat.template_kwargs_json"),
    ({"template_kwargs_json": '{"add_generation_prompt": true}'}, "chat.template_kwargs_json"),
    ({"template_kwargs_json": '{"messages": []}'}, "chat.template_kwargs_json"),
    ({"template_kwargs_json": '{"shout": {"a": 1}}'}, "chat"),   # a variable the template cannot use
])
def test_bad_chat_template_options_are_invalid_naming_the_field(tokenizer, options, field):
    template = CHAT_TEMPLATE + "{% if shout %}{{ shout + 1 }}{% endif %}"
    strict = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>", chat_template=template)
    req = build_request(chat=[("user", "hi"), ("assistant", "x")])
    for name, value in options.items():
        setattr(req.chat, name, value)
    with pytest.raises(InvalidRequestError) as info:
        prompt_from_proto(req, strict)
    assert info.value.field == field


def test_chat_without_template_is_invalid(tokenizer):
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(InvalidRequestError) as info:
        prompt_from_proto(build_request(chat=[("user", "hi")]), bare)
    assert info.value.field == "chat"


# ---------------------------------------------------------------- responses


def test_delta_to_proto_midstream_has_no_usage_or_timings():
    msg = delta_to_proto(TokenDelta("r", (5, 6)), "ab")
    assert list(msg.token_ids) == [5, 6] and msg.text == "ab"
    assert msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not msg.HasField("usage") and not msg.HasField("timings")


def test_delta_to_proto_final_message():
    timings = RequestTimings(queue_s=0.1, ttft_s=0.3, e2e_s=1.0, kv_transfer_bytes=1 << 20, decode_worker_id="d0")
    msg = delta_to_proto(TokenDelta("r", (9,), FinishReason.LENGTH, logprobs=(-0.5,)), "z",
                         usage=Usage(3, 4), timings=timings)
    assert msg.finish_reason == pb.FINISH_REASON_LENGTH
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (3, 4)
    assert list(msg.logprobs) == [-0.5]
    assert timings_from_proto(msg.timings) == timings


def test_delta_to_proto_top_logprobs_and_label():
    top = (((5, -0.1), (7, -2.3)), ((6, -0.2),))
    msg = delta_to_proto(TokenDelta("router-id", (5, 6), logprobs=(-0.1, -0.2), top_logprobs=top), "ab",
                         request_id="client-label")
    assert msg.request_id == "client-label"
    assert [(list(t.token_ids), [round(x, 6) for x in t.logprobs]) for t in msg.top_logprobs] == [
        ([5, 7], [-0.1, -2.3]), ([6], [-0.2])]
    assert not delta_to_proto(TokenDelta("r", (5,)), "a").top_logprobs


def test_error_delta_carries_message():
    msg = delta_to_proto(TokenDelta("r", (), FinishReason.ERROR, error="decode worker died"), "")
    assert msg.finish_reason == pb.FINISH_REASON_ERROR and msg.error == "decode worker died"


@pytest.mark.parametrize("reason", [None, *FinishReason])
def test_finish_reason_round_trip(reason):
    assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason


def test_request_timings_mirror_proto_timings():
    assert [f.name for f in dataclasses.fields(RequestTimings)] == [f.name for f in pb.Timings.DESCRIPTOR.fields]


def test_server_info_to_proto():
    workers = [WorkerStats("p0", "prefill", 1, 2, 300, 10, 64, 16), WorkerStats("d0", "decode", 0, 5, 0, 50, 64, 16)]
    msg = server_info_to_proto(dataclasses.replace(DEFAULTS, ttft_s=0.5), model="smollm2", block_size=16,
                               mode="disaggregated", workers=workers)
    assert msg.mode == pb.SERVING_MODE_DISAGGREGATED and msg.max_model_len == 32
    assert [w.role for w in msg.workers] == [pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_DECODE]
    assert msg.workers[0].num_waiting == 1 and msg.workers[1].num_free_blocks == 50
    assert msg.default_slo.ttft_ms == 500.0 and not msg.default_slo.HasField("tpot_ms")
    assert (msg.limits.max_prompt_tokens, msg.limits.default_max_tokens) == (31, 8)


# ---------------------------------------------------------------- incremental detokenization


def stream_text(tokenizer, ids, prompt=(), finish=True, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = [detok.push([t]) for t in ids[:-1]]
    deltas.append(detok.push(ids[-1:], finished=finish))
    assert detok.output_token_ids == list(ids)
    return deltas


def test_multibyte_characters_are_never_split(tokenizer):
    text = "hello café 😀!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # é and 😀 really span several tokens
    deltas = stream_text(tokenizer, ids, prompt=tokenizer.encode("Say:"))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "é" in deltas and "😀" in deltas  # each emitted whole, by its last byte's token
    assert deltas.count("") == (len("é".encode()) - 1) + (len("😀".encode()) - 1)


def test_several_tokens_per_push(tokenizer):
    ids = tokenizer.encode("😀😀 é")
    detok = IncrementalDetokenizer(tokenizer)
    parts = [detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(parts) + detok.push([], finished=True) == "😀😀 é"


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id]
    assert "".join(stream_text(tokenizer, ids)) == "hi"
    assert "".join(stream_text(tokenizer, ids, skip_special_tokens=False)) == "hi<eos>"


@pytest.mark.parametrize("sampling, finish, has_text", [
    ({}, FinishReason.STOP, False),                                         # EOS
    ({"stop_token_ids": (5,)}, FinishReason.STOP, False),                   # a stop token id, plain or special
    ({"include_stop_str_in_output": True}, FinishReason.STOP, True),        # asked for
    ({"ignore_eos": True}, FinishReason.LENGTH, True),                      # not what stopped it
])
def test_the_token_that_stopped_a_request_is_not_output_text(tokenizer, sampling, finish, has_text):
    """vLLM's rule: the EOS or stop token id that ended a request stays in its token ids, its
    text (special tokens kept, or a plain stop token) is not output text."""
    from types import SimpleNamespace

    from router.generation import GenerationCore as Generation
    from router.orchestrator import RequestTrace

    eos = tokenizer.eos_token_id
    stopper = sampling.get("stop_token_ids", (eos,))[0]
    spec = SimpleNamespace(sampling=SamplingParams(**sampling), prompt_token_ids=[1])
    owner = SimpleNamespace(defaults=SimpleNamespace(eos_token_ids=(eos,)))
    owner._stop_token = lambda d, s: Generation._stop_token(owner, d, s)
    delta = TokenDelta("r", (*tokenizer.encode("hi"), stopper), finish)
    drop = Generation._ended_by_stop_token(owner, delta, spec)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    event = Generation._event(delta, detok, None, spec, RequestTrace(), drop)
    assert event.text == "hi" + (tokenizer.decode([stopper], skip_special_tokens=False) if has_text else "")
    assert event.delta.token_ids[-1] == stopper


def test_a_character_the_end_cut_is_not_output(tokenizer):
    """vLLM's rule: the text never ends in U+FFFD for bytes max_tokens cut short; the token ids
    keep them."""
    ids = tokenizer.encode("a😀")[:-1]  # the model stopped mid-emoji
    deltas = stream_text(tokenizer, ids)
    assert tokenizer.decode(ids) == "a\ufffd" and "".join(deltas) == "a"
    complete = tokenizer.encode("a😀b")
    assert "".join(stream_text(tokenizer, complete)) == "a😀b"


# ---------------------------------------------------------------- torch-free router


def test_router_modules_do_not_load_torch():
    code = ("import sys, router.convert, router.client; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_the_launcher_and_the_actor_classes_do_not_load_torch():
    """The router process imports these to start workers; the engine (torch, transformers'
    models) comes in only inside the actors' processes: a smaller router heap."""
    code = ("import sys, deploy.launcher, decode_worker.actor, prefill_worker.actor; "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
