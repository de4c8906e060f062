"""A two-node Ray cluster on this one machine (two raylets): prefill on one node, decode on the
other. The cross-node transport (torch.distributed, gloo on CPU) is chosen by placement, and
the outputs still equal HF generate. Ends with a leak check."""

from __future__ import annotations

import asyncio
import random

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.conftest import cluster_leaks, hf_greedy
from tests.test_cluster_e2e import _concurrent, address, start_cluster


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1}})
    nodes.add_node(num_cpus=2, resources={"node_b": 1})
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def test_cross_node_pair_uses_torch_dist_and_matches_hf(two_nodes, hf_reference):
    cluster = start_cluster(
        "disaggregated", prefill_resources={"node_a": 0.5}, decode_resources={"node_b": 0.5}
    )
    try:
        registry = cluster.cluster.registry
        prefill, decode = registry.prefill[0], registry.decode[0]
        assert prefill.node_id != decode.node_id
        assert registry.transport(prefill, decode) == "torch_dist"
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 90))] for _ in range(6)]
        max_tokens = [rng.randint(2, 16) for _ in prompts]
        got = asyncio.run(_concurrent(address(cluster), prompts, max_tokens))
        assert got == [hf_greedy(hf_reference, p, n) for p, n in zip(prompts, max_tokens)]
        assert cluster_leaks(cluster) == {}
    finally:
        cluster.stop()
