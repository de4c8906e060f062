"""Tool calling over a real cluster (the tiny random Llama with a real byte-level tokenizer and a
chat template that shows tools, on disk: conftest's ``tiny_model_dir``; real Ray actors, gRPC and HTTP): a named call's arguments
and a required array of calls are Hugging Face's tokens under the same schema, on the prompt the
template renders with the tools, whole and streamed; a named call's stream survives its decode
worker's death; a client that leaves frees its request; tool choices that cannot be served, bad
schemas and malformed earlier calls are a 400 / INVALID_ARGUMENT naming the parameter; a burst
past ``max_concurrent_streams`` is refused, not queued. Every test ends with the leak check."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import openai
import pytest

from engine.types import GuideKind, StructuredOutput
from protos import pdserve_pb2 as pb
from router.client import PdserveClient
from router.limits import ServerLimits
from router.openai_api.protocol import ChatCompletionRequest
from router.openai_api.requests import parse
from router.openai_api.tool_calls import ToolCallOutput, plan
from tests.conftest import byte_level_tokenizer, cluster_leaks
from tests.test_cluster_e2e import address, start_cluster
from tests.test_openai_api import _post, wait_for
from tests.test_structured_output import EOS, hf_guided
from tests.test_structured_output_cluster import http, ll_tokenizer, model  # noqa: F401  (fixtures)

MAX_STREAMS = 6
CITY = {"type": "function", "function": {"name": "city", "parameters": {
    "type": "object", "properties": {"name": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer",
                                                                                          "minimum": 0, "maximum": 9}},
    "required": ["name", "days"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "pattern": "^[a-z]{40,50}$"}},
    "required": ["text"], "additionalProperties": False}}}
TOOLS = [CITY, NOTE]
USER = [{"role": "user", "content": "go"}]
# The random model's favourite tokens where JSON allows them are blanks: banned (byte-level ids of
# tab, newline, carriage return, space), so its replies are calls with arguments, not whitespace.
NO_BLANKS = {3 + ord(c): -100.0 for c in "\t\n\r "}
SAMPLE = {"temperature": 0, "logit_bias": {str(t): b for t, b in NO_BLANKS.items()}}


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    limits = ServerLimits(max_concurrent_streams=MAX_STREAMS)
    cluster = start_cluster("disaggregated", model=str(tiny_model_dir), http_port=0, defaults={"limits": limits},
                            tool_call_parser="hermes")
    yield cluster
    cluster.stop()


def prompt_ids(messages, tools) -> list[int]:
    out = byte_level_tokenizer().apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def reference(hf_reference, ll_tokenizer, body: dict, max_tokens: int) -> tuple[str, list, str]:
    """HF's reply under the tool choice's schema, on the template's prompt: its text, and that text
    as calls and content (ids aside) by the same rule the server applies."""
    tools = plan(parse(ChatCompletionRequest, body))
    tokens = hf_guided(hf_reference, ll_tokenizer, prompt_ids(body["messages"], body["tools"]),
                       StructuredOutput(GuideKind.JSON, json.dumps(tools.schema)), max_tokens,
                       sequence_bias={(t,): b for t, b in NO_BLANKS.items()})
    text = byte_level_tokenizer().decode([t for t in tokens if t != EOS])
    calls, content = ToolCallOutput(tools).calls(text)
    return text, [c["function"] for c in calls], content


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def streamed_calls(stream) -> tuple[list[dict], str, str]:
    """A streamed reply's calls merged by index as a client merges them, its content, finish reason."""
    calls, content, finish = {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function.name:
                entry["name"] = call.function.name
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["named", "required", "required, one"])
def test_tool_calls_are_hfs_tokens_under_the_tools_schema_whole_and_streamed(cluster, model, hf_reference,
                                                                             ll_tokenizer, choice):
    """Named: one call, its arguments the reply. Required: the random model keeps adding calls
    until max_tokens cuts one short (whole calls, then that text as content); with
    parallel_tool_calls false the array closes after its one call."""
    body = {"messages": USER, "tools": TOOLS, "tool_choice": named("city") if choice == "named" else "required"}
    if choice == "required, one":
        body["parallel_tool_calls"] = False
    text, want_calls, want_content = reference(hf_reference, ll_tokenizer, body, 60)
    if choice == "named":
        assert want_calls == [{"name": "city", "arguments": text}]
    whole = http(cluster).chat.completions.create(model=model, max_tokens=60, **SAMPLE, **body)
    message = whole.choices[0].message
    assert [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []] == want_calls
    assert message.content == want_content
    assert whole.choices[0].finish_reason in ("stop", "length")
    calls, content, finish = streamed_calls(http(cluster).chat.completions.create(
        model=model, max_tokens=60, stream=True, **SAMPLE, **body))
    assert calls == want_calls and content == want_content and finish == whole.choices[0].finish_reason
    with PdserveClient(address(cluster)) as client:   # gRPC: the tools for the template, the schema as the guide
        schema = json.dumps(plan(parse(ChatCompletionRequest, body)).schema)
        result = client.generate_text(chat=USER, tools=TOOLS, max_tokens=60, temperature=0, logit_bias=NO_BLANKS,
                                      structured_output=pb.StructuredOutput(json=schema))
    assert result.text == text
    assert want_calls and all(c["name"] in ("city", "note") and json.loads(c["arguments"]) for c in calls)
    assert bool(want_content) == (choice == "required"), "each case's reply is the kind the test means"
    assert cluster_leaks(cluster) == {}


def test_an_earlier_call_and_its_answer_reach_the_template(cluster, model):
    messages = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "city", "arguments": '{"name": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    status, got = _post(f"http://127.0.0.1:{cluster.cluster.http_port}/tokenize",
                        {"model": model, "messages": messages, "tools": TOOLS})
    assert status == 200, got
    assert got["tokens"] == prompt_ids(
        [messages[0], messages[1] | {"content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "city", "arguments": {"name": "Rome", "days": 2}}}]}, messages[2]], TOOLS)
    reply = http(cluster).chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                                  max_tokens=5, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.usage.prompt_tokens == got["count"]
    assert cluster_leaks(cluster) == {}


def test_auto_finds_the_models_own_calls_in_hfs_text(cluster, model, hf_reference, ll_tokenizer):
    """tool_choice "auto" with the hermes parser: the reply is free text (here steered into hermes'
    syntax by a regex, so the random model writes a call), whole and streamed: the calls the text
    holds, the text before them as content, finish reason tool_calls; a reply without a call is
    content, finish reason stop."""
    prompt = prompt_ids(USER, TOOLS)
    steer = r'Ok\. <tool_call>\{"name": "city", "arguments": \{"name": "(Paris|Rome)", "days": [0-9]\}\}</tool_call>'
    for regex, want_calls in [(steer, 1), ("[a-z]{5,9}", 0)]:
        tokens = hf_guided(hf_reference, ll_tokenizer, prompt, StructuredOutput(GuideKind.REGEX, regex), 90,
                           sequence_bias={(t,): b for t, b in NO_BLANKS.items()})
        text = byte_level_tokenizer().decode([t for t in tokens if t != EOS])
        body = {"messages": USER, "tools": TOOLS, "extra_body": {"guided_regex": regex}}
        whole = http(cluster).chat.completions.create(model=model, max_tokens=90, **SAMPLE, **body)
        message, finish = whole.choices[0].message, whole.choices[0].finish_reason
        if want_calls:
            call = message.tool_calls[0].function
            arguments = json.loads(call.arguments)
            assert call.name == "city" and text.endswith(f'"arguments": {json.dumps(arguments)}}}</tool_call>')
            assert message.content == "Ok. " and finish == "tool_calls"
        else:
            assert message.tool_calls is None and message.content == text and finish == "stop"
        calls, content, streamed_finish = streamed_calls(http(cluster).chat.completions.create(
            model=model, max_tokens=90, stream=True, **SAMPLE, **body))
        assert ([{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []],
                message.content, finish) == (calls, content, streamed_finish)
    assert cluster_leaks(cluster) == {}


def test_a_named_calls_stream_survives_its_decode_workers_death(cluster, model, hf_reference, ll_tokenizer):
    """A long call (a 40-50 letter argument) streaming when its decode worker is SIGKILLed: it
    resumes on the replacement inside its schema, and the client's arguments are HF's."""
    from tests.test_failures import _kill, _wait_ready

    body = {"messages": USER, "tools": TOOLS, "tool_choice": named("note")}
    text, _, _ = reference(hf_reference, ll_tokenizer, body, 80)
    assert len(text) > 45
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts
    arguments, killed = "", False
    for chunk in http(cluster).chat.completions.create(model=model, max_tokens=80, stream=True, **SAMPLE, **body):
        for call in chunk.choices[0].delta.tool_calls or []:
            arguments += call.function.arguments or ""
        if not killed and len(arguments) > 10:
            _kill(decode.pid)
            killed = True
    assert killed and arguments == text
    _wait_ready(cluster, "decode-0", restarts + 1)
    assert wait_for(lambda: cluster_leaks(cluster) == {})


def test_auto_calls_in_a_stream_across_its_decode_workers_death_are_hfs(cluster, model, hf_reference, ll_tokenizer):
    """tool_choice "auto": content streams, then the decode worker is SIGKILLed before the call is
    written; the request resumes on the replacement, and the client's content and call are what the
    whole of HF's text holds (the parser sees one unbroken text)."""
    from tests.test_failures import _kill, _wait_ready

    regex = r'Ok [a-z]{30,40}\. <tool_call>\{"name": "note", "arguments": \{"text": "[a-z]{40}"\}\}</tool_call>'
    tokens = hf_guided(hf_reference, ll_tokenizer, prompt_ids(USER, TOOLS), StructuredOutput(GuideKind.REGEX, regex),
                       200, sequence_bias={(t,): b for t, b in NO_BLANKS.items()})
    text = byte_level_tokenizer().decode([t for t in tokens if t != EOS])
    want = ToolCallOutput(plan(parse(ChatCompletionRequest, {"messages": USER, "tools": TOOLS}), "hermes")).calls(text)
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts
    calls, content, killed = [], "", False
    for chunk in http(cluster).chat.completions.create(model=model, messages=USER, tools=TOOLS, max_tokens=200,
                                                       stream=True, extra_body={"guided_regex": regex}, **SAMPLE):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [{"name": c.function.name, "arguments": c.function.arguments} for c in delta.tool_calls or []]
        if not killed and len(content) > 5:
            _kill(decode.pid)
            killed = True
    assert killed and calls == [c["function"] for c in want[0]] and len(calls) == 1
    assert content == want[1] and content.startswith("Ok ") and text.endswith("</tool_call>")
    _wait_ready(cluster, "decode-0", restarts + 1)
    assert wait_for(lambda: cluster_leaks(cluster) == {})


def test_a_client_leaving_a_tool_call_stream_frees_it(cluster, model):
    base = f"http://127.0.0.1:{cluster.cluster.http_port}/v1"
    body = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300,
            "stream": True}

    async def leave() -> None:
        async with aiohttp.ClientSession() as session, session.post(base + "/chat/completions", json=body) as resp:
            assert resp.status == 200
            async for _ in resp.content:
                break

    asyncio.run(leave())
    assert wait_for(lambda: cluster_leaks(cluster) == {})


@pytest.mark.parametrize("extra, param, says", [
    ({"tools": TOOLS, "tool_choice": named("weather")}, "tool_choice.function.name", "'weather'"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools", "objectx"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": TOOLS, "tool_choice": "none", "messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "city", "arguments": "{nope"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "none"}, "tools[0].function.name", ""),
])
def test_what_cannot_be_served_is_a_400_naming_the_parameter(cluster, model, extra, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        http(cluster).chat.completions.create(model=model, max_tokens=4, **({"messages": USER} | extra))
    assert err.value.body["param"] == param and says in err.value.body["message"], err.value.body
    with PdserveClient(address(cluster)) as client, pytest.raises(grpc.RpcError) as rpc:
        client.generate_text(chat=USER, tools=[{"type": "f"}], max_tokens=4)
    assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and rpc.value.details().startswith("chat.tools_json[0]")
    assert cluster_leaks(cluster) == {}


def test_a_burst_of_tool_calls_past_the_stream_limit_is_refused_not_queued(cluster, model, hf_reference,
                                                                           ll_tokenizer):
    body = {"messages": USER, "tools": TOOLS, "tool_choice": named("note")}
    text, _, _ = reference(hf_reference, ll_tokenizer, body, 70)

    async def burst():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.cluster.http_port}/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(client.chat.completions.create(model=model, max_tokens=70, **SAMPLE,
                                                                        **body) for _ in range(2 * MAX_STREAMS)),
                                        return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(isinstance(r, openai.RateLimitError) for r in refused), refused[:1]
    served = [r for r in results if not isinstance(r, Exception)]
    assert len(served) >= MAX_STREAMS // 2
    assert all(r.choices[0].message.tool_calls[0].function.arguments == text for r in served)
    assert wait_for(lambda: cluster_leaks(cluster) == {})
