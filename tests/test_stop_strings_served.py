"""Stop strings with min_tokens through a real cluster (the tiny random Llama with a byte-level
tokenizer on disk, real Ray actors and gRPC): the output is Hugging Face's greedy tokens up to the
token that completes the first stop string after min_tokens (vLLM's rule: one completed within
min_tokens does not count, one begun there and completed later does), and the text is cut where
that stop string begins, or kept with include_stop_str_in_output. The prefill worker samples the
first token (min_tokens 0 can stop there), the decode worker the rest. Over HTTP each choice names
what stopped it in ``stop_reason`` (vLLM's field): the stop string, the stop token id, or None (a
length, EOS). Leak check at the end."""

from __future__ import annotations

import random

import pytest

from engine.types import SamplingParams
from router.client import PdserveClient
from tests.conftest import cluster_leaks
from tests.test_cluster_e2e import address, start_cluster
from tests.test_logit_adjust import hf_adjusted_greedy
from tests.test_openai_api import client_for

LETTERS = "abcd"
BIAS = {3 + ord(c): 50.0 for c in LETTERS}   # the random model writes four letters: stop strings recur
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    cluster = start_cluster("disaggregated", model=str(tiny_model_dir), http_port=0)
    yield cluster
    cluster.stop()


def expected(text: str, stops: list[str], min_tokens: int, include: bool) -> tuple[int, str]:
    """(tokens out, text) by the rule, one character a token: the first token after min_tokens
    that completes a stop string ends the output; the text is cut where it begins (at one end, the
    longest begins first), or just after it with ``include``."""
    for k in range(min_tokens + 1, len(text) + 1):
        ending = [s for s in stops if text[:k].endswith(s)]
        if ending:
            return k, text[:k] if include else text[:k - max(map(len, ending))]
    return len(text), text


def test_min_tokens_with_stop_strings_follow_the_rule_on_hf_tokens(cluster, hf_reference):
    rng = random.Random(5)
    seen = {"skipped": 0, "straddling": 0}
    with PdserveClient(address(cluster)) as client:
        for _ in range(5):
            prompt = [3 + ord(rng.choice(LETTERS)) for _ in range(rng.randint(2, 12))]
            ref = hf_adjusted_greedy(hf_reference, prompt, MAX_TOKENS,
                                     SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=tuple(BIAS.items())))
            text = bytes(t - 3 for t in ref).decode()
            assert set(text) <= set(LETTERS)
            for min_tokens in (0, 3, 8):
                # one ending exactly at min_tokens (it must not count there), one completed by the
                # token after (it must), and both
                ending_at_min = text[max(0, min_tokens - 2):min_tokens] or text[:1]
                straddling = text[max(0, min_tokens - 1):min_tokens + 1]
                for stops in ([ending_at_min], [straddling], [ending_at_min, straddling]):
                    include = rng.random() < 0.5
                    got = client.generate_text(token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                                               min_tokens=min_tokens, stop=stops, logit_bias=BIAS,
                                               include_stop_str_in_output=include)
                    k, want = expected(text, stops, min_tokens, include)
                    assert (list(got.token_ids), got.text) == (ref[:k], want), (prompt, min_tokens, stops, include)
                    seen["skipped"] += min_tokens >= 2 and stops == [ending_at_min] and ending_at_min in text[:min_tokens]
                    seen["straddling"] += min_tokens >= 1 and k == min_tokens + 1
    assert seen["skipped"] and seen["straddling"], seen
    assert cluster_leaks(cluster) == {}


def test_stop_reason_names_the_stop_string_or_stop_token_over_http(cluster, hf_reference):
    prompt = [3 + ord(c) for c in "abcab"]
    ref = hf_adjusted_greedy(hf_reference, prompt, MAX_TOKENS,
                             SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=tuple(BIAS.items())))
    text = bytes(t - 3 for t in ref).decode()
    http = client_for(cluster)
    model = http.models.list().data[0].id
    common = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS}
    extra = {"ignore_eos": True, "logit_bias": {str(t): b for t, b in BIAS.items()}}
    stop = text[4:6]
    cases = [({"stop": [stop]}, {}, "stop", stop),
             ({}, {"stop_token_ids": [ref[5]]}, "stop", ref[5]),
             ({"max_tokens": 3}, {}, "length", None)]
    for top, more, finish, reason in cases:
        whole = http.completions.create(**(common | top), extra_body=extra | more).choices[0]
        assert (whole.finish_reason, whole.stop_reason) == (finish, reason), (top, more, whole)
        last = list(http.completions.create(**(common | top), stream=True, extra_body=extra | more))[-1].choices[0]
        assert (last.finish_reason, last.stop_reason) == (finish, reason), (top, more, last)
    assert cluster_leaks(cluster) == {}
