"""Fuzz the OpenAI-compatible HTTP API: generated JSON bodies, valid and invalid, through a live
cluster (tiny random model, real Ray workers, the router's uvicorn), 8-16 in flight at a time,
on /v1/completions, /v1/chat/completions, /v1/responses, /tokenize and /detokenize, streaming or not.

The bodies mix OpenAI's and vLLM's parameters at edge values with wrong types (strings for
numbers, lists for strings, nested objects, nulls), JSON's odd corners (huge integers, NaN and
Infinity as Python's json writes them, lone surrogates spelt as ``\\u`` escapes, deep nesting),
unknown keys, bodies that are not objects and bytes that are not JSON. Every call ends within
its deadline with a 200 or a client error (400, 404, 409, 413, 429), never a 5xx; a 200 is
well-formed (a JSON body with its choices or tokens; a stream of ``data:`` events that are
JSON, ending with ``[DONE]``, with no error event of a server fault). Afterwards the server is
healthy, answers a greedy completion equal to HF, and holds nothing (leak check).

Replay a failure with the printed seed: PDSERVE_FUZZ_SEED=<seed> pytest tests/test_openai_fuzz.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import cluster_leaks, hf_greedy
from tests.test_cluster_e2e import start_cluster
from tests.test_fuzz import fuzzed
from tests.test_openai_api import SERVED_NAME, ExactTokenizer, ids_of

FUZZ_SEED = int(os.environ.get("PDSERVE_FUZZ_SEED", random.randrange(2**32)))
NUM_BATCHES = 100           # x 8-16 bodies: ~1,000 calls
CALL_DEADLINE_S = 30.0
CLIENT_ERRORS = {400, 404, 409, 413, 429}
SERVER_FAULTS = {"internal", "unavailable", "unknown", None}   # an error body's code (its gRPC status) that is ours
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def http_cluster(ray_session, tiny_model_dir):
    # Workers with a real tokenizer: structured outputs run their grammars; tool_choice "auto"'s
    # replies go through the hermes parser.
    cluster = start_cluster("disaggregated", model=str(tiny_model_dir), http_port=0, served_model_name=SERVED_NAME,
                            defaults={"max_tokens": 6}, tool_call_parser="hermes")
    cluster.cluster.servicer.tokenizer = ExactTokenizer()
    print(f"\nfuzz seed {FUZZ_SEED} (replay: PDSERVE_FUZZ_SEED={FUZZ_SEED})")
    yield cluster
    cluster.stop()


# ---- JSON values: any type where a parameter expects one --------------------------------------
odd_numbers = st.sampled_from([0, -1, 1, 2, 5, 20, 21, 2**31 - 1, 2**31, -2**31 - 1, 2**63, 2**70, -2**70,
                               0.0, -0.0, 0.5, 1.5, 1e-30, 1e30, 1.7e308, math.inf, -math.inf, math.nan, True, False])
odd_text = st.one_of(st.text(max_size=40), st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "tiny-llama", SERVED_NAME]))
scalars = st.one_of(st.none(), odd_numbers, odd_text, st.integers(-2**40, 2**40), st.floats())
any_json = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(odd_text, inner, max_size=4)), max_leaves=12)
token_ids = st.lists(st.integers(-3, 520), max_size=12)
# Grammars that compile, and text that may not: a structured output's every door draws them.
REGEXES = [r"[a-z]{1,4}", r"\d+", r"(yes|no)", r"a(", r"", r"[", r".*", r"x{3000}"]
SCHEMAS = [{"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "integer"}, {"type": "objectx"},
           {"enum": [1, "a", None]}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, True, False]
GRAMMARS = ['root ::= "a" [b-c]*', 'start: "x" | "y"', "start: foo", "root ::= [", ""]
regexes = st.one_of(st.sampled_from(REGEXES), odd_text)
schemas = st.one_of(st.sampled_from(SCHEMAS), any_json)
choices = st.one_of(st.lists(st.sampled_from(["yes", "no", "é", "", " "]), max_size=3), any_json)
grammars = st.one_of(st.sampled_from(GRAMMARS), odd_text)
structured_outputs = st.one_of(any_json, st.fixed_dictionaries({}, optional={
    "json": schemas, "json_object": st.booleans(), "regex": regexes, "choice": choices, "grammar": grammars,
    "disable_any_whitespace": st.booleans()}))
response_formats = st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), any_json,
                             st.fixed_dictionaries({"type": st.just("json_schema")},
                                                   optional={"json_schema": st.one_of(any_json, st.fixed_dictionaries(
                                                       {"name": odd_text}, optional={"schema": schemas}))}))

SAMPLING = {
    "max_tokens": st.one_of(st.integers(-1, 6), odd_numbers), "temperature": odd_numbers, "top_p": odd_numbers,
    "top_k": odd_numbers, "min_p": odd_numbers, "seed": odd_numbers, "n": st.one_of(st.integers(0, 3), odd_numbers),
    "presence_penalty": odd_numbers, "frequency_penalty": odd_numbers, "repetition_penalty": odd_numbers,
    "stop": st.one_of(odd_text, st.lists(odd_text, max_size=5)), "stop_token_ids": token_ids,
    "logit_bias": st.dictionaries(st.one_of(st.integers(-3, 520).map(str), odd_text), odd_numbers, max_size=4),
    "ignore_eos": st.booleans(), "min_tokens": odd_numbers, "include_stop_str_in_output": st.booleans(),
    "allowed_token_ids": token_ids, "skip_special_tokens": st.booleans(), "prompt_logprobs": odd_numbers,
    "stream": st.booleans(), "stream_options": st.one_of(st.just({"include_usage": True}), any_json),
    "ttft_ms": odd_numbers, "tpot_ms": odd_numbers, "priority": odd_numbers, "user": odd_text,
    "request_id": st.sampled_from(["a", "b", "c"]), "bad_words": st.lists(odd_text, max_size=2),
    "guided_json": schemas, "guided_regex": regexes, "guided_choice": choices, "guided_grammar": grammars,
    "structured_outputs": structured_outputs, "response_format": response_formats,
    "use_beam_search": st.booleans(), "truncate_prompt_tokens": odd_numbers,
}
COMPLETION = {"prompt": st.one_of(odd_text, token_ids, st.lists(odd_text, max_size=3), st.lists(token_ids, max_size=2)),
              "logprobs": odd_numbers, "echo": st.booleans(), "suffix": odd_text, "best_of": odd_numbers}
# Tools and earlier tool calls: well-formed, with odd names, schemas and arguments, or any JSON.
functions = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["f", "g", ""]), odd_text)},
                                  optional={"parameters": schemas, "description": odd_text, "strict": st.booleans()})
tools = st.one_of(st.just([]), any_json, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "function", "retrieval"]), "function": st.one_of(functions, any_json)}),
    max_size=3))
tool_choices = st.one_of(st.sampled_from(["none", "auto", "required", "any"]), any_json, st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})}))
tool_calls = st.one_of(any_json, st.lists(st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": st.sampled_from(["f", ""])}, optional={
        "arguments": st.one_of(st.sampled_from(['{"a": 1}', "{", "[1]", ""]), odd_text, any_json)})},
    optional={"id": odd_text, "type": st.sampled_from(["function", "x"])}), max_size=2))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "", "wizard"])},
    optional={"content": st.one_of(odd_text, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": odd_text}), max_size=2), any_json),
        "name": odd_text, "tool_calls": tool_calls, "tool_call_id": odd_text}), max_size=4)
CHAT = {"messages": st.one_of(messages, any_json), "max_completion_tokens": odd_numbers, "logprobs": st.booleans(),
        "top_logprobs": odd_numbers, "tools": tools, "tool_choice": tool_choices, "parallel_tool_calls": st.booleans(),
        "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(), "chat_template_kwargs": any_json}
# The Responses API: its input (a text, or items of any shape), instructions, text.format and the
# parameters a stateless server refuses; the chat API's names for the same things are in SAMPLING.
input_items = st.lists(st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "x"]),
    "role": st.sampled_from(["user", "assistant", "system", "developer", ""]),
    "content": st.one_of(odd_text, any_json, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image", "text"])},
        optional={"text": odd_text}), max_size=2))}), max_size=3)
text_formats = st.one_of(any_json, st.fixed_dictionaries({"format": st.one_of(
    any_json, st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    st.fixed_dictionaries({"type": st.just("json_schema")}, optional={"name": odd_text, "schema": schemas}))}))
RESPONSES = {"input": st.one_of(odd_text, input_items, any_json), "instructions": st.one_of(odd_text, any_json),
             "max_output_tokens": st.one_of(st.integers(-1, 6), odd_numbers), "text": text_formats,
             "store": st.one_of(st.booleans(), any_json), "metadata": any_json, "previous_response_id": odd_text,
             "tools": tools, "tool_choice": tool_choices, "reasoning": any_json, "include": any_json,
             "background": st.booleans(), "truncation": st.sampled_from(["auto", "disabled", "x"]),
             "top_logprobs": odd_numbers, "parallel_tool_calls": st.booleans()}
TOKENIZE = {"prompt": odd_text, "messages": messages, "add_special_tokens": st.booleans(), "tools": tools,
            "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
            "chat_template_kwargs": any_json, "return_token_strs": st.booleans(), "tokens": token_ids}


@st.composite
def valid_responses_body(draw) -> dict:
    body: dict = {"model": SERVED_NAME, "max_output_tokens": draw(st.integers(1, 6)),
                  "temperature": draw(st.sampled_from([0.0, 0.7, 2.0])), "stream": draw(st.booleans()),
                  "input": draw(st.one_of(st.text(min_size=1, max_size=30), st.lists(st.fixed_dictionaries(
                      {"role": st.sampled_from(["user", "assistant"]), "content": st.one_of(
                          st.text(min_size=1, max_size=20), st.lists(st.fixed_dictionaries(
                              {"type": st.just("input_text"), "text": st.text(max_size=20)}), min_size=1,
                              max_size=2))}), min_size=1, max_size=3)))}
    if draw(st.booleans()):
        body["instructions"] = draw(st.text(max_size=20))
    if draw(st.integers(0, 3)) == 0:
        body["text"] = {"format": draw(st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
            "type": "json_schema", "name": "n", "schema": {"type": "string", "maxLength": 3}}]))}
    if draw(st.booleans()):
        body |= {"store": draw(st.booleans()), "metadata": {"k": draw(st.text(max_size=5))}, "tool_choice": "auto"}
    return body


@st.composite
def valid_bodies(draw) -> tuple[str, bytes]:
    """Bodies the server should serve (or refuse only for a live duplicate id or capacity)."""
    body: dict = {"model": SERVED_NAME, "max_tokens": draw(st.integers(1, 6)),
                  "temperature": draw(st.sampled_from([0.0, 0.7, 2.0])), "stream": draw(st.booleans())}
    if draw(st.integers(0, 4)) == 0:
        return "/v1/responses", json.dumps(draw(valid_responses_body())).encode()
    if draw(st.booleans()):
        path = "/v1/completions"
        body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 511), min_size=1,
                                                                                         max_size=30)))
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 5))
            body["echo"] = draw(st.booleans())
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
        if draw(st.booleans()):
            body |= {"logprobs": True, "top_logprobs": draw(st.integers(0, 5))}
        if draw(st.integers(0, 2)) == 0:   # tools: a named call, calls required, or shown only
            body["tools"] = [{"type": "function", "function": {"name": name, "parameters": draw(st.sampled_from(
                [{"type": "object", "properties": {"x": {"type": "integer"}}}, {"type": "object"}]))}}
                for name in ("f", "g")]
            body["tool_choice"] = draw(st.sampled_from(["none", "required", "auto", {"type": "function",
                                                                                     "function": {"name": "g"}}]))
            return path, json.dumps(body).encode()   # a call's schema is its structured output
    if draw(st.booleans()):
        body["n"] = draw(st.integers(1, 3))
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(st.lists(st.integers(0, 511), max_size=3))
    if draw(st.booleans()):
        body["seed"] = draw(st.integers(0, 2**62))
    if draw(st.integers(0, 3)) == 0:   # a grammar that compiles
        body |= draw(st.sampled_from([{"guided_regex": r"[a-z]{1,4}"}, {"guided_choice": ["yes", "no"]},
                                      {"response_format": {"type": "json_object"}},
                                      {"structured_outputs": {"grammar": 'root ::= "a" [b-c]*'}},
                                      {"response_format": {"type": "json_schema", "json_schema": {
                                          "name": "n", "schema": {"type": "string", "maxLength": 3}}}}]))
    return path, json.dumps(body).encode()


@st.composite
def odd_bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.sampled_from(["object", "object", "object", "object", "not an object", "not JSON"]))
    if kind == "not JSON":
        return path, draw(st.one_of(st.binary(max_size=60), st.sampled_from(
            [b"", b"{", b'{"prompt": "a",}', b"[" * 5000, b'{"prompt": "\xff\xfe"}', b"null"])))
    if kind == "not an object":
        return path, json.dumps(draw(any_json)).encode()
    table = {"/v1/completions": SAMPLING | COMPLETION, "/v1/chat/completions": SAMPLING | CHAT,
             "/v1/responses": SAMPLING | RESPONSES}.get(path, TOKENIZE)
    body = {name: draw(strategy) for name, strategy in table.items() if draw(st.integers(0, 3)) == 0}
    if draw(st.booleans()):
        body["model"] = draw(st.one_of(st.just(SERVED_NAME), odd_text, any_json))
    body |= draw(st.dictionaries(odd_text, any_json, max_size=2))
    return path, json.dumps(body).encode()   # NaN / Infinity as Python writes them: not strict JSON


async def _call(session: aiohttp.ClientSession, base: str, path: str, data: bytes) -> tuple[int, str]:
    """(status, what was wrong with a 200's body, or '')."""
    async with session.post(base + path, data=data, headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, raw[:300].decode("utf-8", "replace")
        if resp.content_type == "text/event-stream":
            return 200, _bad_stream(raw.decode())
        body = json.loads(raw)
        key = {"/v1/responses": "output", "/tokenize": "tokens", "/detokenize": "prompt"}.get(path, "choices")
        return 200, "" if key in body else f"no {key!r} in {raw[:200]!r}"


def _bad_stream(text: str) -> str:
    if text.startswith("event: "):
        return _bad_responses_stream(text)
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"stream does not end with [DONE]: {text[-200:]!r}"
    for event in events[:-1]:
        parsed = json.loads(event)
        if "error" in parsed and parsed["error"].get("code") in SERVER_FAULTS:   # a fault after the first chunk
            return f"server error in the stream: {event[:200]}"
    return ""


def _bad_responses_stream(text: str) -> str:
    """A Responses API stream: numbered events, ending in the response's last state, and a
    fault after the first event only as an ``error`` event naming a client-side code."""
    events = [json.loads(line[len("data: "):]) for line in text.split("\n") if line.startswith("data: ")]
    if [e.get("sequence_number") for e in events] != list(range(len(events))):
        return f"events not numbered in order: {text[-200:]!r}"
    last = events[-1]["type"] if events else None
    if last not in ("response.completed", "response.incomplete", "response.failed"):
        return f"stream does not end with the response's state: {text[-200:]!r}"
    faults = [e for e in events if e["type"] == "error" and e.get("code") in SERVER_FAULTS]
    return f"server error in the stream: {faults[0]}" if faults else ""


async def _batch(base: str, batch: list[tuple[str, bytes]]) -> list[tuple[int, str]]:
    timeout = aiohttp.ClientTimeout(total=CALL_DEADLINE_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(_call(session, base, path, data) for path, data in batch))


def test_fuzzed_http_bodies_get_client_errors_or_results_and_leave_the_server_healthy(http_cluster, hf_reference):
    base = f"http://127.0.0.1:{http_cluster.cluster.http_port}"
    seen: dict[int, int] = {}

    @fuzzed(NUM_BATCHES, FUZZ_SEED)
    @given(st.lists(st.one_of(valid_bodies(), odd_bodies()), min_size=8, max_size=16))
    def run(batch):
        results = asyncio.run(_batch(base, batch))
        for status, _ in results:
            seen[status] = seen.get(status, 0) + 1
        bad = [(status, why, body) for (status, why), body in zip(results, batch)
               if (status == 200 and why) or (status != 200 and status not in CLIENT_ERRORS)]
        assert not bad, f"seed {FUZZ_SEED}: {bad[0]}"

    run()
    print(f"HTTP fuzz outcomes: {seen}")
    assert sum(seen.values()) >= 800 and seen.get(200, 0) >= 100 and seen.get(400, 0) >= 100
    _assert_healthy(base, hf_reference)
    assert cluster_leaks(http_cluster) == {}


def _assert_healthy(base: str, hf_reference) -> None:
    async def go() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/health") as health:
                assert health.status == 200
            body = {"model": SERVED_NAME, "prompt": [21, 22, 23, 24, 25], "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}
            async with session.post(base + "/v1/completions", json=body) as resp:
                return resp.status, await resp.json()

    status, body = asyncio.run(go())
    assert status == 200
    assert ids_of(body["choices"][0]["text"]) == hf_greedy(hf_reference, [21, 22, 23, 24, 25], 12)
