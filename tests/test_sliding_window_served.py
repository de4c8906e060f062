"""A model whose sliding window binds, served by a real cluster (gRPC router, Ray prefill and
decode actors): the launcher takes the workers' served context (capped at the window,
engine.sliding_window) as the router's limit, so a request that would run past the window is
refused with INVALID_ARGUMENT at the router, before any worker sees it, and one within the
window streams Hugging Face's greedy tokens of the windowed model. The model directory has no
tokenizer: the router serves token ids alone (text prompts: INVALID_ARGUMENT), as the workers do.
Ends with the leak check."""

from __future__ import annotations

import copy

import grpc
import pytest

from deploy.launcher import ClusterConfig, ClusterThread
from engine.config import EngineConfig
from router.client import PdserveClient
from tests.conftest import cluster_leaks, hf_greedy
from tests.test_sliding_window import WINDOW, _mistral


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, ray_session):
    loaded = _mistral(WINDOW)
    reference = copy.deepcopy(loaded.model)
    path = tmp_path_factory.mktemp("mistral-window")
    loaded.model.save_pretrained(path)   # a model directory, as a user serves one (no tokenizer: ids only)
    config = ClusterConfig(
        model=str(path), port=0, cpus_per_worker=0.5, threads_per_worker=1, standby_workers=False,
        prefill_engine=EngineConfig(num_kv_blocks=32, block_size=4, max_num_batched_tokens=8),
        decode_engine=EngineConfig(num_kv_blocks=32, block_size=4),
    )
    cluster = ClusterThread(config)
    cluster.start()
    yield cluster, reference
    cluster.stop()


def test_the_router_serves_up_to_the_window_and_refuses_past_it(windowed):
    cluster, reference = windowed
    with PdserveClient(f"127.0.0.1:{cluster.cluster.port}") as client:
        assert client.server_info().max_model_len == WINDOW
        for prompt, max_tokens in [([5, 9, 17, 33, 2], 7), (list(range(60, 71)), 1)]:   # up to the window
            result = client.generate_text(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
            assert list(result.token_ids) == hf_greedy(reference, prompt, max_tokens)
        for prompt, max_tokens in [(list(range(10, 22)), 1), (list(range(10, 18)), 5)]:   # past it
            with pytest.raises(grpc.RpcError) as info:
                client.generate_text(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert str(WINDOW) in info.value.details(), info.value.details()
        with pytest.raises(grpc.RpcError) as info:   # no tokenizer in the model directory: ids only
            client.generate_text(text="hello", max_tokens=2)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in info.value.details()
    assert cluster_leaks(cluster) == {}
