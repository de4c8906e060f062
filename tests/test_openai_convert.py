"""The HTTP API's pure parts, without a cluster: OpenAI bodies -> GenerateRequest, field paths
back to OpenAI parameter names, router.errors' verdicts -> HTTP statuses and OpenAI's error
body, and events -> OpenAI's response shapes."""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from engine.errors import CapacityError, InvalidRequestError, WorkerFailedError
from engine.types import FinishReason, TokenDelta
from protos import pdserve_pb2 as pb
from router.convert import ServerDefaults, Usage, sampling_from_proto
from router.errors import status_for
from router.generation import GenerationEvent
from router.identity import DuplicateRequestError
from router.openai_api import errors
from router.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from router.openai_api.requests import MAX_GENERATIONS, chat_request, completion_requests, param_for, parse, sent_as
from router.openai_api.responses import ResponseFormat


def completion_request(req, label):
    """The one request of a one-prompt body."""
    [msg] = completion_requests(req, label)
    return msg


def test_chat_body_becomes_the_generate_request_grpc_would_send():
    req = parse(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 4, "stop": "x",
        "logprobs": True, "top_logprobs": 3, "user": "ignored", "top_k": 5, "ignore_eos": True, "ttft_ms": 100})
    msg = chat_request(req, "label-1")
    assert msg.request_id == "label-1" and msg.chat.messages[0].content == "a\nb"   # vLLM joins text parts by lines
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop), s.logprobs, s.top_logprobs, s.top_k,
            s.ignore_eos) == (7, 0.5, 0.9, 4, ["x"], True, 3, 5, True)
    assert msg.ttft_ms == 100 and not msg.HasField("priority")


def test_unset_parameters_stay_unset_so_the_server_defaults_apply():
    msg = completion_request(parse(CompletionRequest, {"prompt": [1, 2, 3]}), None)
    assert list(msg.token_ids.ids) == [1, 2, 3] and not msg.HasField("request_id")
    for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs"):
        assert not msg.sampling.HasField(name), name
    assert completion_request(parse(CompletionRequest, {"prompt": ["one"]}), None).text == "one"
    assert completion_request(parse(CompletionRequest, {"prompt": "x", "logprobs": 0}), None).sampling.logprobs
    two = completion_request(parse(CompletionRequest, {"prompt": "x", "logprobs": 2}), None).sampling
    assert two.logprobs and two.top_logprobs == 2   # completions' logprobs N: the top-N count
    assert param_for("sampling.top_logprobs", chat=False) == "logprobs"
    assert param_for("sampling.top_logprobs", chat=True) == "top_logprobs"


def test_null_is_a_parameter_left_out_as_openais_schema_makes_it():
    """OpenAI's schema makes every optional parameter nullable ("n": integer or null, "stream":
    boolean or null, ...); clients that write unset fields as null (the openai package leaves
    them out, others do not) get the defaults, not a 400."""
    chat_nulls = {"n": None, "stream": None, "stream_options": None, "logprobs": None, "top_logprobs": None,
                  "max_tokens": None, "max_completion_tokens": None, "temperature": None, "top_p": None,
                  "seed": None, "stop": None, "presence_penalty": None, "frequency_penalty": None,
                  "logit_bias": None, "tools": None, "response_format": None, "user": None}
    messages = [{"role": "user", "content": "x", "name": None}]
    plain = chat_request(parse(ChatCompletionRequest, {"messages": messages}), None)
    assert chat_request(parse(ChatCompletionRequest, {"messages": messages, **chat_nulls}), None) == plain
    req = parse(ChatCompletionRequest, {"messages": messages, "stream": True, "stream_options": {"include_usage": None}})
    assert req.stream and not req.stream_options.include_usage
    cmpl_nulls = {"n": None, "stream": None, "echo": None, "logprobs": None, "best_of": None, "suffix": None,
                  "max_tokens": None, "seed": None, "stop": None}
    assert (completion_request(parse(CompletionRequest, {"prompt": "x", **cmpl_nulls}), None)
            == completion_request(parse(CompletionRequest, {"prompt": "x"}), None))
    with pytest.raises(InvalidRequestError) as err:   # a required one stays required
        parse(CompletionRequest, {"prompt": None})
    assert err.value.field == "prompt"


def test_the_developer_role_is_openais_new_name_for_system():
    """OpenAI's chat API names the instructions' role "developer" (the openai package types it;
    newer clients send it in place of "system"): the model's chat template gets a system turn."""
    msg = chat_request(parse(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "x"}]}), None)
    assert [(m.role, m.content) for m in msg.chat.messages] == [("system", "be brief"), ("user", "x")]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 1.0, "05": 2.0}}, "logit_bias"),
    ({"prompt": ["a"] * 17, "n": 4}, "prompt"),   # a batch's prompts x n past MAX_GENERATIONS
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),   # vLLM's rule: nothing could be generated
])
def test_unsupported_completion_parameters_are_named(body, param):
    with pytest.raises(InvalidRequestError) as err:
        completion_requests(parse(CompletionRequest, body), None)
    assert err.value.field == param


def test_validation_errors_name_the_parameter():
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert err.value.field == "messages[0].content"
    with pytest.raises(InvalidRequestError) as err:
        parse(ChatCompletionRequest, {"model": "m"})
    assert err.value.field == "messages"
    with pytest.raises(InvalidRequestError) as err:
        chat_request(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), None)
    assert err.value.field == "messages[0].content[0]"


@pytest.mark.parametrize("model, body, param", [
    (ChatCompletionRequest, {"max_tokens": 3_000_000_000}, "max_tokens"),           # int32 in GenerateRequest
    (ChatCompletionRequest, {"max_completion_tokens": 2**40}, "max_completion_tokens"),
    (ChatCompletionRequest, {"seed": 2**70}, "seed"),                               # int64
    (ChatCompletionRequest, {"top_k": 2**40}, "top_k"),
    (ChatCompletionRequest, {"priority": -2**40}, "priority"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
    (ChatCompletionRequest, {"stop_token_ids": [3, 2**70]}, "stop_token_ids[1]"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "\udc00", "content": "a"}]}, "messages[0].role"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages[0].content[0].text"),
    (ChatCompletionRequest, {"stop": "\udfff"}, "stop"),
    (ChatCompletionRequest, {"stop": ["ok", "\udfff"]}, "stop[1]"),
    (CompletionRequest, {"prompt": [5, 2**70]}, "prompt[1]"),
    (CompletionRequest, {"prompt": [[5, 2**70]]}, "prompt[0][1]"),
    (CompletionRequest, {"prompt": "\ud800"}, "prompt"),
    (CompletionRequest, {"prompt": ["\ud800"]}, "prompt[0]"),
    (CompletionRequest, {"prompt": "x", "logprobs": 2**40}, "logprobs"),
])
def test_values_a_generate_request_cannot_hold_are_400_naming_the_parameter(model, body, param):
    """JSON carries any integer and (through \\u escapes) lone surrogates; GenerateRequest's fields
    hold int32 / int64 and UTF-8 only, and protobuf refuses the rest with a ValueError, which was
    a 500 "Internal Server Error" in plain text. Each is the client's mistake: a 400 naming it."""
    body = ({"messages": [{"role": "user", "content": "x"}]} if model is ChatCompletionRequest else {}) | body
    with pytest.raises(InvalidRequestError) as err:
        req = parse(model, body)
        (chat_request if model is ChatCompletionRequest else completion_request)(req, None)
    assert err.value.field == param, err.value


def test_values_at_the_proto_bounds_still_convert():
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "\U0001f600 ok"}],
                                        "max_tokens": 2**31 - 1, "seed": 2**63 - 1, "stop_token_ids": [2**63 - 1]})
    msg = chat_request(req, None)   # the engine's own checks (max_model_len, vocabulary) refuse them later
    assert (msg.sampling.max_tokens, msg.sampling.seed) == (2**31 - 1, 2**63 - 1)
    assert msg.chat.messages[0].content == "\U0001f600 ok"


def test_field_paths_map_back_to_openai_parameters():
    assert param_for("sampling.top_p", chat=True) == "top_p"
    assert param_for("sampling.max_tokens", chat=True, sent_as={"sampling.max_tokens": "max_completion_tokens"}) == "max_completion_tokens"
    assert param_for("chat.messages[1].role", chat=True) == "messages[1].role"
    assert param_for("chat", chat=True) == param_for("chat.messages", chat=True) == "messages"
    assert param_for("text", chat=False) == param_for("token_ids", chat=False) == "prompt"
    assert param_for("sampling.stop[2]", chat=False) == "stop[2]"
    assert param_for("n", chat=False) == "n"


def test_router_errors_become_openai_statuses(caplog):
    def api(exc):
        code, message = status_for(exc, "req-1")
        return errors.from_status(code, message, exc, lambda f: param_for(f, chat=True))

    bad = api(InvalidRequestError("sampling.temperature", "must be >= 0"))
    assert (bad.status, bad.type, bad.param, bad.message) == (400, "invalid_request_error", "temperature",
                                                              "temperature: must be >= 0")
    assert api(DuplicateRequestError("x is live")).status == 409
    refused = api(CapacityError("predicted TTFT 812 ms > target 10 ms"))
    assert refused.status == 429 and "TTFT" in refused.message
    assert refused.headers() == {"retry-after": "1", "retry-after-ms": "1000"}
    later = api(CapacityError("predicted TTFT 3312 ms > target 1000 ms", "ttft", retry_after_s=2.31))
    assert later.headers() == {"retry-after": "3", "retry-after-ms": "2310"}   # whole seconds round up
    assert bad.headers() == {} and api(DuplicateRequestError("x is live")).headers() == {}
    assert api(WorkerFailedError("no decode worker is alive")).status == 503
    with caplog.at_level(logging.ERROR):
        internal = api(RuntimeError("secret worker text"))
    assert internal.status == 500 and "ref " in internal.message and "secret" not in internal.message
    body = internal.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == grpc.StatusCode.INTERNAL.name.lower()


def _event(ids, text, finish=None, logprobs=None, usage=None, tops=None):
    return GenerationEvent(TokenDelta("r", tuple(ids), finish, logprobs, top_logprobs=tops), text, usage)


def test_chat_chunks_role_first_finish_last_usage_after():
    fmt = ResponseFormat(True, "chatcmpl-1", "m", include_usage=True)
    first = fmt.chunk(_event([1], "a"))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"} and first["usage"] is None
    assert fmt.chunk(_event([2], "")) is None    # text held back: nothing to tell
    last = fmt.chunk(_event([3], "c", FinishReason.LENGTH, usage=Usage(2, 3)))
    assert last["choices"][0] == {"index": 0, "delta": {"content": "c"}, "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None}
    tail = fmt.usage_chunk(Usage(2, 3))
    assert tail["choices"] == [] and tail["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_whole_completion_with_logprobs():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(96 + i) for i in ids)

    fmt = ResponseFormat(False, "cmpl-1", "m", logprobs=True, tokenizer=Tok())
    body = fmt.whole([_event([1, 2], "ab", logprobs=(-0.5, -1.0)),
                      _event([3], "c", FinishReason.STOP, (-2.0,), Usage(4, 3))])
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["text"] == "abc" and choice["finish_reason"] == "stop"
    assert choice["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -1.0, -2.0],
                                  "top_logprobs": [{"a": -0.5}, {"b": -1.0}, {"c": -2.0}], "text_offset": [0, 1, 2]}
    assert body["usage"]["total_tokens"] == 7
    chat = ResponseFormat(True, "c", "m", logprobs=True).whole([_event([9], "x", FinishReason.STOP, (-0.1,), Usage(1, 1))])
    assert chat["choices"][0]["logprobs"]["content"] == [
        {"token": "token_id:9", "logprob": -0.1, "bytes": list(b"token_id:9"), "top_logprobs": []}]


def test_a_ruled_out_token_s_logprob_is_valid_json():
    """-inf (a token whose logit is -inf) would be written as -Infinity, which JSON parsers refuse."""
    import json

    events = [_event([1, 2], "ab", FinishReason.STOP, (float("-inf"), -1.0), Usage(1, 2),
                     (((1, float("-inf")),), ((2, -1.0), (3, float("-inf")))))]
    for chat in (True, False):
        body = ResponseFormat(chat, "c", "m", logprobs=True).whole(events)
        text = json.dumps(body, allow_nan=False)   # raises on -inf
        assert "-9999.0" in text


def test_top_logprobs_shapes():
    """Completions: N most likely plus the sampled token (up to N + 1 entries); chat: the N most
    likely as entries of their own."""
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(96 + i) for i in ids)

    tops = (((1, -0.1), (2, -2.5)), ((4, -0.3), (5, -1.5)))   # the second pick (3) is not among its top 2
    events = [_event([1, 3], "ac", FinishReason.LENGTH, (-0.1, -2.0), Usage(1, 2), tops)]
    comp = ResponseFormat(False, "c", "m", logprobs=True, tokenizer=Tok()).whole(events)["choices"][0]["logprobs"]
    assert comp["top_logprobs"] == [{"a": -0.1, "b": -2.5}, {"d": -0.3, "e": -1.5, "c": -2.0}]
    chat = ResponseFormat(True, "c", "m", logprobs=True, tokenizer=Tok()).chunk(events[0])["choices"][0]["logprobs"]
    assert chat["content"][1] == {"token": "c", "logprob": -2.0, "bytes": [99], "top_logprobs": [
        {"token": "d", "logprob": -0.3, "bytes": [100]}, {"token": "e", "logprob": -1.5, "bytes": [101]}]}


def _byte_level_tokenizer():
    """GPT-2's scheme with no merges: token id b is the byte b (SmolLM2 splits "😀" likewise)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_logprob_bytes_rebuild_characters_split_across_tokens():
    """OpenAI's ``bytes``: the token's own bytes, so that a character spread over several tokens
    (each decoding to U+FFFD alone) is rebuilt by joining them. Decoded text is no source for them."""
    tokenizer = _byte_level_tokenizer()
    ids = list("a 😀é".encode("utf-8"))
    assert tokenizer.decode(ids[2:3]) == "\ufffd"   # a partial character decodes to the replacement
    events = [_event(ids, "a 😀é", FinishReason.STOP, tuple(-0.5 for _ in ids), Usage(1, len(ids)),
                     tuple(((t, -0.5),) for t in ids))]
    chat = ResponseFormat(True, "c", "m", logprobs=True, tokenizer=tokenizer).whole(events)
    entries = chat["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8") == "a 😀é"
    assert b"".join(bytes(e["top_logprobs"][0]["bytes"]) for e in entries) == "a 😀é".encode("utf-8")


def _sentencepiece_tokenizer():
    """Llama's word-leading-space rule (Metaspace), with SentencePiece's byte fallback pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "▁The", "▁capital", "▁is", "▁Paris", "."] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_text_offset_of_tokens_that_split_a_character():
    """A byte-level token holding part of a character decodes to U+FFFD alone: adding up those
    texts' lengths (vLLM's rule) puts every later offset past its token (here 'é' at 6 in a
    5-character text). Offsets count the characters the tokens' bytes complete: a token inside a
    character points at that character, and the next whole one where it starts in the text."""
    tokenizer = _byte_level_tokenizer()
    text = "a 😀é!"
    ids = list(text.encode("utf-8"))     # a, space, 4 bytes of 😀, 2 of é, !
    events = [_event(ids, text, FinishReason.STOP, tuple(-0.5 for _ in ids), Usage(1, len(ids)))]
    lp = ResponseFormat(False, "c", "m", logprobs=True, tokenizer=tokenizer).whole(events)["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 1, 2, 2, 2, 2, 3, 3, 4]
    assert text[lp["text_offset"][-1]:] == "!"


def test_text_offset_runs_on_across_streamed_chunks():
    """Streamed, each chunk's offsets continue from the text already sent (vLLM's
    ``initial_text_offset``): they index the whole completion, not the chunk."""
    tokenizer = _byte_level_tokenizer()
    fmt = ResponseFormat(False, "c", "m", logprobs=True, tokenizer=tokenizer)
    chunks = [("ab", list(b"ab")), ("\u00e9", list("é".encode())), ("c", list(b"c"))]
    offsets = []
    for text, ids in chunks:
        offsets += fmt.chunk(_event(ids, text, None, tuple(-0.5 for _ in ids)))["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [0, 1, 2, 2, 3]


def test_text_offset_and_tokens_keep_sentencepiece_leading_spaces():
    """A SentencePiece word token decodes alone without its leading space ("▁Paris" -> "Paris");
    the completion's text has it. vLLM restores it from the vocabulary piece: the tokens join
    into the text, and each offset is where its token starts. A byte-fallback piece is its byte."""
    tokenizer = _sentencepiece_tokenizer()
    pieces = ["▁capital", "▁is", "▁Paris", "<0xC3>", "<0xA9>", "."]
    ids = tokenizer.convert_tokens_to_ids(pieces)
    text = " capital is Parisé."
    events = [_event(ids, text, FinishReason.STOP, tuple(-0.5 for _ in ids), Usage(1, len(ids)))]
    fmt = ResponseFormat(False, "c", "m", logprobs=True, tokenizer=tokenizer)
    lp = fmt.whole(events)["choices"][0]["logprobs"]
    assert lp["tokens"][:3] == [" capital", " is", " Paris"]
    assert lp["text_offset"] == [0, 8, 11, 17, 17, 18]
    chat = ResponseFormat(True, "c", "m", logprobs=True, tokenizer=tokenizer).whole(events)
    assert b"".join(bytes(e["bytes"]) for e in chat["choices"][0]["logprobs"]["content"]).decode() == text


def test_stop_strings_are_trimmed_from_streamed_text():
    from router.stop_text import StopTextTrimmer

    t = StopTextTrimmer(["Paris", "\n\n"])
    out = [t.push("The capital is P"), t.push("ar"), t.push("is. More"), t.push("x", finished=True)]
    assert "".join(out) == "The capital is " and out[0] == "The capital is "   # "P" held until decided
    t = StopTextTrimmer(["Paris"])
    assert t.push("a P") == "a " and t.push("ie", finished=True) == "Pie"     # not a stop: flushed
    t = StopTextTrimmer(["ab"])
    assert t.push("xa") == "x" and t.push("ab") == "a"                         # "a" + "ab": stop at the second


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {"prompt": "x", "guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"},
     "guided_whitespace_pattern"),
    (CompletionRequest, {"prompt": "x", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, "use_beam_search"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    # found by a probe: each was answered as if it had not been sent
    (CompletionRequest, {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    (CompletionRequest, {"prompt": "x", "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    (CompletionRequest, {"prompt": "x", "return_token_ids": True}, "return_token_ids"),
    (CompletionRequest, {"prompt": "x", "cache_salt": "tenant-a"}, "cache_salt"),
    (CompletionRequest, {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    (CompletionRequest, {"prompt": "x", "vllm_xargs": {"k": 1}}, "vllm_xargs"),
    (CompletionRequest, {"prompt": "x", "spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    (CompletionRequest, {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    (CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
     "add_special_tokens"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"},
     "reasoning_effort"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "mm_processor_kwargs": {"a": 1}},
     "mm_processor_kwargs"),
])
def test_vllm_extensions_that_would_change_the_output_are_refused_by_name(model, body, param):
    """A vLLM client's extras (``extra_body``) that pdserve does not implement: a 400 naming the
    parameter, never an answer generated as if it had not been sent."""
    convert = chat_request if model is ChatCompletionRequest else completion_request
    with pytest.raises(InvalidRequestError) as err:
        convert(parse(model, body), None)
    assert err.value.field == param and "not supported" in str(err.value)


def test_extensions_at_their_no_op_values_are_served():
    body = {"prompt": "x", "prompt_embeds": None, "return_token_ids": False, "cache_salt": None, "vllm_xargs": {},
            "spaces_between_special_tokens": True, "add_special_tokens": True, "seed": -7}
    assert completion_request(parse(CompletionRequest, body), None).sampling.seed == -7   # any int64, as OpenAI's
    chat = {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": False, "reasoning_effort": None}
    assert chat_request(parse(ChatCompletionRequest, chat), None).chat.messages


def test_stream_options_go_with_a_stream_only():
    with pytest.raises(InvalidRequestError) as err:
        completion_request(parse(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}), None)
    assert err.value.field == "stream_options"


def test_penalties_logit_bias_min_p_and_min_tokens_become_the_grpc_fields():
    body = {"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {"7": 2.5, " 12 ": -100},
            "repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 3, "allowed_token_ids": [4, 2]}
    s = completion_request(parse(CompletionRequest, body), None).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == (0.5, -1.0, 1.1, 0.05, 3)
    with pytest.raises(InvalidRequestError) as err:   # a JSON true is not a count of 1
        parse(CompletionRequest, {"prompt": "x", "min_tokens": True})
    assert err.value.field == "min_tokens"
    assert dict(s.logit_bias) == {7: 2.5, 12: -100.0} and list(s.allowed_token_ids) == [4, 2]
    chat = chat_request(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                      "logit_bias": {"3": 1}}), None)
    assert dict(chat.sampling.logit_bias) == {3: 1.0}


def test_vllm_extensions_at_their_no_op_values_and_unknown_fields_pass():
    """Clients that send every default (min_tokens 0, repetition_penalty 1, tool_choice "auto", ...),
    null, or fields that change nothing here (user, metadata) get the same request as without them."""
    plain = completion_request(parse(CompletionRequest, {"prompt": "x"}), None)
    defaults = {"min_tokens": 0, "repetition_penalty": 1, "min_p": 0.0, "include_stop_str_in_output": False,
                "use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "guided_json": None,
                "user": "u", "metadata": {"k": "v"}}
    assert completion_request(parse(CompletionRequest, {"prompt": "x", **defaults}), None) == plain
    messages = [{"role": "user", "content": "x"}]
    chat = chat_request(parse(ChatCompletionRequest, {"messages": messages}), None)
    chat_defaults = {**defaults, "echo": False, "add_generation_prompt": True, "continue_final_message": False,
                     "chat_template_kwargs": {}, "tool_choice": "none"}
    assert chat_request(parse(ChatCompletionRequest, {"messages": messages, **chat_defaults}), None) == chat
    assert chat_request(parse(ChatCompletionRequest, {"messages": messages, "tool_choice": "auto"}), None) == chat


def test_vllms_top_k_minus_one_means_top_k_off_as_zero_does():
    """vLLM clients send top_k -1 as their "consider every token" (vLLM takes -1 or 0); over HTTP
    it is pdserve's 0. Other negatives stay a 400 from the shared validation, as over gRPC."""
    defaults = ServerDefaults(max_model_len=32, vocab_size=100)
    off = completion_request(parse(CompletionRequest, {"prompt": "x", "top_k": -1}), None)
    assert off.sampling.HasField("top_k") and sampling_from_proto(off.sampling, defaults).top_k == 0
    below = completion_request(parse(CompletionRequest, {"prompt": "x", "top_k": -2}), None)
    with pytest.raises(InvalidRequestError) as err:
        sampling_from_proto(below.sampling, defaults)
    assert err.value.field == "sampling.top_k" and param_for(err.value.field, chat=False) == "top_k"


def test_choices_copy_the_request_with_their_own_label_and_seed():
    """n requests from one: the first as sent (its label), the others with router-made labels and
    seed + index, wrapped into the int64 range GenerateRequest's seed takes."""
    from router.openai_api.fan_in import SEED_RANGE, choices

    req = parse(CompletionRequest, {"prompt": "x", "n": 3, "seed": SEED_RANGE - 2, "temperature": 1.0})
    msg = completion_request(req, "label-1")
    out = choices(msg, 3)
    assert out[0] is msg and msg.request_id == "label-1"
    assert [m.HasField("request_id") for m in out[1:]] == [False, False]
    assert [m.sampling.seed for m in out] == [SEED_RANGE - 2, SEED_RANGE - 1, 0]
    assert all(m.text == "x" and m.sampling.temperature == 1.0 for m in out)
    unseeded = choices(completion_request(parse(CompletionRequest, {"prompt": "x"}), None), 2)
    assert not any(m.sampling.HasField("seed") for m in unseeded)


def test_a_batch_of_prompts_is_one_request_each_the_first_labelled():
    body = {"prompt": ["one", "two", "three"], "max_tokens": 3, "seed": 5, "logprobs": 1, "echo": True}
    msgs = completion_requests(parse(CompletionRequest, body), "label-1")
    assert [m.text for m in msgs] == ["one", "two", "three"]
    assert [m.request_id for m in msgs] == ["label-1", "", ""]
    assert all(m.sampling.max_tokens == 3 and m.sampling.seed == 5 and m.sampling.prompt_logprobs == 1 for m in msgs)
    ids = completion_requests(parse(CompletionRequest, {"prompt": [[1, 2], [3]]}), None)
    assert [list(m.token_ids.ids) for m in ids] == [[1, 2], [3]]
    with pytest.raises(InvalidRequestError) as too_many:
        completion_requests(parse(CompletionRequest, {"prompt": ["a"] * (MAX_GENERATIONS // 4 + 1), "n": 4}), None)
    assert too_many.value.field == "prompt" and str(MAX_GENERATIONS) in too_many.value.message


def test_chat_template_options_become_the_chat_fields():
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs: sent as the
    gRPC chat's options (add_generation_prompt only where it differs from what unset means)."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]
    chat = chat_request(parse(ChatCompletionRequest, {"messages": messages, "continue_final_message": True,
                                                      "chat_template_kwargs": {"enable_thinking": False}}), None).chat
    assert chat.continue_final_message and not chat.HasField("add_generation_prompt")
    assert json.loads(chat.template_kwargs_json) == {"enable_thinking": False}
    closed = chat_request(parse(ChatCompletionRequest, {"messages": messages, "add_generation_prompt": False}), None)
    assert closed.chat.HasField("add_generation_prompt") and not closed.chat.add_generation_prompt
    both = chat_request(parse(ChatCompletionRequest, {"messages": messages, "add_generation_prompt": True,
                                                      "continue_final_message": True}), None)
    assert both.chat.add_generation_prompt and both.chat.continue_final_message   # refused by the shared checks
    assert param_for("chat.template_kwargs_json", chat=True) == "chat_template_kwargs"
    assert param_for("chat.continue_final_message", chat=True) == "continue_final_message"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("extra, want", [
    ({"response_format": {"type": "json_object"}}, pb.StructuredOutput(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     pb.StructuredOutput(json=json.dumps(SCHEMA))),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, pb.StructuredOutput(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, pb.StructuredOutput(json='{"type": "string"}')),
    ({"structured_outputs": {"json_object": True}}, pb.StructuredOutput(json_object=True)),
    ({"structured_outputs": {"regex": "[a-z]+", "json_object": False, "disable_fallback": False}},
     pb.StructuredOutput(regex="[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"]))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, pb.StructuredOutput(grammar='root ::= "a"')),
    ({"guided_json": SCHEMA}, pb.StructuredOutput(json=json.dumps(SCHEMA))),
    ({"guided_regex": "x+"}, pb.StructuredOutput(regex="x+")),
    ({"guided_choice": ["a"]}, pb.StructuredOutput(choice=pb.Choices(choices=["a"]))),
    ({"guided_grammar": 'start: "a"'}, pb.StructuredOutput(grammar='start: "a"')),
])
def test_every_way_to_ask_for_structured_output_becomes_the_one_grpc_field(extra, want):
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields, on both
    endpoints: one ``sampling.structured_output``."""
    for msg in (completion_request(parse(CompletionRequest, {"prompt": "x", **extra}), None),
                chat_request(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], **extra}), None)):
        assert (msg.sampling.structured_output if msg.sampling.HasField("structured_output") else None) == want


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_choice": "a"}, "guided_choice"),
])
def test_structured_output_asked_twice_or_malformed_is_refused_naming_the_parameter(extra, param):
    with pytest.raises(InvalidRequestError) as err:
        completion_request(parse(CompletionRequest, {"prompt": "x", **extra}), None)
    assert err.value.field == param


def test_a_structured_outputs_error_is_named_as_the_client_sent_it():
    """The router names ``sampling.structured_output`` (and a size limit its kind); the HTTP
    answer names the parameter the body used."""
    for extra, name in [({"guided_regex": "a("}, "guided_regex"), ({"response_format": {"type": "json_object"}},
                                                                   "response_format"),
                        ({"structured_outputs": {"choice": []}}, "structured_outputs")]:
        req = parse(CompletionRequest, {"prompt": "x", **extra})
        names = sent_as(req, chat=False)
        assert param_for("sampling.structured_output", chat=False, sent_as=names) == name
        assert param_for("sampling.structured_output.regex", chat=False, sent_as=names) == name
        assert param_for("sampling.top_p", chat=False, sent_as=names) == "top_p"
