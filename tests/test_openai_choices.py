"""``n`` > 1 in the OpenAI API over a real cluster (tests/test_openai_api.py's: tiny random Llama, real
Ray actors, uvicorn in the router's loop, the official ``openai`` client): n choices with indexes
0..n-1, each a generation of its own (greedy choices equal gRPC's greedy answer; a seeded request
gives the same n choices every time, not n copies of one), usage counting the prompt once and
every choice's tokens, streamed chunks of every index each finishing once; bad n is a 400; a
duplicate label is a 409 for all; an admission refusal of one choice refuses the request and
leaves nothing running; a client that leaves mid-stream aborts every choice, and one that stops
reading ends every choice as a slow reader (a real uvicorn door over an endless fake stream); the
cluster tests end with the leak check."""

from __future__ import annotations

import asyncio
import collections
import json

import openai
import pytest

from router.convert import ServerDefaults
from router.generation import GenerationCore
from router.health import ServingHealth
from router.limits import ServerLimits
from router.openai_api.requests import MAX_CHOICES
from router.openai_api.server import openai_server
from tests.conftest import cluster_leaks, outcomes_since, request_outcomes
from tests.test_http_body_bound import HEAD, _listening
from tests.test_isolation import EndlessOrchestrator
from tests.test_openai_api import (  # noqa: F401  (fixtures)
    ExactTokenizer, _error, aborted, base_url, client_for, cluster, grpc_ids, ids_of, model_name, wait_for)


def test_greedy_choices_each_equal_grpc_with_usage_summed(cluster, model_name):
    client = client_for(cluster)
    out = client.completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=6, n=3,
                                    extra_body={"ignore_eos": True})
    want = grpc_ids(cluster, token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(ids_of(c.text) == want and c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 18 and out.usage.total_tokens == 21
    assert cluster_leaks(cluster) == {}


def test_seeded_choices_differ_and_repeat(cluster, model_name):
    client = client_for(cluster)

    def texts(seed: int) -> list[str]:
        out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=12, n=4, temperature=1.0, seed=seed,
                                             extra_body={"ignore_eos": True})
        return [c.message.content for c in out.choices]

    first = texts(11)
    assert first == texts(11) and len(set(first)) > 1, first
    # choice i samples with seed + i: choice 1 of seed 11 is choice 0 of seed 12
    assert texts(12)[0] == first[1]
    assert cluster_leaks(cluster) == {}


def test_streamed_choices_interleave_each_index_finishing_once(cluster, model_name):
    client = client_for(cluster)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "go"}], max_tokens=8, n=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    body = [c for c in chunks[:-1]]
    assert len({c.id for c in chunks}) == 1
    texts, roles, finishes = collections.defaultdict(str), collections.Counter(), collections.Counter()
    for chunk in body:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        finishes[choice.index] += choice.finish_reason is not None
    assert set(texts) == {0, 1, 2} and roles == finishes == {0: 1, 1: 1, 2: 1}
    assert all(len(ids_of(t)) == 8 for t in texts.values())
    assert texts[0] == texts[1] == texts[2]   # greedy
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("bad_first", [False, True], ids=["bad-last", "bad-first"])
def test_a_batch_with_one_bad_prompt_is_refused_whole_before_any_choice_runs(cluster, model_name, bad_first):
    """Every choice is validated before any runs: the body gets one 400, counted once as ``invalid``;
    no choice of the good prompt was admitted, then aborted (each was counted as an abort, its prompt
    tokens and latencies observed, the SLO window told it missed). Each choice of a body that runs
    is one request: counted each."""
    prompts = [[5, 6], [10**6]] if not bad_first else [[10**6], [5, 6]]
    before = request_outcomes(cluster)
    with pytest.raises(openai.BadRequestError) as err:
        client_for(cluster).completions.create(model=model_name, prompt=prompts, max_tokens=4, n=2)
    assert err.value.body["param"] == "prompt", err.value.body
    # which prompt of the batch (a probe: a client of 64 prompts could not tell which to fix)
    assert f"the batch's prompt {int(bad_first is False)}: token id 1000000 at index 0" in err.value.body["message"], err.value.body
    assert outcomes_since(cluster, before) == {"invalid": 1}
    before = request_outcomes(cluster)
    client_for(cluster).completions.create(model=model_name, prompt=[[5, 6], [7, 8]], max_tokens=2, n=2,
                                           extra_body={"ignore_eos": True})
    assert outcomes_since(cluster, before) == {"finished_length": 4}
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("prompt, said", [
    ([-1], "prompt: token id -1 at index 0 is outside the vocabulary"),
    ([5, 2**40], "prompt: token id 1099511627776 at index 1 is outside the vocabulary"),
    ([[5], [2**63 - 1]], "prompt: the batch's prompt 1: token id 9223372036854775807 at index 0"),
    ([[-3], ["ok"]], None),   # a batch mixes lists and texts: the body's schema refuses it
])
def test_echo_of_ids_no_tokenizer_can_decode_is_400(cluster, model_name, prompt, said):
    """Found by a probe: echo decoded the prompt's ids before anything checked them, and a fast
    tokenizer cannot take one past 32 bits: a 500 where the same body without echo got its 400."""
    before = request_outcomes(cluster)
    err = _error(lambda: client_for(cluster).completions.create(model=model_name, prompt=prompt, max_tokens=2, echo=True))
    assert err.status_code == 400 and err.body["param"] == "prompt", err.body
    if said is not None:
        assert err.body["message"].startswith(said), err.body
    assert outcomes_since(cluster, before) == {"invalid": 1}
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("n", [0, -1, MAX_CHOICES + 1])
def test_n_out_of_range_is_400(cluster, model_name, n):
    err = _error(lambda: client_for(cluster).completions.create(model=model_name, prompt="x", max_tokens=2, n=n))
    assert err.status_code == 400 and err.body["param"] == "n", err.body


def test_a_live_label_refuses_every_choice(cluster, model_name):
    client = client_for(cluster)
    first = client.completions.create(model=model_name, prompt="long", max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "dup-n"})
    head = next(iter(first))
    err = _error(lambda: client.completions.create(model=model_name, prompt="x", max_tokens=2, n=3,
                                                   extra_headers={"X-Request-Id": "dup-n"}))
    assert isinstance(err, openai.ConflictError)
    rest = list(first)
    assert head.id == "cmpl-dup-n" and rest[-1].choices[0].finish_reason == "length"
    assert cluster_leaks(cluster) == {}
    out = client.completions.create(model=model_name, prompt="x", max_tokens=2, n=2,
                                    extra_headers={"X-Request-Id": "dup-n"})   # free again: served, one id
    assert out.id == "cmpl-dup-n" and len(out.choices) == 2


def test_admission_refusal_of_a_choice_refuses_the_request(cluster, model_name):
    """Long prompts with a 10 ms TTFT target (the floor), n=4, several at once: refused ones are 429
    for the whole request, and nothing of theirs is left running."""

    async def burst():
        client = openai.AsyncOpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0, timeout=60)
        async with client:
            return await asyncio.gather(*(client.completions.create(
                model=model_name, prompt=[(i * 7 + j) % 500 + 3 for j in range(400)], max_tokens=2, n=4,
                extra_body={"ttft_ms": 10}) for i in range(6)), return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(isinstance(r, openai.RateLimitError) for r in refused), refused[:1]
    assert all(len(r.choices) == 4 for r in results if not isinstance(r, Exception))
    assert wait_for(lambda: cluster_leaks(cluster) == {}), cluster_leaks(cluster)


def test_client_leaving_aborts_every_choice(cluster, model_name):
    client = client_for(cluster)
    before = aborted(cluster)
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "go"}],
                                            max_tokens=400, n=3, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(6):
        next(chunks)
    stream.close()
    assert wait_for(lambda: aborted(cluster) == before + 3), aborted(cluster) - before
    assert wait_for(lambda: cluster_leaks(cluster) == {}), cluster_leaks(cluster)


async def _reader_that_stops(n: int) -> tuple[EndlessOrchestrator, int]:
    orchestrator = EndlessOrchestrator()
    core = GenerationCore(orchestrator, ExactTokenizer(), ServerDefaults(
        max_model_len=10**9, vocab_size=300, limits=ServerLimits(max_pending_tokens=512)))
    server = openai_server(core, ServingHealth(), "m", 10**9, "127.0.0.1", 0)
    port = await server.start()
    await _listening(port)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": [5], "max_tokens": 10**8, "n": n, "stream": True}).encode()
        writer.write(HEAD.format(length=len(body)).encode() + body)
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"data: "), 10)   # the stream began
        orchestrator.first_read.set()                             # then this client stops reading
        for _ in range(300):
            if orchestrator.num_ended == n and len(core.live) == 0:
                break
            await asyncio.sleep(0.1)
        writer.close()
        return orchestrator, len(core.live)
    finally:
        await server.stop()
        core.close()


@pytest.mark.parametrize("n", [1, 3])
def test_a_reader_that_stops_reading_ends_every_choice(n):
    """Each choice's DeltaQueue fills while the client reads nothing: the slow-reader cancel reaches
    the response, every choice's generation ends (on a cluster: aborted, KV freed), no identity stays."""
    orchestrator, live = asyncio.run(_reader_that_stops(n))
    assert orchestrator.num_ended == n and live == 0, (orchestrator.num_ended, live)
    assert orchestrator.max_pending_seen <= 512 + 8
