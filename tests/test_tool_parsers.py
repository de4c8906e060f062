"""tool_choice "auto" without a cluster: each tool-call syntax (``tool_parsers/``) finds the
model's calls in free text, leaves the rest as content, gives the same calls and content however
a stream cuts the text; the plan, the finish reason (``tool_calls``) and the serve flags."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from engine.errors import InvalidRequestError
from engine.types import FinishReason, TokenDelta
from router.convert import Usage
from router.generation import GenerationEvent
from router.openai_api.protocol import ChatCompletionRequest
from router.openai_api.requests import parse
from router.openai_api.responses import ResponseFormat
from router.openai_api.tool_calls import ToolCallOutput, ToolChoice, plan
from router.openai_api.tool_parsers import (PARSERS, HermesParser, Llama3JsonParser, MistralParser, ParsedCall,
                                            PythonicParser)

TOOLS = [{"type": "function", "function": {"name": "f"}}]


def whole(parser_kind, text: str) -> tuple[list[ParsedCall], str]:
    return parser_kind().feed(text, finished=True)


def streamed(parser_kind, text: str, cuts: list[int]) -> tuple[list[ParsedCall], str]:
    parser, calls, content = parser_kind(), [], ""
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for i, piece in enumerate(pieces):
        got, text_part = parser.feed(piece, finished=i == len(pieces) - 1)
        calls += got
        content += text_part
    return calls, content


def test_hermes_finds_calls_after_text_and_keeps_the_text():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": "{\\"n\\": 1}"}</tool_call>'
    calls, content = whole(HermesParser, text)
    assert calls == [ParsedCall("f", '{"city": "Paris"}'), ParsedCall("g", '{"n": 1}')]
    assert content == "Let me look.\n"
    assert whole(HermesParser, "no calls <tool here") == ([], "no calls <tool here")
    # cut short by max_tokens: the open call still parses if its JSON is whole, else stays text
    assert whole(HermesParser, '<tool_call>{"name": "f", "arguments": {}}') == ([ParsedCall("f", "{}")], "")
    assert whole(HermesParser, 'x<tool_call>{"name": "f", "argu') == ([], 'x<tool_call>{"name": "f", "argu')
    # a call that is not one (no name) stays as the model wrote it; text after a call is dropped
    assert whole(HermesParser, '<tool_call>{"x": 1}</tool_call>') == ([], '<tool_call>{"x": 1}</tool_call>')
    assert whole(HermesParser, '<tool_call>{"name": "f"}</tool_call> and more') == ([ParsedCall("f", "{}")], "")


def test_llama3_json_finds_calls_only_where_the_reply_is_one():
    assert whole(Llama3JsonParser, ' {"name": "f", "parameters": {"a": [1, "}"]}}; {"name": "g", "arguments": {}}') \
        == ([ParsedCall("f", '{"a": [1, "}"]}'), ParsedCall("g", "{}")], "")
    assert whole(Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {}}') == ([ParsedCall("f", "{}")], "")
    assert whole(Llama3JsonParser, "The answer is {1}.") == ([], "The answer is {1}.")
    assert whole(Llama3JsonParser, '{"name": "f", "parameters": {"a"') == ([], '{"name": "f", "parameters": {"a"')
    assert whole(Llama3JsonParser, '{"city": "Paris"}') == ([], '{"city": "Paris"}')   # no name: text
    assert whole(Llama3JsonParser, "  ") == ([], "  ")


def test_mistral_finds_both_forms_after_its_tag():
    text = 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, "]"]}}, {"name": "g", "arguments": {}}]'
    assert whole(MistralParser, text) == ([ParsedCall("f", '{"a": [1, "]"]}'), ParsedCall("g", "{}")], "Sure. ")
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]g[ARGS]{}'
    assert whole(MistralParser, v11) == ([ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("g", "{}")], "")
    assert whole(MistralParser, '[TOOL_CALLS]f{"n": 1}') == ([ParsedCall("f", '{"n": 1}')], "")   # no [ARGS]
    assert whole(MistralParser, "no calls [TOOL") == ([], "no calls [TOOL")
    # what is no call stays as the model wrote it; text after a call is dropped
    for bad in ['[TOOL_CALLS] [{"x": 1}]', "[TOOL_CALLS] not a name at all {}", '[TOOL_CALLS] [{"name": "f", "argu',
                "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS] ", '[TOOL_CALLS] ["a"]', "[TOOL_CALLS] []", "[TOOL_CALLS] [[1]]",
                "[TOOL_CALLS]" + "x" * 300 + '[ARGS]{"a": 1}']:   # (found by a probe: the first three were lost)
        assert whole(MistralParser, bad) == ([], bad)
        assert streamed(MistralParser, bad, list(range(1, len(bad), 7))) == ([], bad)
    # the calls up to the first item that is none; what follows a call is dropped
    assert whole(MistralParser, '[TOOL_CALLS] [{"name": "f", "arguments": {}}, 5, {"name": "g"}]') == \
        ([ParsedCall("f", "{}")], "")
    assert whole(MistralParser, '[TOOL_CALLS]f[ARGS]{} and text') == ([ParsedCall("f", "{}")], "")


def test_pythonic_reads_a_list_of_calls_never_evaluating_it():
    text = '[get_weather(city="Paris", days=[1, 2], opts={"metric": True, "x": None}), tools.now()]'
    assert whole(PythonicParser, text) == ([ParsedCall("get_weather", '{"city": "Paris", "days": [1, 2], '
                                                                      '"opts": {"metric": true, "x": null}}'),
                                            ParsedCall("tools.now", "{}")], "")
    assert whole(PythonicParser, "<|python_start|>[f(s='it\\'s ]')]<|python_end|>") == \
        ([ParsedCall("f", '{"s": "it\'s ]"}')], "")
    assert whole(PythonicParser, " [f(a=1)] and after") == ([ParsedCall("f", '{"a": 1}')], "")
    for text, value in [("[f(a=\'\'\'it's ]\'\'\')]", "it's ]"), ('[f(a="""x"y""")]', 'x"y'), ("[f(a='')]", ""),
                        ("[f(a='\\'')]", "'")]:   # triple quotes (found by a probe), empty and escaped quotes
        expected = ([ParsedCall("f", json.dumps({"a": value}))], "")
        assert whole(PythonicParser, text) == expected
        for step in (1, 2, 3):
            assert streamed(PythonicParser, text, list(range(step, len(text), step))) == expected, (text, step)
    # not calls, not literals, not JSON's, cut short, or text: the reply as written
    for text in ["Hello [f()]", "[1, 2]", "[f(x)]", "[f(a=g())]", "[f(a=set())]", "[f(a=1e999)]", "[f(**k)]",
                 "[__import__('os').system('x')]", " [f(a=1)", "[]", "  "]:
        assert whole(PythonicParser, text) == ([], text)


_ARGS = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=8), st.booleans()), max_size=3)
_TEXT = st.text(alphabet=st.sampled_from(list("ab <>{}/_\"\\\n")), max_size=12)


@settings(max_examples=200, deadline=None, database=None)
@given(before=_TEXT, calls=st.lists(st.tuples(st.sampled_from(["f", "g"]), _ARGS), max_size=3),
       cut_at=st.lists(st.integers(0, 10_000), max_size=10), style=st.sampled_from(sorted(PARSERS)),
       v11=st.booleans())
def test_a_stream_cut_anywhere_gives_the_whole_replys_calls_and_content(before, calls, cut_at, style, v11):
    if style == "hermes":
        text = before + "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                                for n, a in calls)
    elif style == "llama3_json":
        text = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls) or before
    elif style == "mistral" and v11:
        text = before + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    elif style == "mistral":
        text = before + ("[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls]) if calls else "")
    else:
        text = ("[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items() if k.isidentifier()) + ")"
                                for n, a in calls) + "]") if calls else before
        calls = [(n, {k: v for k, v in a.items() if k.isidentifier()}) for n, a in calls]
    kind = PARSERS[style]
    cuts = sorted({c % (len(text) + 1) for c in cut_at})
    assert streamed(kind, text, cuts) == whole(kind, text)
    got, content = whole(kind, text)
    if calls:
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if style in ("hermes", "mistral") and "<tool_call>" not in before and "[TOOL_CALLS]" not in before:
        assert content == (before if calls else text)


def test_auto_is_served_only_with_a_parser():
    req = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    with pytest.raises(InvalidRequestError) as err:
        plan(req)
    assert err.value.field == "tool_choice" and "--tool-call-parser" in err.value.message
    tools = plan(req, "hermes")
    assert (tools.choice, tools.parser, tools.schema) == (ToolChoice.AUTO, "hermes", None)
    named = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                          "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert plan(named, "hermes").choice is ToolChoice.NAMED   # a choice the client made stays its own


def test_auto_calls_finish_as_tool_calls_and_text_as_stop():
    tools = plan(parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}), "hermes")
    for text, finish, calls in [('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "tool_calls", 1),
                                ("Just text.", "stop", 0)]:
        events = [GenerationEvent(TokenDelta("r", (1,)), text[:7]),
                  GenerationEvent(TokenDelta("r", (2,), FinishReason.STOP), text[7:], Usage(3, 2))]
        body = ResponseFormat(True, "chatcmpl-x", "m", tools=tools).whole(events)["choices"][0]
        assert body["finish_reason"] == finish and len(body["message"].get("tool_calls", [])) == calls
        assert body["message"]["content"] == ("" if calls else text)
        fmt = ResponseFormat(True, "chatcmpl-x", "m", tools=tools)
        chunks = [c for c in (fmt.chunk(e) for e in events) if c is not None]
        assert chunks[-1]["choices"][0]["finish_reason"] == finish
        sent = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
        assert len(sent) == calls and "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
            body["message"]["content"]
    assert ToolCallOutput(tools).calls("plain")[1] == "plain"


def test_auto_without_parallel_tool_calls_gives_the_first_call_only():
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "parallel_tool_calls": False}
    tools = plan(parse(ChatCompletionRequest, body), "hermes")
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>'
    calls, _ = ToolCallOutput(tools).calls(text)
    assert [c["function"]["arguments"] for c in calls] == ['{"a": 1}']
    streamed = ToolCallOutput(tools)
    deltas = [d for i in range(0, len(text), 5) for d in streamed.feed(text[i:i + 5], i + 5 >= len(text))[0]]
    assert [d["index"] for d in deltas] == [0]
    both = plan(parse(ChatCompletionRequest, body | {"parallel_tool_calls": True}), "hermes")
    assert len(ToolCallOutput(both).calls(text)[0]) == 2


def test_a_parser_whose_syntax_starts_with_a_special_token_keeps_them_in_the_text():
    from router.openai_api.requests import chat_request

    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    req = parse(ChatCompletionRequest, body)
    assert not chat_request(req, None, plan(req, "mistral")).skip_special_tokens
    assert not chat_request(req, None, plan(req, "hermes")).HasField("skip_special_tokens")
    told = parse(ChatCompletionRequest, body | {"skip_special_tokens": True})
    assert chat_request(told, None, plan(told, "mistral")).skip_special_tokens, "the client decided"


def test_serve_flags_turn_auto_on_as_vllms_do():
    from deploy.cli import _parser, cluster_config

    on = cluster_config(_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert on.tool_call_parser == "hermes"
    assert cluster_config(_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])).tool_call_parser is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        cluster_config(_parser().parse_args(["serve", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--tool-call-parser", "nope"])


def test_serve_help_names_every_tool_call_parser():
    """`pdserve serve --help` described two of the four syntaxes it accepts (a probe)."""
    from deploy.cli import _parser

    serve = _parser()._subparsers._group_actions[0].choices["serve"]
    action = next(a for a in serve._actions if "--tool-call-parser" in a.option_strings)
    assert all(name in action.help for name in action.choices), (action.choices, action.help)
