"""The OpenAI-compatible HTTP API over a real cluster (tiny random Llama, real Ray actors, real
uvicorn in the router's loop), driven by the official ``openai`` client: chat and completions,
streaming or not, usage, seed, logprobs, stop token ids, error codes in OpenAI's shape, bearer
token auth, /health following the gRPC health, a client that disconnects cancelling its request
(leak check after), and greedy output equal to gRPC's and to HF's token for token.

The tiny model has no tokenizer; the router gets one whose every token decodes to one character
of its own (``ExactTokenizer``), so a completion's text gives back its token ids exactly. Stop
strings need the engine's tokenizer: ``test_openai_smollm2.py`` covers them with the real model.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import torch
import pytest

from engine import tracing
from router.client import PdserveClient
from router.openai_api.server import openai_server
from router.security import ServerSecurity
from tests.conftest import ByteTokenizer, cluster_leaks, hf_greedy, outcomes_since, request_outcomes
from tests.test_cluster_e2e import address, start_cluster

TOKEN = "http-test-token"
SERVED_NAME = "tiny-llama"   # --served-model-name
BASE = 0x4E00


class ExactTokenizer(ByteTokenizer):
    """ByteTokenizer whose decode is exact: token id t is the character U+4E00 + t."""

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(BASE + t) for t in token_ids)


def ids_of(text: str) -> list[int]:
    return [ord(c) - BASE for c in text]


def text_of(token_id: int) -> str:
    return chr(BASE + token_id)


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = start_cluster("disaggregated", http_port=0, served_model_name=SERVED_NAME)
    cluster.cluster.servicer.tokenizer = ExactTokenizer()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def model_name(cluster) -> str:
    return client_for(cluster).models.list().data[0].id


def base_url(cluster, port: int | None = None) -> str:
    return f"http://127.0.0.1:{port or cluster.cluster.http_port}/v1"


def client_for(cluster, port: int | None = None, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(cluster, port), api_key=api_key, max_retries=0, timeout=60)


def grpc_ids(cluster, **kwargs) -> list[int]:
    with PdserveClient(address(cluster)) as client:
        return list(client.generate_text(**kwargs).token_ids)


def test_models_and_health(cluster, model_name):
    models = client_for(cluster).models.list().data
    assert [m.id for m in models] == [model_name] and models[0].owned_by == "pdserve"
    with PdserveClient(address(cluster)) as client:   # --served-model-name names it on both doors
        assert model_name == SERVED_NAME == client.server_info().model
    root = base_url(cluster).removesuffix("/v1")
    assert json.load(urllib.request.urlopen(root + "/health", timeout=10)) == {"status": "serving"}
    cluster.run(cluster.cluster.health.update(False))   # what the supervisor does when nothing can serve
    try:
        with pytest.raises(urllib.error.HTTPError) as down:
            urllib.request.urlopen(root + "/health", timeout=10)
        assert down.value.code == 503
    finally:
        cluster.run(cluster.cluster.health.update(True))


def test_one_model_is_retrieved_by_name_and_an_unknown_one_is_404(cluster, model_name):
    """``GET /v1/models/{model}`` (the openai package's ``models.retrieve``, which clients call to
    check a model exists): the served model's object as /v1/models lists it; another name: 404
    in OpenAI's shape, naming the parameter."""
    client = client_for(cluster)
    assert client.models.retrieve(model_name) == client.models.list().data[0]
    err = _error(lambda: client.models.retrieve("gpt-4o"))
    assert isinstance(err, openai.NotFoundError) and err.body["param"] == "model" and "gpt-4o" in err.body["message"]


def test_greedy_completion_equals_grpc_and_hf(cluster, model_name, hf_reference):
    prompt = [7, 8, 9, 10, 11, 12]
    ref = hf_greedy(hf_reference, prompt, 12)
    extra = {"ignore_eos": True}
    whole = client_for(cluster).completions.create(model=model_name, prompt=prompt, max_tokens=12,
                                                   temperature=0, extra_body=extra)
    chunks = list(client_for(cluster).completions.create(model=model_name, prompt=prompt, max_tokens=12,
                                                         stream=True, extra_body=extra))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert ids_of(whole.choices[0].text) == ref == ids_of(streamed)
    assert grpc_ids(cluster, token_ids=prompt, max_tokens=12, ignore_eos=True) == ref
    assert whole.choices[0].finish_reason == "length" and chunks[-1].choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == 6 and whole.usage.completion_tokens == 12 and whole.usage.total_tokens == 18
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert cluster_leaks(cluster) == {}


def test_penalties_and_logit_bias_equal_grpc_and_hf(cluster, model_name, hf_reference):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias (token ids as JSON strings)
    and vLLM's repetition_penalty, streamed and whole: the tokens gRPC and HF give."""
    from engine.types import SamplingParams
    from tests.test_logit_adjust import hf_adjusted_greedy

    prompt = [7, 8, 9, 7, 8, 9, 10, 7]
    params = SamplingParams(max_tokens=14, ignore_eos=True, repetition_penalty=1.25, frequency_penalty=0.8,
                            presence_penalty=0.3, logit_bias=((5, 4.0), (8, -100.0)))
    ref = hf_adjusted_greedy(hf_reference, prompt, 14, params)
    assert ref != hf_greedy(hf_reference, prompt, 14)
    body = dict(model=model_name, prompt=prompt, max_tokens=14, presence_penalty=0.3, frequency_penalty=0.8,
                logit_bias={"5": 4.0, "8": -100.0}, extra_body={"ignore_eos": True, "repetition_penalty": 1.25})
    whole = client_for(cluster).completions.create(**body)
    streamed = "".join(c.choices[0].text for c in client_for(cluster).completions.create(stream=True, **body))
    assert ids_of(whole.choices[0].text) == ref == ids_of(streamed)
    assert grpc_ids(cluster, token_ids=prompt, max_tokens=14, ignore_eos=True, repetition_penalty=1.25,
                    frequency_penalty=0.8, presence_penalty=0.3, logit_bias={5: 4.0, 8: -100.0}) == ref
    allowed = [5, 9, 11, 300]   # vLLM's allowed_token_ids: the first token too (chosen on the prefill worker)
    limited = client_for(cluster).completions.create(model=model_name, prompt=prompt, max_tokens=10,
                                                     extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert set(ids_of(limited.choices[0].text)) <= set(allowed) and limited.usage.completion_tokens == 10
    assert cluster_leaks(cluster) == {}


def test_chat_stream_and_whole_agree_with_grpc_and_carry_usage(cluster, model_name):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    client = client_for(cluster)
    whole = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"
    via_grpc = grpc_ids(cluster, chat=messages, max_tokens=10, ignore_eos=True)
    assert ids_of(text) == via_grpc
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(ExactTokenizer().apply_chat_template(messages))
    assert chunks[-2].choices[0].finish_reason == "length"
    assert cluster_leaks(cluster) == {}


def test_bad_words_equal_hf_bad_words_ids_over_http_and_grpc(cluster, model_name, hf_reference):
    """vLLM's ``bad_words``: the router tokenizes each word (here one byte, one token) and the
    token is never chosen, the first token too (chosen on the prefill worker): HF's greedy with
    ``bad_words_ids``, on both doors. A word of only spaces is a 400 naming it."""
    prompt = next(p for p in ([i, i + 1, i + 2, 9] for i in range(3, 200)) if 36 <= hf_greedy(hf_reference, p, 1)[0] < 130)
    plain = hf_greedy(hf_reference, prompt, 10)
    banned = plain[0]   # ExactTokenizer's encode: a byte b is token 3 + b
    out = hf_reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                                bad_words_ids=[[banned]])
    ref = out[0, len(prompt):].tolist()
    assert banned not in ref and ref != plain
    body = dict(model=model_name, prompt=prompt, max_tokens=10, extra_body={"ignore_eos": True,
                                                                           "bad_words": [chr(banned - 3)]})
    assert ids_of(client_for(cluster).completions.create(**body).choices[0].text) == ref
    assert grpc_ids(cluster, token_ids=prompt, max_tokens=10, ignore_eos=True, bad_words=[chr(banned - 3)]) == ref
    err = _error(lambda: client_for(cluster).completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                                                extra_body={"bad_words": ["ok", "  "]}))
    assert err.status_code == 400 and err.body["param"] == "bad_words[1]"
    assert cluster_leaks(cluster) == {}


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(cluster, model_name, hf_reference):
    """vLLM's ``truncate_prompt_tokens`` N: the model sees the prompt's last N tokens (-1: up to
    max_model_len), so a prompt longer than the model takes is cut rather than refused; usage
    counts what the model saw. Over HTTP and gRPC; bad values and echo with it are 400s."""
    prompt = list(range(10, 40))
    ref = hf_greedy(hf_reference, prompt[-8:], 6)
    body = dict(model=model_name, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 8})
    done = client_for(cluster).completions.create(**body)
    assert ids_of(done.choices[0].text) == ref and done.usage.prompt_tokens == 8
    assert grpc_ids(cluster, token_ids=prompt, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=8) == ref
    with PdserveClient(address(cluster)) as client:
        limit = client.server_info().limits.max_prompt_tokens + 1   # max_model_len
        long = [5 + i % 400 for i in range(limit + 50)]   # past max_model_len: refused unless cut
        cut = client.generate_text(token_ids=long, max_tokens=1, truncate_prompt_tokens=limit - 1)
    assert cut.usage.prompt_tokens == limit - 1
    for value in (0, -2, limit + 1):
        err = _error(lambda v=value: client_for(cluster).completions.create(
            model=model_name, prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": v}))
        assert err.status_code == 400 and err.body["param"] == "truncate_prompt_tokens", value
    err = _error(lambda: client_for(cluster).completions.create(model=model_name, prompt=prompt, max_tokens=2,
                                                                echo=True, extra_body={"truncate_prompt_tokens": 4}))
    assert err.status_code == 400 and err.body["param"] == "truncate_prompt_tokens"
    assert cluster_leaks(cluster) == {}


def test_seed_reproduces_sampling_and_stop_token_ids_stop(cluster, model_name):
    client = client_for(cluster)

    def sample(seed: int) -> str:
        return client.completions.create(model=model_name, prompt="abc", max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(5) == sample(5) != sample(6)
    greedy = ids_of(client.completions.create(model=model_name, prompt="abc", max_tokens=16,
                                              extra_body={"ignore_eos": True}).choices[0].text)
    stopped = client.completions.create(model=model_name, prompt="abc", max_tokens=16,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [greedy[3]]})
    # the stop token ends the output; its text is not output text (vLLM's rule), unless asked for
    assert ids_of(stopped.choices[0].text) == greedy[:3] and stopped.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=model_name, prompt="abc", max_tokens=16,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [greedy[3]],
                                                 "include_stop_str_in_output": True})
    assert ids_of(kept.choices[0].text) == greedy[:4]


def test_logprobs_as_openai_defines_them(cluster, model_name):
    client = client_for(cluster)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=0,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert [ord(e.token) - BASE for e in content] == ids_of(chat.choices[0].message.content)
    assert all(e.logprob <= 0 and e.top_logprobs == [] and bytes(e.bytes).decode() == e.token for e in content)
    comp = client.completions.create(model=model_name, prompt="hi", max_tokens=4, logprobs=0,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 4
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    streamed = list(client.completions.create(model=model_name, prompt="hi", max_tokens=4, logprobs=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    with PdserveClient(address(cluster)) as grpc_client:   # the same logprobs over gRPC, aligned with the tokens
        via_grpc = grpc_client.generate_text(text="hi", max_tokens=4, ignore_eos=True, logprobs=True)
    assert via_grpc.logprobs == pytest.approx(lp.token_logprobs) and len(via_grpc.token_ids) == 4
    assert chat.choices[0].logprobs is not None and client.completions.create(
        model=model_name, prompt="hi", max_tokens=2).choices[0].logprobs is None


def test_top_logprobs_as_openai_defines_them_and_as_grpc_gives_them(cluster, model_name):
    """Chat ``top_logprobs`` N and completions ``logprobs`` N: the N most likely tokens at each
    position, most likely first, the same over HTTP (streamed or not) as over gRPC, the first
    position's included (it comes from the prefill worker, the rest from the decode worker);
    greedy's pick is the most likely token."""
    client, prompt, n = client_for(cluster), [9, 10, 11, 12], 3
    with PdserveClient(address(cluster)) as grpc_client:
        via_grpc = grpc_client.generate_text(token_ids=prompt, max_tokens=5, ignore_eos=True, logprobs=True,
                                             top_logprobs=n)
    assert len(via_grpc.top_logprobs) == 5 and all(len(top) == n for top in via_grpc.top_logprobs)
    assert [top[0][0] for top in via_grpc.top_logprobs] == via_grpc.token_ids   # greedy: the first is the pick
    assert all(a[1] >= b[1] for top in via_grpc.top_logprobs for a, b in zip(top, top[1:]))
    expected = [[(text_of(t), pytest.approx(v)) for t, v in top] for top in via_grpc.top_logprobs]

    comp = client.completions.create(model=model_name, prompt=prompt, max_tokens=5, logprobs=n,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert [list(d.items()) for d in lp.top_logprobs] == expected   # the pick is among the N here
    assert lp.token_logprobs == pytest.approx(via_grpc.logprobs)

    for stream in (False, True):
        out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=5, logprobs=True, top_logprobs=n, stream=stream,
                                             extra_body={"ignore_eos": True})
        entries = [e for c in out for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])] \
            if stream else out.choices[0].logprobs.content
        assert len(entries) == 5 and all(len(e.top_logprobs) == n for e in entries)
        assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
                   and bytes(e.top_logprobs[1].bytes).decode() == e.top_logprobs[1].token for e in entries)
    assert cluster_leaks(cluster) == {}


def test_prompt_logprobs_as_vllm_gives_them_and_as_grpc_gives_them(cluster, model_name, hf_reference):
    """vLLM's ``prompt_logprobs`` N: each completion choice's (the chat response's) list, None for
    the first prompt token, then per token its entry (logprob, rank, text) and the position's N
    most likely; the same numbers as gRPC's and HF's. Not with stream: a 400 naming it."""
    from tests.test_prompt_logprobs import _assert_matches

    prompt, n = [9, 10, 11, 12, 40, 41], 2
    with PdserveClient(address(cluster)) as grpc_client:
        via_grpc = grpc_client.generate_text(token_ids=prompt, max_tokens=3, ignore_eos=True, prompt_logprobs=n)
    _assert_matches(via_grpc.prompt_logprobs, hf_reference, prompt, n)
    status, body = _post(f"{base_url(cluster)}/completions", {"model": model_name, "prompt": prompt, "max_tokens": 3,
                                                              "ignore_eos": True, "prompt_logprobs": n})
    assert status == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    p = via_grpc.prompt_logprobs
    for entries, token, lp, rank, top in zip(got[1:], p.token_ids[1:], p.logprobs, p.ranks, p.top):
        own = entries[str(token)]
        assert own == {"logprob": pytest.approx(lp), "rank": rank, "decoded_token": text_of(token)}
        for i, (t, v) in enumerate(top):
            assert entries[str(t)]["logprob"] == pytest.approx(v) and (t == token or entries[str(t)]["rank"] == i + 1)
        assert len(entries) == n + (token not in [t for t, _ in top])
    status, chat = _post(f"{base_url(cluster)}/chat/completions", {
        "model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200 and chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1, chat
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:]) and "prompt_logprobs" not in chat["choices"][0]
    for body, param in (({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": 1, "stream": True},
                                                                          "prompt_logprobs")):
        status, err = _post(f"{base_url(cluster)}/completions",
                            {"model": model_name, "prompt": prompt, "max_tokens": 2, **body})
        assert status == 400 and err["error"]["param"] == param, err
    assert cluster_leaks(cluster) == {}


def test_echo_puts_the_prompt_before_the_completion_with_its_logprobs(cluster, model_name, hf_reference):
    """Completions' ``echo``: the text is the prompt's then the completion's; with ``logprobs`` N
    the prompt's tokens come first (the first with a null logprob and top map), each with HF's
    logprob and its N most likely, then the completion's as without echo. What lm-evaluation-
    harness sends to score a continuation (a one-prompt batch of ids, max_tokens 1, logprobs 1)
    works. Streamed, the first chunk carries the prompt: the chunks join into the whole body's."""
    from tests.test_prompt_logprobs import _reference

    prompt = [9, 10, 11, 12, 40, 41, 7]
    client = client_for(cluster)
    plain = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    echoed = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "".join(map(text_of, prompt)) + plain.choices[0].text
    text = "".join(map(text_of, prompt))
    as_text = client.completions.create(model=model_name, prompt=text, max_tokens=4, echo=True,
                                        extra_body={"ignore_eos": True}).choices[0].text
    assert as_text.startswith(text) and len(as_text) == len(text) + 4   # the prompt as sent, then 4 tokens

    status, body = _post(f"{base_url(cluster)}/completions", {   # lm-evaluation-harness' loglikelihood request
        "model": model_name, "prompt": [prompt], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
        "seed": 1234})
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    chosen, ids, values = _reference(hf_reference, tuple(prompt), 1)
    assert lp["tokens"][: len(prompt)] == [text_of(t) for t in prompt] and len(lp["tokens"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(prompt)] == pytest.approx(chosen, abs=1e-4)
    for i, top in enumerate(lp["top_logprobs"][1 : len(prompt)]):
        assert top[text_of(ids[i][0])] == pytest.approx(values[i][0], abs=1e-4)   # the most likely
        assert top[text_of(prompt[i + 1])] == pytest.approx(chosen[i], abs=1e-4)  # and the prompt's own
    greedy = hf_greedy(hf_reference, prompt, 1)[0]
    assert lp["tokens"][-1] == text_of(greedy) and lp["top_logprobs"][-1] == {text_of(greedy): lp["token_logprobs"][-1]}
    assert lp["text_offset"] == list(range(len(prompt) + 1))   # one character per token here
    assert body["choices"][0]["text"] == text + text_of(greedy)
    assert "prompt_logprobs" not in body["choices"][0], "echo's logprobs, not vLLM's prompt_logprobs, unless asked"
    whole = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(model=model_name, prompt=prompt, max_tokens=4, echo=True,
                                                              logprobs=2, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(c.text for c in chunks) == whole.text and chunks[0].text.startswith(text)
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(whole.logprobs.token_logprobs)
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset
    assert cluster_leaks(cluster) == {}


def test_a_batch_of_prompts_gets_each_prompts_choices_in_order(cluster, model_name, hf_reference):
    """A completions ``prompt`` that is a list of prompts (texts or token-id lists, as OpenAI and
    vLLM take it; lm-evaluation-harness sends its requests so): choice ``index`` = prompt x n +
    choice, each the greedy HF continuation of its own prompt, with its own ``echo``; usage counts
    every prompt once and every choice's tokens; streamed the same. A bad prompt in the batch fails
    the whole request, and nothing is left running (leak check)."""
    prompts = [[7, 8, 9], [30, 31, 32, 33], [5]]
    refs = [hf_greedy(hf_reference, p, 5) for p in prompts]
    client = client_for(cluster)
    extra = {"ignore_eos": True}
    whole = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=5, temperature=0,
                                      extra_body=extra)
    assert [c.index for c in whole.choices] == list(range(6))
    assert [ids_of(c.text) for c in whole.choices] == [refs[i // 2] for i in range(6)]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3 + 4 + 1, 6 * 5)
    texts = ["".join(map(text_of, p)) for p in prompts]
    streamed = ["", "", ""]
    usage = None
    for chunk in client.completions.create(model=model_name, prompt=texts, max_tokens=5, echo=True, stream=True,
                                           stream_options={"include_usage": True}, extra_body=extra):
        for c in chunk.choices:
            streamed[c.index] += c.text
        usage = chunk.usage or usage
    plain = client.completions.create(model=model_name, prompt=texts[1], max_tokens=5, extra_body=extra)
    assert streamed[1] == texts[1] + plain.choices[0].text and all(s.startswith(t) for s, t in zip(streamed, texts))
    assert usage.completion_tokens == 15 and usage.prompt_tokens > 0
    err = _error(lambda: client.completions.create(model=model_name, prompt=[[7, 8], [7, 10**7]], max_tokens=2))
    assert err.status_code == 400 and err.body["param"] == "prompt"
    assert cluster_leaks(cluster) == {}


def test_a_streamed_batch_survives_a_decode_workers_death_and_a_disconnect_frees_it(cluster, model_name, hf_reference):
    """A batch of 4 prompts x n=2 with bad words, streamed: the decode worker is killed once every
    choice has tokens; each of the 8 streams still gives HF's greedy tokens (bad words applied
    after the move too). Then a batch whose client leaves mid-stream: every choice is aborted and
    its KV freed (leak check)."""
    from tests.test_failures import _kill, _wait_ready

    base = base_url(cluster)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(4)]
    banned = 3 + ord("q")   # ExactTokenizer's encode: byte b is token 3 + b
    refs = [hf_reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                                  max_new_tokens=120, do_sample=False, eos_token_id=None, pad_token_id=0,
                                  bad_words_ids=[[banned]])[0, 3:].tolist() for p in prompts]
    decode = cluster.cluster.registry.get("decode-0")
    restarts = decode.restarts

    async def killed_mid_batch() -> list[str]:
        body = {"model": model_name, "prompt": prompts, "n": 2, "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True, "bad_words": ["q"]}
        text, killed = [""] * 8, False
        async with aiohttp.ClientSession() as session, session.post(base + "/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                event = line.decode().strip().removeprefix("data: ")
                if not event or event == "[DONE]":
                    continue
                for choice in json.loads(event)["choices"]:
                    text[choice["index"]] += choice["text"]
                if not killed and all(len(t) > 5 for t in text):
                    _kill(decode.pid)
                    killed = True
        return text

    text = asyncio.run(killed_mid_batch())
    assert [ids_of(t) for t in text] == [refs[i // 2] for i in range(8)]
    _wait_ready(cluster, "decode-0", restarts + 1)

    async def leaves_mid_batch() -> None:
        body = {"model": model_name, "prompt": [[5, 6], [7, 8], [9, 10]], "n": 3, "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        lines = 0
        async with aiohttp.ClientSession() as session, session.post(base + "/completions", json=body) as resp:
            async for _ in resp.content:
                lines += 1
                if lines == 30:   # then gone, mid-stream
                    break

    asyncio.run(leaves_mid_batch())
    assert wait_for(lambda: cluster_leaks(cluster) == {})


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    return err.value


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),   # needs logprobs, as OpenAI's
    (dict(max_completion_tokens=10**6), "max_completion_tokens"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (dict(messages=[]), "messages"),
    (dict(stop=[""]), "stop"),
    (dict(presence_penalty=2.5), "presence_penalty"),                           # OpenAI's range: [-2, 2]
    (dict(logit_bias={"10000000": 1.0}), "logit_bias"),                          # not in the vocabulary
    (dict(seed=2**70), "seed"),                                                  # past GenerateRequest's int64
    (dict(max_tokens=3_000_000_000), "max_tokens"),                              # past its int32
])
def test_bad_chat_input_is_400_naming_the_parameter(cluster, model_name, kwargs, param):
    kwargs = {"messages": [{"role": "user", "content": "x"}], **kwargs}
    err = _error(lambda: client_for(cluster).chat.completions.create(model=model_name, **kwargs))
    assert err.status_code == 400 and isinstance(err, openai.BadRequestError)
    assert err.body["param"] == param and err.body["type"] == "invalid_request_error", err.body
    assert err.body["message"].startswith(param), err.body


def test_bad_completion_input_unknown_model_and_bad_json(cluster, model_name):
    client = client_for(cluster)
    err = _error(lambda: client.completions.create(model=model_name, prompt=[7, 10**7], max_tokens=2))
    assert err.status_code == 400 and err.body["param"] == "prompt"
    err = _error(lambda: client.completions.create(model=model_name, prompt=["a"] * 17, n=4, max_tokens=2))
    assert err.status_code == 400 and err.body["param"] == "prompt" and "at most 64" in err.body["message"]
    err = _error(lambda: client.completions.create(model=model_name, prompt="x", logprobs=21))
    assert err.status_code == 400 and err.body["param"] == "logprobs"
    err = _error(lambda: client.completions.create(model="gpt-4o", prompt="x"))
    assert isinstance(err, openai.NotFoundError) and err.body["param"] == "model"
    request = urllib.request.Request(base_url(cluster) + "/completions", data=b"{not json",
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(request, timeout=10)
    assert bad.value.code == 400 and json.load(bad.value)["error"]["type"] == "invalid_request_error"
    for path in ("/completions", "/chat/completions"):   # deeper than Python's parser recurses (found by test_openai_fuzz)
        request = urllib.request.Request(base_url(cluster) + path, data=b"[" * 5000,
                                         headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(request, timeout=10)
        assert bad.value.code == 400 and "nested too deeply" in json.load(bad.value)["error"]["message"]
    for path, body in (("/completions", b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}"),   # found by a probe
                       ("/tokenize", b'{"prompt": "x", "extra": ' + b"9" * 5000 + b"}")):
        root = base_url(cluster) if path == "/completions" else base_url(cluster).removesuffix("/v1")
        request = urllib.request.Request(root + path, data=body, headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(request, timeout=10)
        assert bad.value.code == 400 and "digits" in json.load(bad.value)["error"]["message"]
    # JSON's \\u escapes can spell a lone surrogate (no UTF-8 text holds one; the openai client cannot send it)
    request = urllib.request.Request(base_url(cluster) + "/completions", headers={"content-type": "application/json"},
                                     data=b'{"prompt": "a\\ud800", "max_tokens": 1}')
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(request, timeout=10)
    assert bad.value.code == 400 and json.load(bad.value)["error"]["param"] == "prompt"


def test_an_unexpected_error_is_a_500_in_openais_shape(cluster, model_name, monkeypatch):
    """Our own bug (here: the conversion raises) is a 500 whose body is OpenAI's error object with
    a reference to grep the router's log for, never Starlette's plain-text page; the server goes on."""
    from router.openai_api import app

    def broken(req, label):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(app, "chat_request", broken)
    err = _error(lambda: client_for(cluster).chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "x"}], max_tokens=2))
    assert isinstance(err, openai.InternalServerError) and err.body["type"] == "internal_error", err.body
    assert "ref " in err.body["message"] and "secret" not in err.body["message"]
    monkeypatch.undo()
    whole = client_for(cluster).chat.completions.create(model=model_name, messages=[{"role": "user", "content": "x"}],
                                                        max_tokens=2, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 2
    assert cluster_leaks(cluster) == {}


def test_duplicate_request_id_is_409_and_the_first_goes_on(cluster, model_name):
    client = client_for(cluster)
    first = client.completions.create(model=model_name, prompt="long", max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "dup-1"})
    head = next(iter(first))
    err = _error(lambda: client.completions.create(model=model_name, prompt="x", max_tokens=2,
                                                   extra_headers={"X-Request-Id": "dup-1"}))
    assert isinstance(err, openai.ConflictError) and "dup-1" in err.body["message"]
    assert err.body["param"] == "request_id"
    rest = list(first)
    assert head.id == "cmpl-dup-1" and rest[-1].choices[0].finish_reason == "length"
    assert len(ids_of(head.choices[0].text + "".join(c.choices[0].text for c in rest))) == 200
    assert cluster_leaks(cluster) == {}


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_id_retried_right_after_a_disconnect_is_served_not_409(cluster, model_name, stream):
    """Found by a probe: a client that drops its connection and at once sends the request again
    under its X-Request-Id got 409 (17 of 20 tries) while its first request unwound (1.3-1.7 ms).
    The label of a request whose client is gone is now waited for; a live one is still a 409."""
    port = cluster.cluster.http_port

    async def drop_then_retry(label: str) -> int:
        body = json.dumps({"model": model_name, "prompt": "long", "max_tokens": 400, "ignore_eos": True,
                           "stream": stream}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (label.encode(), len(body), body))
        await writer.drain()
        if stream:
            await reader.readuntil(b"data:")   # it is running
        else:
            await _until_live(cluster, label)
        writer.close()
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url(cluster) + "/completions", headers={"X-Request-Id": label},
                                    json={"model": model_name, "prompt": "x", "max_tokens": 2}) as resp:
                return resp.status

    statuses = [asyncio.run(drop_then_retry(f"retry-{stream}-{i}")) for i in range(10)]
    assert statuses == [200] * 10
    assert cluster_leaks(cluster) == {}


async def _until_live(cluster, label: str) -> None:
    async def live() -> bool:
        return label in cluster.cluster.servicer.core.live   # read on the router's loop
    while not await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(live(), cluster.loop)):
        await asyncio.sleep(0.002)


def test_admission_rejection_is_429_with_the_predicted_ttft(cluster, model_name):
    """A burst of long prompts with a 10 ms TTFT target (the floor): the prefill queue they build
    cannot meet it, so admission refuses some, and the HTTP client sees 429 with the prediction."""

    async def burst():
        client = openai.AsyncOpenAI(base_url=base_url(cluster), api_key="unused", max_retries=0, timeout=60)
        async with client:
            return await asyncio.gather(*(client.completions.create(
                model=model_name, prompt=[(i * 7 + j) % 500 + 3 for j in range(400)], max_tokens=2,
                extra_body={"ttft_ms": 10}) for i in range(16)), return_exceptions=True)

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused, "16 prompts of 400 tokens at once cannot all start within 10 ms"
    assert all(isinstance(r, openai.RateLimitError) and "TTFT" in r.body["message"] for r in refused), refused[0]
    # When to come back (OpenAI's SDK waits retry-after-ms before its retry): the predicted excess
    hints = [(int(r.response.headers["retry-after"]), int(r.response.headers["retry-after-ms"])) for r in refused]
    assert all(1 <= s <= 60 and 1000 <= ms <= 60_000 and s * 1000 >= ms > (s - 1) * 1000 for s, ms in hints), hints
    assert cluster_leaks(cluster) == {}


def aborted(cluster) -> float:
    return cluster.cluster.metrics.requests.labels("aborted")._value.get()


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_client_disconnect_cancels_and_frees_kv(cluster, model_name):
    client = client_for(cluster)
    before = aborted(cluster)
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "go"}],
                                            max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()   # drops the connection mid-stream
    assert wait_for(lambda: aborted(cluster) == before + 1), "the request was not aborted"
    assert cluster_leaks(cluster) == {}
    whole = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "go"}],
                                           max_tokens=3, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 3


def test_non_streaming_disconnect_cancels_too(cluster, model_name):
    before = aborted(cluster)

    async def leave_early():
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.cluster.http_port)
        body = json.dumps({"model": model_name, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        # Leave once the router holds it: a fixed wait is no bound (the tiny model may finish 400
        # tokens in well under a second), and a request not yet claimed is not one to abort.
        live = cluster.cluster.servicer.live
        for _ in range(200):
            if len(live):
                break
            await asyncio.sleep(0.005)
        writer.close()

    asyncio.run(leave_early())
    assert wait_for(lambda: aborted(cluster) == before + 1), "the request was not aborted"
    assert cluster_leaks(cluster) == {}


@pytest.fixture(scope="module")
def authed_port(cluster):
    """A second HTTP server on the same cluster, with a token (as a --auth-token-file serve builds it)."""
    server = openai_server(cluster.cluster.servicer.core, cluster.cluster.health, "tiny", 4096, "127.0.0.1", 0,
                           ServerSecurity(auth_token=TOKEN))
    port = cluster.run(server.start())
    yield port
    cluster.run(server.stop())


def test_bearer_token_required_except_health(cluster, authed_port):
    err = _error(lambda: client_for(cluster, authed_port, api_key="wrong").models.list())
    assert isinstance(err, openai.AuthenticationError) and err.body["message"].startswith("wrong")
    with pytest.raises(urllib.error.HTTPError) as missing:   # the openai client always sends a key
        urllib.request.urlopen(f"http://127.0.0.1:{authed_port}/v1/models", timeout=10)
    assert missing.value.code == 401 and json.load(missing.value)["error"]["message"].startswith("missing")
    err = _error(lambda: client_for(cluster, authed_port, api_key="wrong").completions.create(
        model="tiny", prompt="x", max_tokens=1))
    assert err.status_code == 401
    done = client_for(cluster, authed_port, api_key=TOKEN).completions.create(model="tiny", prompt="x", max_tokens=2)
    assert done.usage.completion_tokens == 2
    health = urllib.request.urlopen(f"http://127.0.0.1:{authed_port}/health", timeout=10)
    assert health.status == 200
    for path in ("/metrics", "/version"):   # behind the token too: only /health is open
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{authed_port}{path}", timeout=10)
        assert missing.value.code == 401
        authed = urllib.request.Request(f"http://127.0.0.1:{authed_port}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert urllib.request.urlopen(authed, timeout=10).status == 200


def test_metrics_and_version_on_the_api_port_as_vllm_serves_them(cluster, model_name):
    """``GET /metrics`` on the API port is the router's exposition (a scrape config written for
    vLLM's port finds it), counting this very request's completion; ``GET /version`` names the
    installed package's version."""
    root = base_url(cluster).removesuffix("/v1")
    client_for(cluster).completions.create(model=model_name, prompt=[5, 6], max_tokens=2, extra_body={"ignore_eos": True})
    scrape = urllib.request.urlopen(root + "/metrics", timeout=10)
    assert scrape.headers["Content-Type"].startswith("text/plain")
    text = scrape.read().decode()
    port_text = cluster.cluster.metrics.exposition().decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert names == {line.split("{")[0].split(" ")[0] for line in port_text.splitlines() if line and not line.startswith("#")}
    finished = [line for line in text.splitlines() if line.startswith("pdserve_requests_total{")]
    assert finished and sum(float(line.rsplit(" ", 1)[1]) for line in finished) >= 1
    version = json.load(urllib.request.urlopen(root + "/version", timeout=10))
    assert version == {"version": importlib.metadata.version("pdserve")}


def _post(url: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_tokenize_gives_the_ids_generation_feeds_the_model(cluster, model_name):
    """vLLM's ``/tokenize``: a prompt's ids, and a chat's through the chat template, are the ids a
    generation request counts as its prompt (usage.prompt_tokens, the same tokens); token strings
    on request; ``/detokenize`` gives the text back."""
    root = base_url(cluster).removesuffix("/v1")
    client = client_for(cluster)
    status, body = _post(root + "/tokenize", {"model": model_name, "prompt": "héllo"})
    assert status == 200 and body["tokens"] == ExactTokenizer().encode("héllo")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0 and body["token_strs"] is None
    done = client.completions.create(model=model_name, prompt="héllo", max_tokens=1)
    assert done.usage.prompt_tokens == body["count"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, chat = _post(root + "/tokenize", {"messages": messages, "return_token_strs": True})
    assert status == 200 and chat["tokens"] == ExactTokenizer().apply_chat_template(messages)
    assert chat["token_strs"] == [f"<{t}>" for t in chat["tokens"]]
    done = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert done.usage.prompt_tokens == chat["count"]
    for options in ({"add_generation_prompt": False}, {"continue_final_message": True}):   # vLLM's template options
        status, other = _post(root + "/tokenize", {"messages": messages, **options})
        rendered = ExactTokenizer().apply_chat_template(messages, **{"add_generation_prompt": False, **options})
        assert status == 200 and other["tokens"] == rendered
        done = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, extra_body=options)
        assert done.usage.prompt_tokens == other["count"] < chat["count"]
    status, text = _post(root + "/detokenize", {"model": model_name, "tokens": [5, 6, 7]})
    assert status == 200 and text == {"prompt": "".join(text_of(t) for t in (5, 6, 7))}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),                                                    # neither
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),   # both
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                   "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [5, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_parameter(cluster, path, body, param):
    """... and are no generation requests: their refusals are not counted as ``invalid`` ones
    (found by a probe: a client checking prompts with /tokenize inflated the rejection rate)."""
    root = base_url(cluster).removesuffix("/v1")
    before = request_outcomes(cluster)
    status, err = _post(root + path, body)
    assert status == 400 and err["error"]["param"] == param, err
    assert err["error"]["type"] == "invalid_request_error"
    status, err = _post(root + path, {**body, "model": "gpt-4", "tokens": [5], "prompt": "x"})
    assert status == 404 and err["error"]["param"] == "model"
    assert outcomes_since(cluster, before) == {}


def test_a_generation_for_a_model_not_served_is_counted_invalid(cluster, model_name):
    """Found by a probe: its 404 was counted under no outcome, so the rejection panels missed it."""
    before = request_outcomes(cluster)
    err = _error(lambda: client_for(cluster).completions.create(model="gpt-4o", prompt="x", max_tokens=2))
    assert isinstance(err, openai.NotFoundError) and err.body["param"] == "model"
    err = _error(lambda: client_for(cluster).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "x"}], max_tokens=2))
    assert isinstance(err, openai.NotFoundError)
    assert outcomes_since(cluster, before) == {"invalid": 2}


def test_tokenize_needs_the_token_where_the_server_has_one(cluster, authed_port):
    url = f"http://127.0.0.1:{authed_port}"
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        assert _post(url + path, body)[0] == 401
        assert _post(url + path, body, token=TOKEN)[0] == 200


class _NoSpans:
    """A tracer no request may touch while tracing is off."""

    def __getattr__(self, name):
        raise AssertionError(f"tracing is off, yet the request path called tracer().{name}")


def test_untraced_requests_make_no_span(cluster, model_name, monkeypatch):
    """Tracing off (no endpoint): the router's request path never reaches the tracer, so not
    even OpenTelemetry's no-op span or a context is made (the workers trace only requests that
    carry a traceparent, and these carry none)."""
    assert not tracing.enabled()
    monkeypatch.setitem(tracing._state, "tracer", _NoSpans())
    whole = client_for(cluster).completions.create(model=model_name, prompt=[5, 6, 7], max_tokens=3,
                                                   extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 3
    assert len(grpc_ids(cluster, token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)) == 3
    assert cluster_leaks(cluster) == {}
