"""How the launcher places workers on GPUs (pure functions, no GPU needed): which device an
engine gets, and each worker's GPU share."""

from __future__ import annotations

import pytest

from deploy.launcher import gpu_share, resolve_device
from engine.config import EngineConfig
from engine.worker_base import device_identity
from kvtransfer.select import choose_transport


@pytest.mark.parametrize("asked, cluster_gpus, embedded, expected", [
    ("auto", 0, True, "cpu"),
    ("auto", 1, True, "cuda"),
    ("auto", 0, False, "cpu"),       # a joined cluster with no GPU now: CPU
    ("cpu", 4, True, "cpu"),         # asked for CPU: stays there
    ("cuda", 2, True, "cuda"),
    ("cuda", 0, False, "cuda"),      # joined cluster: waits for the autoscaler's GPU nodes
])
def test_resolve_device(asked, cluster_gpus, embedded, expected):
    engine = EngineConfig(device=asked, num_kv_blocks=8)
    assert resolve_device(engine, cluster_gpus, embedded).device == expected
    assert engine.device == asked, "the caller's config is not mutated"


@pytest.mark.parametrize("asked, cluster_gpus, budget, dtype", [
    ("auto", 0, 512, "float32"),
    ("auto", 1, 8192, "bfloat16"),     # vLLM's GPU server budget: fewer, larger prompt steps
    ("cpu", 1, 512, "float32"),
    ("cuda", 1, 8192, "bfloat16"),
])
def test_the_devices_defaults_follow_the_decided_device(asked, cluster_gpus, budget, dtype):
    engine = EngineConfig(device=asked)
    resolved = resolve_device(engine, cluster_gpus, embedded=True)
    assert (resolved.max_num_batched_tokens, resolved.dtype) == (budget, dtype)
    explicit = resolve_device(EngineConfig(device=asked, max_num_batched_tokens=300, dtype="float16"), cluster_gpus, True)
    assert (explicit.max_num_batched_tokens, explicit.dtype) == (300, "float16"), "what was asked for is kept"


def test_serve_leaves_the_budget_to_the_device_unless_given():
    from deploy.cli import _parser, cluster_config

    for argv, budget in (([], None), (["--max-num-batched-tokens", "1024"], 1024)):
        config = cluster_config(_parser().parse_args(["serve", *argv]))
        assert config.decode_engine.max_num_batched_tokens == budget == config.prefill_engine.max_num_batched_tokens
        assert config.decode_engine.device == "auto"


def test_cuda_on_an_embedded_ray_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_device(EngineConfig(device="cuda"), 0, embedded=True)


@pytest.mark.parametrize("cluster_gpus, workers, share", [
    (1, 2, 0.5),      # a pair on one GPU: CUDA IPC
    (1, 3, 0.3333),   # rounded down: three shares fit in one GPU
    (2, 2, 1.0),
    (8, 2, 1.0),      # never more than one GPU per worker
    (0, 2, 1.0),      # none yet: whole GPUs, the autoscaler adds them
    (4, 0, 0.0),      # CPU workers take no GPU
])
def test_gpu_share(cluster_gpus, workers, share):
    assert gpu_share(cluster_gpus, workers) == share
    assert share * workers <= max(cluster_gpus, workers)


def test_workers_on_one_gpu_pick_cuda_ipc_and_on_two_gpus_nccl():
    """Ray calls every actor's GPU cuda:0; the physical identity (UUID) decides."""
    assert device_identity("cpu") == "cpu"
    same = choose_transport("n1", "n1", "cuda:GPU-a", decode_device="cuda:GPU-a")
    other = choose_transport("n1", "n1", "cuda:GPU-a", decode_device="cuda:GPU-b")
    assert (same, other) == ("cuda_ipc", "torch_dist")
