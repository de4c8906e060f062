"""A cluster asked to serve a model the engine cannot serve (engine/model_support.py) fails to
start, saying why, and leaves nothing behind, here without a placement group (whose removal
would kill its actors): every worker of the failed start is gone (the launcher kills those that
did start: they are in no registry yet), their CPUs are Ray's again, no KV pool is left in /dev/shm."""

from __future__ import annotations

import glob
import os
import time

import pytest
import ray
import transformers

from deploy.launcher import ClusterConfig, ClusterThread
from engine.config import EngineConfig
from engine.model_loader import random_model
from tests.test_model_support import SMALL


def test_a_cluster_of_an_unsupported_model_fails_to_start_with_the_reason_and_leaves_nothing(
        tmp_path, ray_session):
    path = tmp_path / "stablelm"
    random_model(transformers.StableLmConfig(**SMALL, num_key_value_heads=2), seed=2).model.save_pretrained(path)
    cpus = ray.available_resources().get("CPU", 0)
    pools = _pools()
    config = ClusterConfig(model=str(path), port=0, cpus_per_worker=0.5, threads_per_worker=1, standby_workers=False,
                           use_placement_group=False, prefill_engine=EngineConfig(num_kv_blocks=16, block_size=4),
                           decode_engine=EngineConfig(num_kv_blocks=16, block_size=4))
    cluster = ClusterThread(config)
    with pytest.raises(Exception) as info:
        cluster.start()
    cluster.stop()
    assert "UnsupportedModelError" in str(info.value) and "StableLm" in str(info.value), str(info.value)[-500:]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == cpus, "a worker of the failed start still holds its CPUs"
    deadline = time.monotonic() + 20   # the failed workers' processes exit a moment after their actors died
    while any(_owner_alive(path) for path in _pools() - pools) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [path for path in _pools() - pools if not _owner_alive(path)]
    assert not left, f"KV pools of the failed start left in /dev/shm: {left}"


def _pools() -> set[str]:
    return set(glob.glob("/dev/shm/pdserve-*"))


def _owner_alive(path: str) -> bool:
    """A pool is named /dev/shm/pdserve-<owner pid>-...: one whose owner died is left behind
    (another process's live pools, e.g. a concurrent test run's, are not this test's)."""
    pid = int(path.split("pdserve-", 1)[1].split("-", 1)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
