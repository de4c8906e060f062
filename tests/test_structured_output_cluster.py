"""Structured output over a real cluster (tiny random Llama with a real byte-level tokenizer on
disk, so workers and router load it as any model; real Ray actors, gRPC and HTTP): every way to
ask (gRPC's ``structured_output``, OpenAI's ``response_format``, vLLM's ``structured_outputs``
and ``guided_*``) gives Hugging Face's tokens under the same grammar, the first token chosen on
the prefill worker included; guided streams survive their decode worker's death, and their
prefill worker's (mid-prefill, or after the first token went ahead), with the same tokens; a client that leaves frees its request; a bad or oversized grammar is a 400 /
INVALID_ARGUMENT naming the parameter, and so are constraints that leave the grammar no token
(found on the prefill or the decode worker); a burst past ``max_concurrent_streams`` is refused, not
queued without bound. Every test ends with the cluster-wide leak check."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import llguidance.hf
import openai
import pytest

from engine.grammar import choices_spec
from engine.types import GuideKind, StructuredOutput
from protos import pdserve_pb2 as pb
from router.client import AsyncPdserveClient, PdserveClient
from router.limits import ServerLimits
from tests.conftest import byte_level_tokenizer, cluster_leaks, outcomes_since, request_outcomes
from tests.test_cluster_e2e import address, start_cluster
from tests.test_openai_api import wait_for
from tests.test_structured_output import EOS, SCHEMA, hf_guided

MAX_STREAMS = 6
GUIDE_CHOICE = StructuredOutput(GuideKind.CHOICE, choices_spec(["yes", "no", "maybe not"]))
LONG = {   # outputs of 40+ tokens whatever the random model prefers: time to kill a worker mid-stream
    "regex": StructuredOutput(GuideKind.REGEX, "[a-z]{40,60}"),
    "lark": StructuredOutput(GuideKind.GRAMMAR, 'start: /[0-9]{50}/ "!"'),
    "json": StructuredOutput(GuideKind.JSON, json.dumps({
        "type": "object", "properties": {"s": {"type": "string", "minLength": 40, "maxLength": 50}},
        "required": ["s"], "additionalProperties": False})),
}


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    limits = ServerLimits(max_concurrent_streams=MAX_STREAMS, max_structured_output_chars=2000)
    cluster = start_cluster("disaggregated", model=str(tiny_model_dir), http_port=0, defaults={"limits": limits})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def ll_tokenizer():
    return llguidance.hf.from_tokenizer(byte_level_tokenizer(), n_vocab=512, eos_token=[EOS])


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return http(cluster).models.list().data[0].id


def http(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.cluster.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def ids(text: str) -> list[int]:
    return byte_level_tokenizer().encode(text, add_special_tokens=False)


def as_proto(guide: StructuredOutput) -> pb.StructuredOutput:
    if guide.kind is GuideKind.JSON_OBJECT:
        return pb.StructuredOutput(json_object=True)
    if guide.kind is GuideKind.CHOICE:
        return pb.StructuredOutput(choice=pb.Choices(choices=json.loads(guide.spec)))
    return pb.StructuredOutput(**{guide.kind.value: guide.spec})


def without_eos(tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


def test_every_door_gives_hfs_tokens_under_the_same_grammar(cluster, model, hf_reference, ll_tokenizer):
    prompt = [40, 41, 42, 43]
    asks = [   # (the guide, the HTTP body's extra fields asking for it)
        (StructuredOutput(GuideKind.JSON, json.dumps(SCHEMA)),
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}),
        (StructuredOutput(GuideKind.JSON_OBJECT), {"response_format": {"type": "json_object"}}),
        (StructuredOutput(GuideKind.CHOICE, choices_spec(["yes", "no", "maybe not"])),
         {"structured_outputs": {"choice": ["yes", "no", "maybe not"]}}),
        (StructuredOutput(GuideKind.REGEX, r"\d{3}-[a-z]{2,4}"), {"guided_regex": r"\d{3}-[a-z]{2,4}"}),
        (StructuredOutput(GuideKind.GRAMMAR, 'root ::= "a" [b-d]+ "e"'), {"guided_grammar": 'root ::= "a" [b-d]+ "e"'}),
    ]
    for guide, extra in asks:
        ref = hf_guided(hf_reference, ll_tokenizer, prompt, guide, 40)
        over_http = http(cluster).completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                                     extra_body=extra)
        choice = over_http.choices[0]
        assert ids(choice.text) == without_eos(ref), extra
        assert choice.finish_reason == ("stop" if ref[-1] == EOS else "length")
        with PdserveClient(address(cluster)) as client:
            result = client.generate_text(token_ids=prompt, max_tokens=40, structured_output=as_proto(guide))
        assert without_eos(list(result.token_ids)) == without_eos(ref), guide.kind
    assert cluster_leaks(cluster) == {}


def test_guided_streams_survive_their_decode_workers_death(cluster, hf_reference, ll_tokenizer):
    """Three long guided streams (regex, Lark, JSON schema), the decode worker SIGKILLed once each
    has tokens: each resumes on the replacement with its grammar where it was (the matcher takes
    the streamed tokens first) and ends with HF's tokens."""
    from tests.test_failures import _kill, _wait_ready

    prompts = {name: [60 + i, 61 + i, 62 + i] for i, name in enumerate(LONG)}
    refs = {name: hf_guided(hf_reference, ll_tokenizer, prompts[name], LONG[name], 80) for name in LONG}
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts

    async def killed_mid_stream() -> dict[str, list[int]]:
        got = {name: [] for name in LONG}
        killed = asyncio.Event()

        async def one(client, name):
            async for msg in client.generate(token_ids=prompts[name], max_tokens=80, structured_output=as_proto(LONG[name])):
                got[name] += list(msg.token_ids)
                if not killed.is_set() and all(len(t) > 5 for t in got.values()):
                    _kill(decode.pid)
                    killed.set()

        async with AsyncPdserveClient(address(cluster), timeout_s=120) as client:
            await asyncio.gather(*(one(client, name) for name in LONG))
        assert killed.is_set()
        return got

    got = asyncio.run(killed_mid_stream())
    for name in LONG:
        assert without_eos(got[name]) == without_eos(refs[name]) and len(refs[name]) > 40, name
    _wait_ready(cluster, "decode-0", restarts + 1)
    assert wait_for(lambda: cluster_leaks(cluster) == {})


def test_a_guided_request_whose_prefill_worker_dies_after_its_first_token_goes_on_in_its_grammar(
        cluster, hf_reference, ll_tokenizer):
    """The first token (chosen on the prefill worker under the grammar) reaches the client ahead of
    the KV hand-off; the prefill worker then dies mid-hand-off. The request moves with that token in
    its prompt; the new worker's matcher takes it first: HF's tokens, nothing repeated or missing."""
    import ray

    from tests.test_failures import _kill, _wait_ready

    prefill = cluster.cluster.registry.get("prefill-0")
    restarts = prefill.restarts
    prompt, guide = list(range(30, 70)), LONG["json"]
    ref = hf_guided(hf_reference, ll_tokenizer, prompt, guide, 60)
    ray.get(prefill.actor.inject_fault.remote("hang_kv_send"))   # the hand-off never finishes
    with PdserveClient(address(cluster), timeout_s=120) as client:
        stream = client.generate(token_ids=prompt, max_tokens=60, structured_output=as_proto(guide))
        first = next(stream)
        assert list(first.token_ids) == ref[:1]
        _kill(prefill.pid)
        rest = list(stream)
    assert without_eos(list(first.token_ids) + [t for msg in rest for t in msg.token_ids]) == without_eos(ref)
    assert rest[-1].timings.migrations == 1
    _wait_ready(cluster, "prefill-0", restarts + 1)
    assert wait_for(lambda: cluster_leaks(cluster) == {})


def test_guided_requests_whose_prefill_worker_dies_mid_prefill_complete(cluster, hf_reference, ll_tokenizer):
    """Long guided prompts queued on the prefill worker when it is SIGKILLed: each is prefilled again
    elsewhere (or on its decode worker) under its grammar, and ends with HF's tokens."""
    from tests.test_failures import _kill, _wait_ready

    prefill = cluster.cluster.registry.get("prefill-0")
    restarts = prefill.restarts
    prompts = [[(i * 37 + j) % 250 + 3 for j in range(300)] for i in range(4)]
    guides = [LONG["regex"], LONG["lark"], GUIDE_CHOICE, LONG["json"]]
    refs = [hf_guided(hf_reference, ll_tokenizer, p, g, 20) for p, g in zip(prompts, guides)]

    async def run():
        async with AsyncPdserveClient(address(cluster), timeout_s=180) as client:
            tasks = [asyncio.create_task(client.generate_text(token_ids=p, max_tokens=20, structured_output=as_proto(g)))
                     for p, g in zip(prompts, guides)]
            await asyncio.sleep(0.05)   # the prompts reached the prefill worker's queue
            _kill(prefill.pid)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert [without_eos(list(r.token_ids)) for r in results] == [without_eos(r) for r in refs]
    assert any(r.timings.migrations or r.timings.kv_handoff == "prefilled_locally" for r in results), \
        "the kill hit no prefill: the test proved nothing"
    _wait_ready(cluster, "prefill-0", restarts + 1)
    assert wait_for(lambda: cluster_leaks(cluster) == {})


def test_a_client_leaving_a_guided_stream_frees_it(cluster):
    base = f"http://127.0.0.1:{cluster.cluster.http_port}/v1"

    async def leave() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "stream": True, "guided_regex": "[a-z]{200,250}"}
        async with aiohttp.ClientSession() as session, session.post(base + "/completions", json=body) as resp:
            assert resp.status == 200
            lines = 0
            async for _ in resp.content:
                lines += 1
                if lines == 10:
                    break

    asyncio.run(leave())
    assert wait_for(lambda: cluster_leaks(cluster) == {})


@pytest.mark.parametrize("extra", [
    {"bad_words": ["y", "n"]},   # nothing left at the first token: on the prefill worker
    {"min_tokens": 5},           # nothing left once "yes" / "no" is out, EOS held: on the decode worker
])
def test_constraints_that_leave_a_grammar_nothing_are_the_clients_error_naming_it(cluster, model, extra):
    """Counted once each, as ``invalid`` (not also as a failure of ours, ``error``)."""
    before = request_outcomes(cluster)
    with pytest.raises(openai.BadRequestError) as err:
        http(cluster).completions.create(model=model, prompt=[5, 6], max_tokens=8,
                                         extra_body={"guided_choice": ["yes", "no"], **extra})
    assert err.value.body["param"] == "guided_choice" and "ruled out" in err.value.body["message"]
    with PdserveClient(address(cluster)) as client, pytest.raises(grpc.RpcError) as rpc:
        client.generate_text(token_ids=[5, 6], max_tokens=8,
                             structured_output=pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"])), **extra)
    assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert rpc.value.details().startswith("sampling.structured_output: every token is ruled out")
    assert wait_for(lambda: cluster_leaks(cluster) == {})
    assert outcomes_since(cluster, before) == {"invalid": 2}


def test_max_structured_output_chars_at_the_limit_served_past_it_refused(cluster, model):
    """The limit counts a regex's or grammar's characters, or every choice's together."""
    for at, past, param in [({"guided_regex": "a" * 2000}, {"guided_regex": "a" * 2001}, "guided_regex"),
                            ({"guided_choice": ["x" * 1000, "y" * 1000]}, {"guided_choice": ["x" * 1000, "y" * 1001]},
                             "guided_choice")]:
        served = http(cluster).completions.create(model=model, prompt=[5, 6], max_tokens=3, extra_body=at)
        assert served.choices[0].finish_reason == "length" and len(served.choices[0].text) == 3
        with pytest.raises(openai.BadRequestError) as err:
            http(cluster).completions.create(model=model, prompt=[5, 6], max_tokens=3, extra_body=past)
        assert err.value.body["param"] == param and "at most 2000" in err.value.body["message"]
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("extra, param, says", [
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "response_format",
     "objectx"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "foo"),
    ({"guided_choice": []}, "guided_choice", "choices"),
    ({"guided_regex": "a" * 2001}, "guided_regex", "at most 2000"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured output"),
    # compiles (llguidance's lexer is lazy), then past the lexer's limits at the first token
    ({"guided_regex": "a{1000000}"}, "guided_regex", "too many expressions"),
])
def test_a_bad_grammar_is_a_400_naming_the_parameter(cluster, model, extra, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        http(cluster).completions.create(model=model, prompt=[5, 6], max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param and says in err.value.body["message"], err.value.body
    assert "<state>" not in err.value.body["message"], "llguidance's parser state is no client's business"
    with PdserveClient(address(cluster)) as client, pytest.raises(grpc.RpcError) as rpc:
        client.generate_text(token_ids=[5, 6], max_tokens=4, structured_output=pb.StructuredOutput(regex="a(b"))
    assert rpc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "sampling.structured_output" in rpc.value.details()
    assert cluster_leaks(cluster) == {}


def test_a_burst_of_guided_requests_past_the_stream_limit_is_refused_not_queued(cluster, model, hf_reference,
                                                                               ll_tokenizer):
    """Twice ``max_concurrent_streams`` long guided requests at once: the ones past the limit get
    429 at once; the others finish with HF's tokens."""
    guide = LONG["regex"]
    prompts = [[100 + i, 7] for i in range(2 * MAX_STREAMS)]

    async def burst():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.cluster.http_port}/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        async with client:
            return await asyncio.gather(*(client.completions.create(
                model=model, prompt=p, max_tokens=70, extra_body={"guided_regex": guide.spec}) for p in prompts),
                return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(isinstance(r, openai.RateLimitError) for r in refused), refused[:1]
    served = [(p, r) for p, r in zip(prompts, results) if not isinstance(r, Exception)]
    assert len(served) >= MAX_STREAMS // 2
    for prompt, result in served:
        assert ids(result.choices[0].text) == without_eos(hf_guided(hf_reference, ll_tokenizer, prompt, guide, 70))
    assert wait_for(lambda: cluster_leaks(cluster) == {})
