"""Fuzz: >= 1,000 generated GenerateRequests, valid and invalid, through a live router with real
Ray workers (tiny random model), 8-16 in flight at a time: text, chat and token-id prompts,
weird sampling values (NaN, inf, huge and tiny temperatures and penalties, logit biases outside the
vocabulary), stop strings, duplicate request
ids sent concurrently, priorities, SLO hints, max_tokens. Every call ends within its deadline
with a result or a client-error status (never INTERNAL, UNKNOWN or UNAVAILABLE); afterwards the
server is healthy, serves a greedy request equal to HF, and holds nothing (leak check).

Replay a failure with the printed seed: PDSERVE_FUZZ_SEED=<seed> pytest tests/test_fuzz.py.
"""

from __future__ import annotations

import asyncio
import math
import os
import random

import grpc
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.client import PdserveClient
from router.limits import ServerLimits
from tests.conftest import ByteTokenizer, cluster_leaks, hf_greedy
from tests.test_cluster_e2e import address, start_cluster

FUZZ_SEED = int(os.environ.get("PDSERVE_FUZZ_SEED", random.randrange(2**32)))
NUM_BATCHES = 125           # x 8-16 requests: >= 1,000 requests whatever the seed draws (100 drew 985 once)
CALL_DEADLINE_S = 30.0
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}
# Short SLO ranges: a request with an unreachable TPOT target queues until its TTFT deadline.
LIMITS = ServerLimits(max_ttft_ms=2000.0, max_tpot_ms=2000.0, max_prompt_bytes=4096)


def fuzzed(num_batches: int, fuzz_seed: int):
    """hypothesis' settings for a fuzz through a live cluster (this one and test_openai_fuzz's):
    the printed seed, ``num_batches`` examples, no deadline (a batch waits on real workers), no
    example database, and no health check that a slow or large batch would trip."""
    def wrap(test):
        return seed(fuzz_seed)(settings(
            max_examples=num_batches, deadline=None, database=None, derandomize=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
        )(test))

    return wrap


@pytest.fixture(scope="module")
def fuzz_cluster(ray_session, tiny_model_dir):
    # Workers with a real tokenizer: structured outputs run their grammars, stop strings their engine check.
    cluster = start_cluster("disaggregated", model=str(tiny_model_dir), defaults={"max_tokens": 6, "limits": LIMITS})
    cluster.cluster.servicer.tokenizer = ByteTokenizer()
    print(f"\nfuzz seed {FUZZ_SEED} (replay: PDSERVE_FUZZ_SEED={FUZZ_SEED})")
    yield cluster
    cluster.stop()


weird_floats = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-30, 1e-6, 1e-5, 0.5, 1.0, 1e30, 1.7e308, math.inf, -math.inf, math.nan, -1.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)
texts = st.text(max_size=120)
token_lists = st.lists(st.integers(-3, 520), max_size=60)
chat = st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", "tool", "", "wizard"]), texts), max_size=6)
# (kind, text) of structured outputs that compile; the odd ones draw any text for any kind.
GUIDES = [("regex", r"[a-z]{1,4}"), ("regex", r"(yes|no)!?"), ("json", '{"type": "string", "maxLength": 3}'),
          ("json", '{"type": "object"}'), ("grammar", 'root ::= "a" [b-c]*'), ("grammar", 'start: "x" | "y"'),
          ("choice", ["yes", "no"]), ("json_object", True)]


def _set_guide(s: pb.SamplingParams, kind: str, value) -> None:
    if kind == "choice":
        s.structured_output.choice.choices.extend(value)
    else:
        setattr(s.structured_output, kind, value)


TOOLS_JSON = ['[{"type": "function", "function": {"name": "f"}}]', "[]", "{}", "[", '[{"type": "function"}]',
              '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]', "[" * 3000]
TOOL_CALLS_JSON = ['[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}]',
                   '[{"function": {"name": "f", "arguments": {"a": [1]}}}]', '[{"function": {"name": "f", "arguments": "{"}}]',
                   "[]", "[1]", '[{"function": {"name": ""}}]']


@st.composite
def requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "token_ids", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "chat":
        req.chat.SetInParent()
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in draw(chat))
        if draw(st.booleans()):   # the chat template's options, sense and nonsense
            req.chat.add_generation_prompt = draw(st.booleans())
            req.chat.continue_final_message = draw(st.booleans())
            req.chat.template_kwargs_json = draw(st.one_of(texts, st.sampled_from(
                ['{"enable_thinking": false}', '{"tokenize": false}', "[]", "{", "[" * 3000, '{"x": [1, {"y": null}]}'])))
        if draw(st.booleans()):   # tools for the template, and earlier tool calls: sense and nonsense
            req.chat.tools_json = draw(st.one_of(texts, st.sampled_from(TOOLS_JSON)))
            for m in req.chat.messages:
                if draw(st.booleans()):
                    m.tool_calls_json = draw(st.one_of(texts, st.sampled_from(TOOL_CALLS_JSON)))
                    m.tool_call_id = draw(st.sampled_from(["", "c1"]))
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(draw(token_lists))
    s = req.sampling
    optional = {
        "max_tokens": st.one_of(st.integers(-2, 8), st.just(10**6)),
        "temperature": weird_floats, "top_p": weird_floats,
        "top_k": st.one_of(st.integers(-2, 5), st.just(10**6)),
        "seed": st.integers(-1, 2**40), "ignore_eos": st.booleans(), "logprobs": st.booleans(),
        "top_logprobs": st.one_of(st.integers(-2, 22), st.just(2**31 - 1)),
        "prompt_logprobs": st.one_of(st.integers(-2, 22), st.just(2**31 - 1), st.just(-2**31)),
        "repetition_penalty": weird_floats, "frequency_penalty": weird_floats, "presence_penalty": weird_floats,
        "min_p": weird_floats, "min_tokens": st.one_of(st.integers(-2, 9), st.just(2**31 - 1)),
        "truncate_prompt_tokens": st.one_of(st.integers(-3, 70), st.just(2**31 - 1), st.just(-2**31)),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            setattr(s, name, draw(strategy))
    for token, bias in draw(st.dictionaries(st.one_of(st.integers(-3, 520), st.just(2**62)), weird_floats, max_size=8)).items():
        s.logit_bias[token] = bias
    s.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    s.bad_words.extend(draw(st.lists(st.one_of(st.text(max_size=30), st.sampled_from(["", " ", "\x00", "é"])),
                                     max_size=5)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(-1, 520), max_size=70)))
    s.allowed_token_ids.extend(draw(st.lists(st.integers(-1, 520), max_size=8)))
    if draw(st.integers(0, 3)) == 0:   # a structured output: one that compiles, or any text for any kind
        kind, value = draw(st.one_of(st.sampled_from(GUIDES), st.tuples(
            st.sampled_from(["json", "regex", "grammar"]), st.one_of(texts, st.sampled_from(["[", "a(", "{", "x" * 70_000]))),
            st.tuples(st.just("choice"), st.lists(st.one_of(texts, st.just("")), max_size=4)),
            st.tuples(st.just("json_object"), st.booleans())))
        _set_guide(s, kind, value)
    if draw(st.booleans()):   # a small pool, so concurrent duplicates are common
        req.request_id = draw(st.one_of(st.sampled_from(["a", "b", "c", ""]), st.text(min_size=250, max_size=260)))
    for name in ("ttft_ms", "tpot_ms"):
        if draw(st.booleans()):
            setattr(req, name, draw(weird_floats))
    if draw(st.booleans()):
        req.priority = draw(st.integers(-2**31, 2**31 - 1))
    if draw(st.booleans()):
        req.skip_special_tokens = draw(st.booleans())
    return req


@st.composite
def valid_requests(draw) -> pb.GenerateRequest:
    """Requests the server should serve (or refuse only for capacity or a live duplicate id):
    edge values inside the rules, so most of them run on the workers."""
    req = pb.GenerateRequest()
    kind = draw(st.sampled_from(["text", "chat", "token_ids"]))
    if kind == "text":
        req.text = draw(st.text(min_size=1, max_size=60))
    elif kind == "chat":
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in draw(
            st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), st.text(min_size=1, max_size=30)),
                     min_size=1, max_size=3)))
    else:
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 511), min_size=1, max_size=40)))
    s = req.sampling
    s.max_tokens = draw(st.integers(1, 6))
    s.temperature = draw(st.sampled_from([0.0, 1e-30, 9e-6, 1e-5, 0.7, 2.0, 1e30, 1.7e308]))
    s.top_p = draw(st.sampled_from([1e-12, 0.1, 0.9, 1.0]))
    s.top_k = draw(st.sampled_from([0, 1, 5, 10**6]))
    s.min_p = draw(st.sampled_from([0.0, 1e-9, 0.3, 1.0]))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**62))
    s.ignore_eos, s.logprobs = draw(st.booleans()), draw(st.booleans())
    s.include_stop_str_in_output = draw(st.booleans())
    if s.logprobs:
        s.top_logprobs = draw(st.sampled_from([0, 1, 5, 20]))
    if draw(st.booleans()):
        s.prompt_logprobs = draw(st.sampled_from([0, 1, 20]))
    if draw(st.booleans()):
        s.min_tokens = draw(st.integers(0, s.max_tokens))
    if draw(st.booleans()):   # with min_tokens too: stop strings count after min_tokens tokens
        s.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, 511), max_size=3)))
    s.bad_words.extend(draw(st.lists(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1,
                                             max_size=3), max_size=2)))
    if draw(st.booleans()):
        s.repetition_penalty = draw(st.sampled_from([1e-30, 0.5, 1.0, 2.0, 1e30]))
        s.frequency_penalty = draw(st.sampled_from([-2.0, 0.0, 0.7, 2.0]))
        s.presence_penalty = draw(st.sampled_from([-2.0, 0.0, 1.3, 2.0]))
        for token, bias in draw(st.dictionaries(st.integers(0, 511), st.sampled_from([-100.0, -1.0, 0.0, 3.0, 100.0]),
                                                max_size=4)).items():
            s.logit_bias[token] = bias
        s.allowed_token_ids.extend(draw(st.lists(st.integers(0, 511), max_size=5)))
    if draw(st.integers(0, 3)) == 0:   # a grammar that compiles (with the rest: a dead end is INVALID_ARGUMENT)
        _set_guide(s, *draw(st.sampled_from(GUIDES)))
    if draw(st.booleans()):
        req.request_id = draw(st.sampled_from(["a", "b", "c", "d"]))
    for name in ("ttft_ms", "tpot_ms"):
        if draw(st.booleans()):
            setattr(req, name, draw(st.sampled_from([1e-9, 1.0, 50.0, 1e5, 1e300])))
    if draw(st.booleans()):
        req.priority = draw(st.integers(-2**31, 2**31 - 1))
    return req


async def _call(stub, req: pb.GenerateRequest) -> grpc.StatusCode:
    try:
        async for _ in stub.Generate(req, timeout=CALL_DEADLINE_S):
            pass
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        _call.details[exc.code()] = exc.details()
        return exc.code()


_call.details = {}


async def _batch(addr: str, batch: list[pb.GenerateRequest]) -> list[grpc.StatusCode]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.PdserveStub(channel)
        return await asyncio.gather(*(_call(stub, r) for r in batch))


def test_fuzzed_requests_get_client_errors_or_results_and_leave_the_server_healthy(fuzz_cluster, hf_reference):
    addr = address(fuzz_cluster)
    seen: dict[grpc.StatusCode, int] = {}

    @fuzzed(NUM_BATCHES, FUZZ_SEED)
    @given(st.lists(st.one_of(valid_requests(), requests()), min_size=8, max_size=16))
    def run(batch):
        codes = asyncio.run(_batch(addr, batch))
        for code in codes:
            seen[code] = seen.get(code, 0) + 1
        bad = [(c, _call.details.get(c), r) for c, r in zip(codes, batch) if c is not grpc.StatusCode.OK and c not in CLIENT_ERRORS]
        assert not bad, f"seed {FUZZ_SEED}: {bad[0]}"

    run()
    print(f"fuzz outcomes: { {c.name: n for c, n in seen.items()} }")
    assert sum(seen.values()) >= 1000 and seen.get(grpc.StatusCode.OK, 0) >= 200
    _assert_healthy(addr, hf_reference)
    assert cluster_leaks(fuzz_cluster) == {}


def _assert_healthy(addr: str, hf_reference) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Pdserve"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    prompt = [21, 22, 23, 24, 25]
    with PdserveClient(addr, timeout_s=CALL_DEADLINE_S) as client:
        result = client.generate_text(token_ids=prompt, max_tokens=12, ignore_eos=True, temperature=0.0)
    assert result.token_ids == hf_greedy(hf_reference, prompt, 12)
