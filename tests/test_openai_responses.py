"""OpenAI's Responses API (``POST /v1/responses``, router/openai_api/responses_api.py) over a real
cluster (tiny random Llama, real Ray actors), driven by the official ``openai`` client: the
response's text is the chat request's it means, token for token (and HF's); streamed, the typed
events in order, numbered, joining to the same text; ``incomplete`` at the length; a bad
``text.format`` refused by name (its output: test_openai_smollm2.py); every parameter a stateless server cannot honour, and the chat
API's names, a 400 naming it (counted invalid); a reused id 409; admission's refusal 429; a
client that leaves mid-stream frees its KV; a decode worker killed mid-stream costs the stream
nothing. Every test ends with the leak check."""

from __future__ import annotations

import json
import time

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine.types import FinishReason, TokenDelta
from router.convert import RequestTimings, Usage
from router.generation import GenerationEvent
from router.openai_api.protocol import ResponsesRequest
from router.openai_api.responses_api import ResponsesFormat
from tests.conftest import cluster_leaks, hf_greedy, outcomes_since, request_outcomes
from tests.test_openai_api import (ExactTokenizer, _error, aborted, client_for, cluster, grpc_ids, ids_of,  # noqa: F401
                                   model_name, wait_for)

EVENTS = TypeAdapter(ResponseStreamEvent)


def _stream_events(client, **kwargs) -> list:
    with client.responses.create(stream=True, **kwargs) as stream:
        return list(stream)


def test_a_response_is_the_chat_requests_text_and_hfs_tokens(cluster, model_name, hf_reference):
    client = client_for(cluster)
    r = client.responses.create(model=model_name, input="hello", instructions="be brief", max_output_tokens=10,
                                extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                          extra_body={"ignore_eos": True})
    assert isinstance(r, Response) and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    prompt = ExactTokenizer().apply_chat_template(messages)
    assert ids_of(r.output_text) == hf_greedy(hf_reference, prompt, 10) == grpc_ids(
        cluster, chat=messages, max_tokens=10, ignore_eos=True)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == len(prompt) and r.usage.output_tokens == 10 and r.usage.total_tokens == len(prompt) + 10
    assert r.instructions == "be brief" and r.store is False and r.max_output_tokens == 10
    assert cluster_leaks(cluster) == {}


def test_input_items_are_the_conversation(cluster, model_name):
    client = client_for(cluster)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
             {"role": "user", "content": "again"}]
    r = client.responses.create(model=model_name, input=items, max_output_tokens=6, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    assert ids_of(r.output_text) == grpc_ids(cluster, chat=messages, max_tokens=6, ignore_eos=True)
    assert cluster_leaks(cluster) == {}


def test_streamed_events_come_in_the_apis_order_and_join_to_the_whole_text(cluster, model_name):
    client = client_for(cluster)
    kwargs = dict(model=model_name, input="stream me", max_output_tokens=12, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kwargs)
    events = _stream_events(client, **kwargs)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == events[-4].text == final.output_text
    assert final.usage.output_tokens == 12 and final.id == events[0].response.id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert cluster_leaks(cluster) == {}


def test_a_stop_completes_whole_and_through_the_sdks_stream_helper(cluster, model_name):
    client = client_for(cluster)
    ids = grpc_ids(cluster, chat=[{"role": "user", "content": "stop"}], max_tokens=6, ignore_eos=True)
    kwargs = dict(model=model_name, input="stop", max_output_tokens=40,
                  extra_body={"stop_token_ids": [ids[3]], "ignore_eos": True})
    r = client.responses.create(**kwargs)
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    assert ids_of(r.output_text) == ids[:ids.index(ids[3])]
    with client.responses.stream(**kwargs) as stream:   # the SDK's helper assembles the same response
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == r.output_text
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("kwargs, param", [
    (dict(previous_response_id="resp_earlier"), "previous_response_id"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(reasoning={"effort": "low"}), "reasoning"),
    (dict(background=True), "background"),
    (dict(include=["message.output_text.logprobs"]), "include"),
    (dict(truncation="auto"), "truncation"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(extra_body={"messages": [{"role": "user", "content": "x"}]}), "messages"),
    (dict(extra_body={"max_tokens": 5}), "max_tokens"),
    (dict(extra_body={"n": 2}), "n"),
    (dict(extra_body={"response_format": {"type": "json_object"}}), "response_format"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "o"}]), "input[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input[0].content[0]"),
    (dict(input=[{"content": "no role"}]), "input[0].role"),
    (dict(input=7), "input"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(max_output_tokens=10**6), "max_output_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}), "text.format"),
    (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
])
def test_what_cannot_be_served_is_a_400_naming_the_parameter(cluster, model_name, kwargs, param):
    kwargs.setdefault("input", "hi")
    before = request_outcomes(cluster)
    err = _error(lambda: client_for(cluster).responses.create(model=model_name, **kwargs))
    assert isinstance(err, openai.BadRequestError), err
    assert err.body["param"] == param and err.body["message"].startswith(param + ":"), err.body
    assert outcomes_since(cluster, before) == {"invalid": 1}
    assert cluster_leaks(cluster) == {}


def test_a_reused_id_is_409_and_the_first_stream_goes_on(cluster, model_name):
    client = client_for(cluster)
    with client.responses.create(model=model_name, input="long", max_output_tokens=200, stream=True,
                                 extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "resp-dup"}) as first:
        events = iter(first)
        head = next(events)
        err = _error(lambda: client.responses.create(model=model_name, input="x", max_output_tokens=2,
                                                     extra_headers={"X-Request-Id": "resp-dup"}))
        assert isinstance(err, openai.ConflictError) and "resp-dup" in err.body["message"]
        rest = list(events)
    assert head.response.id == "resp_resp-dup" and rest[-1].type == "response.incomplete"
    assert rest[-1].response.usage.output_tokens == 200
    assert cluster_leaks(cluster) == {}


def test_admission_refusal_is_429(cluster, model_name):
    import asyncio

    async def burst():
        client = openai.AsyncOpenAI(base_url=str(client_for(cluster).base_url), api_key="unused", max_retries=0,
                                    timeout=60)
        async with client:
            return await asyncio.gather(*(client.responses.create(
                model=model_name, input="".join(chr(ord("a") + (i * 7 + j) % 26) for j in range(400)),
                max_output_tokens=2, extra_body={"ttft_ms": 10}) for i in range(16)), return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(isinstance(r, openai.RateLimitError) and "TTFT" in r.body["message"] for r in refused)
    assert all(isinstance(r, Response) and r.usage.output_tokens == 2 for r in results if r not in refused)
    assert cluster_leaks(cluster) == {}


def test_a_client_that_leaves_mid_stream_frees_its_request(cluster, model_name):
    client = client_for(cluster)
    before = aborted(cluster)
    stream = client.responses.create(model=model_name, input="go", max_output_tokens=400, stream=True,
                                     extra_body={"ignore_eos": True})
    events = iter(stream)
    while next(events).type != "response.output_text.delta":
        pass
    stream.close()
    assert wait_for(lambda: aborted(cluster) == before + 1), "the request was not aborted"
    assert cluster_leaks(cluster) == {}
    again = client.responses.create(model=model_name, input="go", max_output_tokens=3, extra_body={"ignore_eos": True})
    assert again.usage.output_tokens == 3


def test_a_stream_survives_its_decode_workers_death_with_hfs_tokens(cluster, model_name, hf_reference):
    """The decode worker is killed once the stream has text: the request moves, and the events go on
    in order to the whole of HF's greedy tokens."""
    from tests.test_failures import _kill, _wait_ready

    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts
    messages = [{"role": "user", "content": "survive"}]
    ref = hf_greedy(hf_reference, ExactTokenizer().apply_chat_template(messages), 120)
    with client_for(cluster).responses.create(model=model_name, input="survive", max_output_tokens=120, stream=True,
                                              extra_body={"ignore_eos": True}) as stream:
        events, text, killed = [], "", False
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                text += event.delta
                if len(text) > 5 and not killed:
                    _kill(decode.pid)
                    killed = True
    assert ids_of(text) == ref and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    _wait_ready(cluster, "decode-0", restarts + 1)
    assert wait_for(lambda: cluster_leaks(cluster) == {})


# ---------------------------------------------------------------- the format alone


def _event(text: str, reason: FinishReason | None = None) -> GenerationEvent:
    delta = TokenDelta("r", (1,), finish_reason=reason)
    return GenerationEvent(delta, text, Usage(5, 3) if reason else None,
                           RequestTimings(prefill_cached_tokens=4) if reason else None)


def _frames(raw: bytes) -> list[dict]:
    out = []
    for frame in raw.decode().split("\n\n"):
        if frame:
            kind, data = frame.split("\n")
            body = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {body['type']}"
            out.append(body)
    return out


def test_every_frame_parses_as_the_sdks_event_types_an_error_included():
    fmt = ResponsesFormat("resp_x", "m", ResponsesRequest.model_validate({"input": "hi", "metadata": {"k": "v"}}),
                          created=int(time.time()))
    raw = fmt.stream_head() + fmt.stream_event(_event("a")) + fmt.stream_event(_event("")) + fmt.stream_event(_event("b"))
    failed = fmt.stream_error({"error": {"message": "worker lost", "type": "server_error", "param": None,
                                         "code": "unavailable"}})
    events = [EVENTS.validate_python(b) for b in _frames(raw + failed)]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.status == "failed" and events[-1].response.error.message == "worker lost"
    assert events[-2].message == "worker lost" and events[-1].response.metadata == {"k": "v"}
    done = ResponsesFormat("resp_y", "m", ResponsesRequest.model_validate({"input": "hi"}))
    tail = _frames(done.stream_head() + done.stream_event(_event("ab")) +
                   done.stream_tail(_event("", FinishReason.STOP), Usage(5, 3)))
    final = EVENTS.validate_python(tail[-1])
    assert final.type == "response.completed" and final.response.output_text == "ab"
    assert final.response.usage.input_tokens_details.cached_tokens == 4
    whole = Response.model_validate(done.whole([_event("a"), _event("b", FinishReason.LENGTH)]))
    assert whole.status == "incomplete" and whole.output_text == "ab" and whole.usage.total_tokens == 8
