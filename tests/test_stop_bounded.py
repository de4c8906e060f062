"""``Cluster.stop()`` finishes within its bound even when every worker's shutdown hangs
(fault injection ``hang_shutdown``): the hung workers are killed and the decode pool unlinked."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray

from engine.worker_base import WorkerBase, WorkerSpec
from tests.test_cluster_e2e import start_cluster

STOP_TIMEOUT_S = 4.0


def test_stop_with_hung_workers_is_bounded(ray_session, caplog):
    cluster = start_cluster("disaggregated", stop_timeout_s=STOP_TIMEOUT_S)
    workers = cluster.cluster.registry.all
    pools = [w.shm_path for w in workers if w.shm_path]
    assert pools and all(os.path.exists(p) for p in pools)
    ray.get([w.actor.inject_fault.remote("hang_shutdown") for w in workers])
    started = time.monotonic()
    cluster.stop()
    elapsed = time.monotonic() - started
    assert elapsed < STOP_TIMEOUT_S + 10, f"stop took {elapsed:.1f} s"
    assert elapsed >= STOP_TIMEOUT_S - 0.5, "the shutdown calls should have hung until the bound"
    assert "worker shutdown did not finish" in caplog.text
    for w in workers:  # killed, not left wedged
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.actor.stats.remote(), timeout=30)
    assert not any(os.path.exists(p) for p in pools)


def test_hang_shutdown_needs_fault_injection():
    worker = object.__new__(WorkerBase)  # the permission check comes before any engine use
    worker.spec = WorkerSpec("w")
    with pytest.raises(PermissionError):
        asyncio.run(worker.inject_fault("hang_shutdown"))
