"""Tool calling's pieces without a cluster: which tool choices are served (``tool_calls.plan``),
the schema a call is held to (it compiles, ``$defs`` lifted, one call without parallel calls),
the generated text back as OpenAI tool calls, whole and streamed (the same calls however the
text is cut into deltas), and the conversation's tools and earlier calls through the chat
template (checked first, each fault named)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from engine.errors import InvalidRequestError
from engine import grammar
from engine.types import GuideKind, StructuredOutput
from protos import pdserve_pb2 as pb
from router.chat_prompt import chat_from_proto, encode_chat
from router.openai_api.protocol import ChatCompletionRequest, TokenizeRequest
from router.openai_api.requests import chat_request, param_for, parse, sent_as, tokenize_request
from router.openai_api.responses import ResponseFormat
from router.openai_api.tool_calls import ToolCallOutput, ToolChoice, plan
from tests.conftest import byte_level_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "hi"}]
def body(**extra) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, {"messages": USER, "tools": [WEATHER, NOW]} | extra)


def refused(fn, *args) -> tuple[str, str]:
    with pytest.raises(InvalidRequestError) as exc:
        fn(*args)
    return exc.value.field, exc.value.message


# ---------------------------------------------------------------- which choices


def test_named_holds_the_reply_to_the_functions_parameters():
    tools = plan(body(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert (tools.choice, tools.name, tools.schema) == (ToolChoice.NAMED, "get_weather", WEATHER["function"]["parameters"])
    assert plan(body(tool_choice={"type": "function", "function": {"name": "now"}})).schema == {"type": "object"}


def test_required_is_an_array_of_calls_each_one_of_the_tools():
    schema = plan(body(tool_choice="required")).schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    assert plan(body(tool_choice="required", parallel_tool_calls=False)).schema["maxItems"] == 1


def test_none_shows_the_tools_and_leaves_the_reply_free():
    req = body(tool_choice="none")
    tools = plan(req)
    assert tools.choice is ToolChoice.NONE and tools.schema is None
    msg = chat_request(req, None, tools)
    assert not msg.sampling.HasField("structured_output")
    assert [t["function"]["name"] for t in json.loads(msg.chat.tools_json)] == ["get_weather", "now"]


def test_no_tools_with_a_no_op_choice_is_no_tool_use():
    for choice in (None, "none", "auto"):
        req = parse(ChatCompletionRequest, {"messages": USER, "tool_choice": choice})
        assert plan(req) is None
        assert not chat_request(req, None, None).chat.tools_json
    # vLLM's rule: "required" over an empty list of tools is "none"
    assert plan(parse(ChatCompletionRequest, {"messages": USER, "tools": [], "tool_choice": "required"})) is None


@pytest.mark.parametrize("extra, field, words", [
    ({}, "tool_choice", "auto"),
    ({"tool_choice": "auto"}, "tool_choice", "tool-call parser"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "'nope'"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice", "no tools"),
    ({"tools": [NOW, NOW], "tool_choice": "required"}, "tools[1].function.name", "two tools"),
])
def test_refused_choices_name_the_parameter(extra, field, words):
    got_field, message = refused(plan, body(**extra))
    assert got_field == field and words in message


def test_openais_deprecated_functions_and_audio_are_refused_by_name_not_ignored():
    """``functions`` / ``function_call`` (before tools), audio output: refused naming them, unless
    sent as no-ops."""
    for extra, param in [({"functions": [{"name": "f"}]}, "functions"), ({"function_call": {"name": "f"}}, "function_call"),
                         ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "x"}}, "audio")]:
        req = parse(ChatCompletionRequest, {"messages": USER} | extra)
        assert refused(chat_request, req, None, None)[0] == param
    no_ops = parse(ChatCompletionRequest, {"messages": USER, "functions": [], "function_call": "none",
                                           "modalities": ["text"]})
    assert chat_request(no_ops, None, None) == chat_request(parse(ChatCompletionRequest, {"messages": USER}), None, None)


def test_bad_tool_bodies_are_400s_naming_the_field():
    for tool, field in [({"type": "function", "function": {"name": ""}}, "tools.0.function.name"),
                        ({"type": "retrieval", "function": {"name": "x"}}, "tools.0.type"),
                        ({"type": "function"}, "tools.0.function")]:
        got, _ = refused(parse, ChatCompletionRequest, {"messages": USER, "tools": [tool]})
        assert got.replace("[0]", ".0") == field


def test_conflicting_defs_and_a_second_structured_output_are_refused():
    a = {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"x": {"type": "string"}}}}}
    b = {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"x": {"type": "integer"}}}}}
    assert refused(plan, body(tools=[a, b], tool_choice="required"))[0] == "tools"
    for defs in (5, None, []):
        odd = {"type": "function", "function": {"name": "a", "parameters": {"$defs": defs}}}
        assert refused(plan, body(tools=[NOW, odd], tool_choice="required"))[0] == "tools[1].function.parameters.$defs"
    req = body(tool_choice="required", response_format={"type": "json_object"})
    field, message = refused(chat_request, req, None, plan(req))
    assert field == "tool_choice" and "response_format" in message


def test_required_schema_lifts_defs_so_references_resolve_and_compiles():
    ref = {"type": "function", "function": {"name": "moved", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/place"}}, "required": ["to"],
        "$defs": {"place": {"type": "string", "enum": ["home", "work"]}}}}}
    old_style = {"type": "function", "function": {"name": "sized", "parameters": {   # draft 7's definitions
        "type": "object", "properties": {"size": {"$ref": "#/definitions/size"}},
        "definitions": {"size": {"type": "integer", "minimum": 1}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "moved"}}):
        schema = plan(body(tools=[ref, old_style, WEATHER, NOW], tool_choice=choice)).schema
        grammar.check(StructuredOutput(GuideKind.JSON, json.dumps(schema)))   # llguidance resolves every $ref
    assert "$defs" in schema and "$defs" not in schema["properties"]   # named: the function's own schema as it is


def test_a_tool_schema_errors_name_tools():
    req = body(tool_choice="required")
    assert sent_as(req, chat=True, tools=plan(req))["sampling.structured_output"] == "tools"
    assert param_for("chat.tools_json[1].function.name", chat=True) == "tools[1].function.name"
    assert param_for("chat.messages[2].tool_calls_json[0].function.arguments", chat=True) == \
        "messages[2].tool_calls[0].function.arguments"


# ---------------------------------------------------------------- the reply as calls


def _streamed(tools, text: str, cuts: list[int]) -> tuple[list[dict], str]:
    """Every streamed chunk's calls merged as a client merges deltas (by index), and the content."""
    out, merged, content = ToolCallOutput(tools), {}, ""
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for i, piece in enumerate(pieces):
        calls, text_part = out.feed(piece, finished=i == len(pieces) - 1)
        content += text_part
        for call in calls:
            entry = merged.setdefault(call["index"], {"id": call.get("id"), "name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name", entry["name"])
            entry["arguments"] += call["function"].get("arguments", "")
    return [merged[i] for i in sorted(merged)], content


_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                       lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                       max_leaves=8)


@settings(max_examples=150, deadline=None, database=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["get_weather", "now"]), st.dictionaries(st.text(max_size=6), _VALUES,
                                                                                          max_size=3)), min_size=1, max_size=4),
       cut_at=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12), spaced=st.booleans())
def test_streamed_calls_are_the_whole_replys_however_the_text_is_cut(calls, cut_at, spaced):
    """A required reply (any valid array; strings with brackets, quotes and escapes) gives the
    same calls streamed in any cuts as whole, each call's arguments its parameters as JSON."""
    tools = plan(body(tool_choice="required"))
    text = json.dumps([{"name": n, "parameters": p} for n, p in calls], indent=1 if spaced else None)
    whole, left = ToolCallOutput(tools).calls(text)
    assert left == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == calls
    cuts = sorted({c % (len(text) + 1) for c in cut_at})
    streamed, content = _streamed(tools, text, cuts)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") for c in streamed)


def test_a_named_call_streams_its_arguments_as_they_come():
    tools = plan(body(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    text = '{"city": "Paris", "unit": "c"}'
    streamed, content = _streamed(tools, text, [0, 1, 5, 12, 29])
    assert content == "" and len(streamed) == 1
    assert (streamed[0]["name"], streamed[0]["arguments"]) == ("get_weather", text)
    whole, left = ToolCallOutput(tools).calls(text)
    assert left == "" and whole[0]["function"] == {"name": "get_weather", "arguments": text}
    # a reply of no text still names its call, once
    assert [c["function"]["name"] for c in ToolCallOutput(tools).feed("", finished=True)[0]] == ["get_weather"]


def test_a_required_array_cut_short_keeps_its_unfinished_text_as_content():
    tools = plan(body(tool_choice="required"))
    text = '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    calls, left = ToolCallOutput(tools).calls(text)
    assert [c["function"]["name"] for c in calls] == ["now"]
    assert left == ', {"name": "get_weather", "parameters": {"ci'
    streamed, content = _streamed(tools, text, [3, 40, 50])
    assert [c["name"] for c in streamed] == ["now"] and content == left


def test_response_bodies_carry_tool_calls_in_place_of_content():
    from router.generation import GenerationEvent
    from engine.types import FinishReason, TokenDelta
    from router.convert import Usage

    tools = plan(body(tool_choice="required"))
    fmt = ResponseFormat(True, "chatcmpl-x", "m", tools=tools)
    text = '[{"name": "now", "parameters": {}}]'
    events = [GenerationEvent(TokenDelta("r", (1,)), text[:10]),
              GenerationEvent(TokenDelta("r", (2,), FinishReason.STOP), text[10:], Usage(3, 2))]
    whole = fmt.whole(events)["choices"][0]
    assert whole["message"]["content"] == "" and whole["finish_reason"] == "stop"
    assert set(whole["message"]["tool_calls"][0]) == {"id", "type", "function"}   # a stream's deltas have the index
    assert [c["function"] for c in whole["message"]["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    fresh = ResponseFormat(True, "chatcmpl-x", "m", tools=tools).for_choice(1, None)
    chunks = [fresh.chunk(e) for e in events]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    last = chunks[1]["choices"][0]
    assert last["index"] == 1 and last["finish_reason"] == "stop"
    assert [c["function"]["name"] for c in last["delta"]["tool_calls"]] == ["now"]


# ---------------------------------------------------------------- the conversation


def test_tools_and_earlier_calls_reach_the_template_as_transformers_renders_them():
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                {"role": "tool", "content": "21", "tool_call_id": "call_1"}]
    req = parse(ChatCompletionRequest, {"messages": messages, "tools": [WEATHER], "tool_choice": "none"})
    msg = chat_request(req, None, plan(req))
    tokenizer = byte_level_tokenizer()
    got = encode_chat(chat_from_proto(msg.chat), tokenizer)
    as_template_sees = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        messages[2]]
    want = tokenizer.apply_chat_template(as_template_sees, tools=[WEATHER], add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
    assert got == want
    text = tokenizer.decode(got)
    assert text.startswith("T:get_weather") and '[get_weather {"city": "Paris", "unit": "c"}]<t>21(call_1)' in text
    # /tokenize takes the same tools
    tok = tokenize_request(parse(TokenizeRequest, {"messages": messages, "tools": [WEATHER]}))
    assert encode_chat(chat_from_proto(tok.chat), tokenizer) == got
    assert refused(tokenize_request, parse(TokenizeRequest, {"prompt": "x", "tools": [WEATHER]}))[0] == "tools"


@pytest.mark.parametrize("message, field", [
    (pb.ChatMessage(role="assistant", tool_calls_json="not json"), "chat.messages[0].tool_calls_json"),
    (pb.ChatMessage(role="assistant", tool_calls_json="[]"), "chat.messages[0].tool_calls_json"),
    (pb.ChatMessage(role="assistant", tool_calls_json='[{"function": {"name": ""}}]'),
     "chat.messages[0].tool_calls_json[0].function.name"),
    (pb.ChatMessage(role="assistant", tool_calls_json='[{"function": {"name": "f", "arguments": "[1]"}}]'),
     "chat.messages[0].tool_calls_json[0].function.arguments"),
    (pb.ChatMessage(role="assistant", tool_calls_json='[{"function": {"name": "f", "arguments": "{"}}]'),
     "chat.messages[0].tool_calls_json[0].function.arguments"),
    (pb.ChatMessage(role="user", content="x", tool_calls_json='[{"function": {"name": "f"}}]'),
     "chat.messages[0].tool_calls_json"),
    (pb.ChatMessage(role="user", content="x", tool_call_id="c"), "chat.messages[0].tool_call_id"),
    (pb.ChatMessage(role="assistant"), "chat.messages[0].content"),
])
def test_malformed_tool_messages_are_named(message, field):
    assert refused(chat_from_proto, pb.ChatMessages(messages=[message]))[0] == field


@pytest.mark.parametrize("tools_json, field", [
    ("{", "chat.tools_json"), ('{"a": 1}', "chat.tools_json"), ('[{"type": "function"}]', "chat.tools_json[0]"),
    ('[{"type": "function", "function": {"name": 3}}]', "chat.tools_json[0].function.name"),
    ("[" * 5000, "chat.tools_json"),
])
def test_malformed_tools_over_grpc_are_named(tools_json, field):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")], tools_json=tools_json)
    assert refused(chat_from_proto, chat)[0] == field


def test_a_template_that_cannot_use_the_tools_is_the_clients_error():
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = "{% for t in tools %}{{ t.function.name + 1 }}{% endfor %}"
    chat = chat_from_proto(pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")],
                                           tools_json=json.dumps([WEATHER])))
    assert refused(encode_chat, chat, tokenizer)[0] == "chat"


@pytest.mark.parametrize("depth", [700, 950])
def test_tools_and_calls_nested_near_the_parsers_limit_are_never_our_error(depth):
    """A body the JSON parser takes (it stops near 1,000 levels) whose schema or arguments are then
    written deeper (inside the required array; by the template's ``tojson``, jinja's frames on the
    stack): served, or a 400 saying so, never a RecursionError (a 500)."""
    nested = "{\"a\":" * depth + "{}" + "}" * depth
    tools = json.loads('[{"type": "function", "function": {"name": "f", "parameters": ' + nested + "}}]")
    calls = json.loads('[{"function": {"name": "f", "arguments": ' + nested + "}}]")
    for extra in ({"tools": tools, "tool_choice": "required"}, {"messages": [*USER, {"role": "assistant", "tool_calls": calls}]}):
        try:
            req = parse(ChatCompletionRequest, {"messages": USER} | extra)
            encode_chat(chat_from_proto(chat_request(req, None, plan(req)).chat), byte_level_tokenizer())
        except InvalidRequestError as exc:
            assert exc.message == "nested too deeply" or "recursion" in exc.message, exc
