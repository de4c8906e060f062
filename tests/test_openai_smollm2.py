"""Slow tier: the HTTP API with the real default model (SmolLM2-135M-Instruct) and its real
tokenizer, through the official ``openai`` client: the chat answer is Paris, greedy text over
HTTP equals gRPC's (token for token: the same ids decode to the same text, and usage counts
match), stop strings end the output before them (streaming and not), and the cluster holds
nothing after."""

from __future__ import annotations

import openai
import pytest

from deploy.launcher import ClusterConfig, ClusterThread
from engine.config import EngineConfig
from router.client import PdserveClient
from tests.conftest import cluster_leaks

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_cluster(ray_session):
    config = ClusterConfig(port=0, http_port=0, cpus_per_worker=0.5, threads_per_worker=1, standby_workers=False,
                           prefill_engine=EngineConfig(num_kv_blocks=64), decode_engine=EngineConfig(num_kv_blocks=64))
    cluster = ClusterThread(config)
    cluster.start()
    yield cluster
    cluster.stop()


def test_chat_over_http_equals_grpc_and_stop_strings_stop(smol_cluster):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{smol_cluster.cluster.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct", "the default served name is the model's, not its cache directory's"
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == "The capital of France is Paris."
    with PdserveClient(f"127.0.0.1:{smol_cluster.cluster.port}") as grpc_client:
        via_grpc = grpc_client.generate_text(chat=QUESTION, max_tokens=24, temperature=0)
        assert grpc_client.server_info().model == model
    assert via_grpc.text == whole.choices[0].message.content
    assert via_grpc.usage.completion_tokens == whole.usage.completion_tokens
    assert via_grpc.usage.prompt_tokens == whole.usage.prompt_tokens

    stopped = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, stop=[" Paris"])
    assert stopped.choices[0].message.content.rstrip() == "The capital of France is"
    assert stopped.choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, stop=[" Paris"],
                                          extra_body={"include_stop_str_in_output": True})   # vLLM's
    assert kept.choices[0].message.content == "The capital of France is Paris" and kept.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                            stop=["."], stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert "." not in text and chunks[-1].choices[0].finish_reason == "stop"
    assert cluster_leaks(smol_cluster) == {}


def test_emoji_stop_string_stops_and_logprob_bytes_rebuild_the_emoji(smol_cluster):
    """SmolLM2 answers this with "👌🏼👌🏼…", each emoji spread over 3 byte-level tokens that
    decode to U+FFFD one by one. A stop string of one such character must stop generation (the
    engine's check once looked at too few tokens: the text was trimmed, yet generation ran on
    to max_tokens), and the logprob entries' ``bytes`` must join back into the emoji."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{smol_cluster.cluster.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Write a smiley face emoji."}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=16,
                                           temperature=0, logprobs=True)
    text = whole.choices[0].message.content
    assert text.startswith("👌🏼👌🏼"), text   # the greedy answer this test is built on
    entries = whole.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in entries)
    # the text is the bytes' characters; one that max_tokens cut short is not text (vLLM's rule)
    assert joined.decode("utf-8", errors="replace").rstrip("\ufffd") == text and joined.startswith("👌🏼👌🏼".encode())
    stopped = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=16,
                                             temperature=0, stop=["🏼"])
    assert stopped.choices[0].message.content == "👌" and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 6   # 👌 and 🏼: 3 tokens each
    assert cluster_leaks(smol_cluster) == {}


def test_echo_with_logprobs_scores_a_continuation_as_lm_eval_asks(smol_cluster):
    """lm-evaluation-harness' loglikelihood request with the real tokenizer: the prompt's tokens
    echoed with their logprobs; " Paris" after "The capital of France is" is the model's greedy
    pick there (its logprob the position's highest), " London" is not; the text echoes the prompt."""
    import json
    import urllib.request

    url = f"http://127.0.0.1:{smol_cluster.cluster.http_port}/v1/completions"

    def score(text: str) -> dict:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": text, "max_tokens": 1, "logprobs": 1, "echo": True,
                "temperature": 0}
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)["choices"][0]

    for continuation, greedy in ((" Paris", True), (" London", False)):
        choice = score("The capital of France is" + continuation)
        assert choice["text"].startswith("The capital of France is" + continuation)
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and "".join(lp["tokens"][:-1]) == "The capital of France is" + continuation
        last, top = lp["token_logprobs"][-2], lp["top_logprobs"][-2]   # the continuation's own token
        assert (last == max(top.values())) == greedy, (continuation, last, top)
    assert cluster_leaks(smol_cluster) == {}


def test_tokenize_with_the_real_chat_template_and_detokenize(smol_cluster):
    """``/tokenize`` of the question through SmolLM2's chat template counts what the chat
    completion counts as its prompt and starts with the template's own special token; the text
    of those ids, special tokens kept, holds the question; ``/detokenize`` of a prompt's ids gives
    the prompt back."""
    from tests.test_openai_api import _post

    root = f"http://127.0.0.1:{smol_cluster.cluster.http_port}"
    client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=120)
    status, chat = _post(root + "/tokenize", {"messages": QUESTION, "return_token_strs": True})
    assert status == 200
    done = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=1)
    assert chat["count"] == done.usage.prompt_tokens and chat["token_strs"][0] == "<|im_start|>"
    status, text = _post(root + "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and QUESTION[0]["content"] in text["prompt"] and text["prompt"].startswith("<|im_start|>")
    status, prompt = _post(root + "/tokenize", {"prompt": "The capital of France is"})
    assert status == 200 and _post(root + "/detokenize", {"tokens": prompt["tokens"]})[1] == {
        "prompt": "The capital of France is"}
    assert cluster_leaks(smol_cluster) == {}


def test_continue_final_message_continues_the_assistants_words(smol_cluster):
    """vLLM's ``continue_final_message`` with SmolLM2's real chat template: the assistant's last
    message is left open and the model goes on from its words (its tokens equal the in-template
    prompt's greedy continuation over gRPC); ``add_generation_prompt: false`` renders no new turn,
    and a template variable the template does not use changes nothing."""
    from tests.test_openai_api import _post

    root = f"http://127.0.0.1:{smol_cluster.cluster.http_port}"
    client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    status, open_turn = _post(root + "/tokenize", {"messages": messages, "continue_final_message": True})
    assert status == 200
    status, text = _post(root + "/detokenize", {"tokens": open_turn["tokens"]})
    assert text["prompt"].endswith("<|im_start|>assistant\nThe capital of France is")
    done = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=4,
                                          temperature=0, extra_body={"continue_final_message": True,
                                                                     "chat_template_kwargs": {"unused": 1}})
    assert done.choices[0].message.content.startswith(" Paris")
    with PdserveClient(f"127.0.0.1:{smol_cluster.cluster.port}") as grpc_client:
        same = grpc_client.generate_text(token_ids=open_turn["tokens"], max_tokens=4, temperature=0.0)
    assert same.text == done.choices[0].message.content
    status, closed = _post(root + "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and closed["count"] > open_turn["count"]   # the assistant's turn closed (<|im_end|>)
    assert cluster_leaks(smol_cluster) == {}


def test_bad_words_with_the_real_tokenizer_ban_the_word_mid_sentence(smol_cluster):
    """vLLM's ``bad_words`` through SmolLM2's tokenizer: "Paris" is banned as it would follow a
    space too (" Paris", one token of its own): the greedy answer after "The capital of France is"
    stops being " Paris"."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{smol_cluster.cluster.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    body = dict(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert client.completions.create(**body).choices[0].text.startswith(" Paris")
    banned = client.completions.create(**body, extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in banned and banned.strip(), banned
    assert cluster_leaks(smol_cluster) == {}


def test_structured_output_with_the_real_model_is_valid_json_of_the_schema(smol_cluster):
    """SmolLM2 with its 49,152-token BPE vocabulary (tokens of many characters, spaces inside):
    a JSON schema over HTTP gives an object that parses and has the schema's fields and types;
    a choice gives one of the choices; greedy, the same over gRPC; nothing held after."""
    from protos import pdserve_pb2 as pb
    import json

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{smol_cluster.cluster.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    ask = [{"role": "user", "content": "What is the capital of France? Answer in JSON with city and country."}]
    whole = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    answer = json.loads(whole.choices[0].message.content)
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
    assert whole.choices[0].finish_reason == "stop" and "Paris" in answer["city"], answer
    with PdserveClient(f"127.0.0.1:{smol_cluster.cluster.port}") as grpc_client:
        via_grpc = grpc_client.generate_text(chat=ask, max_tokens=60, temperature=0,
                                             structured_output=pb.StructuredOutput(json=json.dumps(schema)))
    assert via_grpc.text == whole.choices[0].message.content
    picked = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        extra_body={"structured_outputs": {"choice": ["Yes, it is.", "No, it is not."]}})
    assert picked.choices[0].message.content in ("Yes, it is.", "No, it is not.")
    assert cluster_leaks(smol_cluster) == {}


def test_the_responses_api_answers_paris_and_follows_text_format(smol_cluster):
    """/v1/responses with the real model: the chat answer, whole and through the SDK's stream
    helper; ``text.format`` a JSON schema: the same object as chat's ``response_format`` gives."""
    import json

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{smol_cluster.cluster.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    r = client.responses.create(model="SmolLM2-135M-Instruct", input=QUESTION[0]["content"], max_output_tokens=24)
    assert r.output_text == "The capital of France is Paris." and r.status == "completed"
    with client.responses.stream(model="SmolLM2-135M-Instruct", input=QUESTION, max_output_tokens=24) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == r.output_text
        assert stream.get_final_response().output_text == r.output_text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    ask = "What is the capital of France? Answer in JSON with the city."
    shaped = client.responses.create(model="SmolLM2-135M-Instruct", input=ask, max_output_tokens=40,
                                     text={"format": {"type": "json_schema", "name": "capital", "schema": schema}})
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": ask}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    assert shaped.output_text == chat.choices[0].message.content and set(json.loads(shaped.output_text)) == {"city"}
    assert cluster_leaks(smol_cluster) == {}


def test_tool_calls_with_the_real_model_parse_and_follow_the_tools(smol_cluster):
    """SmolLM2's own template (it has no tools section: the tools are in the system message, as a
    client would put them for such a model). A named call's arguments parse as the function's
    schema; "required" gives calls that each name one of the tools; streamed, the same calls;
    a conversation with the call and its answer goes on; nothing held after."""
    import json

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{smol_cluster.cluster.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
    ask = [{"role": "system", "content": "Call get_weather(city) for the weather, get_time(zone) for the time."},
           {"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=40, temperature=0,
                                           tools=[weather, clock],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    assert set(json.loads(call.function.arguments)) == {"city"}
    required = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=80,
                                              temperature=0, tools=[weather, clock], tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    streamed = {}
    for chunk in client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=80,
                                                temperature=0, tools=[weather, clock], tool_choice="required",
                                                stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            streamed[delta.index] = (delta.function.name, delta.function.arguments)
    assert list(streamed.values()) == [(c.function.name, c.function.arguments) for c in calls]
    answered = [*ask, {"role": "assistant", "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=answered, max_tokens=20,
                                           temperature=0, tools=[weather, clock], tool_choice="none")
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    assert cluster_leaks(smol_cluster) == {}
