"""The CUDA path, on a GPU (CI has none: these skip there; the lent GPU machine runs them and
benchmarks/README.md records the run).

- The engine on cuda equals HF ``generate`` on cuda token for token (float32; default,
  chunked prefill, preemption), decode steps replayed as CUDA graphs (the default) and eager,
  then leaks nothing.
- CUDA graphs (engine/cuda_graphs.py): every planned (batch, width) key is captured; a replay
  gives exactly the logits of the same fixed-shape forward run without a graph, and the eager
  path's logits within float32 rounding, step by step; padded rows write the null block only;
  bfloat16 (the default dtype on CUDA) replays too. Nothing here is timed (cuda_checks.sh is).
- A real cluster on one GPU: the launcher gives the prefill and the decode Ray actor half of it
  each, they report the same physical GPU, the pair hands KV over by CUDA IPC, and clients get
  HF's tokens over gRPC; a colocated cluster on the GPU too. Each ends with a leak check.

The cross-process CUDA IPC round trip of the transport itself is in test_kvtransfer.py.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random

import pytest
import torch

from deploy.launcher import ClusterConfig, ClusterThread
from engine.config import EngineConfig, GraphMode
from engine.cuda_graphs import GraphInputs
from engine.engine import LLMEngine
from engine.model_loader import random_model
from router.client import PdserveClient
from tests.conftest import assert_no_leaks, cluster_leaks, hf_greedy
from tests.test_cluster_e2e import _concurrent, address
from tests.test_cuda_graphs import StepSpy, check_padded_rows_write_only_the_null_block
from tests.test_engine_exact import CONFIGS, run_staggered

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL = {"seed": 0}


@pytest.fixture(scope="module")
def cuda_loaded():
    loaded = random_model(**MODEL)
    loaded.model.to("cuda")
    return loaded


@pytest.fixture(scope="module")
def cuda_workload(cuda_loaded):
    """Prompts, output lengths and HF greedy references computed on the GPU (a deep copy keeps
    transformers' own SDPA attention: the engine swaps the original's)."""
    reference = copy.deepcopy(cuda_loaded.model)
    reference.config._attn_implementation = "sdpa"
    rng = random.Random(13)
    # Each fits the "preempt" pool (112 tokens) alone: prompt <= 80, output <= 24.
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 80))] for _ in range(10)]
    outputs = [rng.randint(1, 24) for _ in prompts]
    return prompts, outputs, [hf_greedy(reference, p, n) for p, n in zip(prompts, outputs)]


def cuda_config(name: str, mode: GraphMode = GraphMode.AUTO) -> EngineConfig:
    """An engine config of test_engine_exact on the GPU, float32 (CONFIGS were made on CPU)."""
    config = dataclasses.replace(CONFIGS[name], device="cuda", decode_graphs=mode)
    assert config.dtype == "float32"
    return config


@pytest.mark.parametrize("mode", [GraphMode.AUTO, GraphMode.EAGER])
@pytest.mark.parametrize("name", ["default", "chunked", "preempt"])
def test_engine_on_cuda_matches_hf(cuda_loaded, cuda_workload, name, mode):
    prompts, outputs, refs = cuda_workload
    engine = LLMEngine(cuda_loaded, cuda_config(name, mode))
    assert engine.runner.kv_cache.is_cuda
    got = run_staggered(engine, prompts, outputs)
    assert [got[f"r{i}"] for i in range(len(prompts))] == refs
    if name == "preempt":
        assert engine.scheduler.num_preemptions > 0, "the tiny pool must force preemption"
    graphs = engine.runner.graphs
    if mode is GraphMode.AUTO:
        assert graphs.num_graphs == len(graphs.plan.keys) and graphs.num_replays > 0
    else:
        assert graphs is None
    assert_no_leaks(engine)


def test_replay_equals_the_uncaptured_forward_and_eager(cuda_loaded, cuda_workload):
    """Same workload, same steps, three engines: a replayed step gives the logits of the same
    fixed-shape forward run without a graph (the same kernels: to 1e-6), and the eager path's
    within fp32 rounding (its batch is not padded, so its GEMMs may round differently)."""
    prompts, outputs, refs = cuda_workload
    spies = {}
    for mode in (GraphMode.AUTO, GraphMode.UNCAPTURED, GraphMode.EAGER):
        engine = LLMEngine(cuda_loaded, cuda_config("default", mode))
        spies[mode] = StepSpy(engine)
        got = run_staggered(engine, prompts, outputs)
        assert [got[f"r{i}"] for i in range(len(prompts))] == refs
        assert_no_leaks(engine)
    replayed = 0
    for graph, plain, eager in zip(*(spies[m].steps for m in (GraphMode.AUTO, GraphMode.UNCAPTURED, GraphMode.EAGER)),
                                   strict=True):
        torch.testing.assert_close(graph[2], plain[2], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(graph[2], eager[2], rtol=1e-4, atol=1e-4)
        replayed += isinstance(graph[1], GraphInputs)
    assert replayed > 10


def test_captured_padded_rows_write_only_the_null_block(cuda_loaded):
    check_padded_rows_write_only_the_null_block(
        LLMEngine(cuda_loaded, EngineConfig(num_kv_blocks=64, block_size=4, device="cuda", dtype="float32")))


def test_bf16_is_the_default_on_cuda_and_replays(cuda_loaded, cuda_workload):
    """bf16 tokens are not HF's fp32 ones (nor need they equal eager bf16 ones: padded GEMMs round
    differently), so this checks the path runs to completion: every token asked for, graphs
    replayed, nothing leaked."""
    prompts, outputs, _ = cuda_workload
    loaded = dataclasses.replace(cuda_loaded, model=copy.deepcopy(cuda_loaded.model).to(torch.bfloat16))
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=256, device="cuda"))
    assert engine.config.dtype == "bfloat16" and engine.cache.dtype == torch.bfloat16
    got = run_staggered(engine, prompts, outputs)
    assert [len(got[f"r{i}"]) for i in range(len(prompts))] == outputs
    assert engine.runner.graphs.num_replays > 0
    assert_no_leaks(engine)


def _gpu_cluster(mode: str) -> ClusterThread:
    """Device "auto" (the launcher's default for `pdserve serve`): Ray sees the GPU."""
    config = ClusterConfig(
        mode=mode, random_model=MODEL, port=0, cpus_per_worker=0.5, threads_per_worker=1,
        prefill_engine=EngineConfig(num_kv_blocks=96, max_num_batched_tokens=64, device="auto", dtype="float32"),
        decode_engine=EngineConfig(num_kv_blocks=160, device="auto", dtype="float32"),
    )
    cluster = ClusterThread(config)
    cluster.start()
    return cluster


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_one_gpu_cluster_matches_hf(ray_session, cuda_workload, mode):
    prompts, outputs, refs = cuda_workload
    cluster = _gpu_cluster(mode)
    try:
        registry = cluster.cluster.registry
        # Each worker names its GPU by UUID, not by Ray's per-actor index (every actor's cuda:0).
        assert all(w.device.startswith("cuda:") and w.device != "cuda:0" for w in registry.all), \
            [w.device for w in registry.all]
        assert asyncio.run(_concurrent(address(cluster), prompts, outputs)) == refs
        if mode == "disaggregated":
            prefill, decode = registry.prefill[0], registry.decode[0]
            assert prefill.device == decode.device, "two workers given half a GPU each share it"
            assert registry.transport(prefill, decode) == "cuda_ipc"
            with PdserveClient(address(cluster)) as client:
                timings = client.generate_text(token_ids=prompts[0], max_tokens=2, ignore_eos=True).timings
            assert timings.kv_transfer_bytes > 0
        assert cluster_leaks(cluster) == {}
    finally:
        cluster.stop()
