"""``Cluster.stop()`` finishes within its bound even when every worker's shutdown hangs
(fault injection ``hang_shutdown``): the hung workers are killed and the decode pool unlinked.
Before it shuts down a Ray it started, every task of the cluster's life has ended (one left to
unwind at the loop's close may read a Ray stream after ``ray.shutdown()``, which ends the process
with status 1), while the caller's own tasks are left alone."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray

from deploy import launcher
from deploy.launcher import Cluster, ClusterConfig
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


def test_stop_ends_the_clusters_own_tasks_before_it_shuts_ray_down(monkeypatch):
    """A start that fails once Ray is up (say, the model cannot be prepared), then the stop; a task
    started during the cluster's life swallows its first cancellation, as a wait that completed
    just as it was cancelled does (how a stream read outlived a stop that ran out of time)."""
    at_shutdown: dict[str, bool] = {}
    ran_after_shutdown = []

    def ray_up_then_fail(self):
        self._started_ray = True
        raise RuntimeError("the model cannot be prepared")

    async def swallows_one_cancel():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass
        try:
            await asyncio.sleep(60)
        finally:
            ran_after_shutdown.append(bool(at_shutdown))

    async def scenario():
        callers = asyncio.create_task(asyncio.sleep(60), name="the caller's")
        cluster = Cluster(ClusterConfig(random_model={"seed": 0}))
        with pytest.raises(RuntimeError, match="cannot be prepared"):
            await cluster.start()
        own = asyncio.create_task(swallows_one_cancel(), name="the cluster's")
        await asyncio.sleep(0)
        monkeypatch.setattr(launcher, "shutdown_ray",
                            lambda: at_shutdown.update(own=own.done(), callers=callers.done()))
        await cluster.stop()
        assert at_shutdown == {"own": True, "callers": False}
        assert ran_after_shutdown == [False], "the task ran on after Ray shut down"
        callers.cancel()

    monkeypatch.setattr(Cluster, "_init_ray", ray_up_then_fail)
    asyncio.run(scenario())


def test_shutdown_waits_for_rays_processes_not_for_other_children():
    """``shutdown_ray`` returns once the Ray it started is gone, its GCS, raylet and workers
    included; a child of the process that is not Ray's (here a sleeper, as ``multiprocessing``'s
    resource tracker is: it lives as long as its parent) is left alone and not waited for (CI
    waited 10 s for one at each module's Ray teardown)."""
    import subprocess

    import psutil

    from deploy.ray_init import _ray_processes, shutdown_ray

    if ray.is_initialized():
        shutdown_ray()
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        assert ray.get(ray.remote(lambda: os.getpid()).remote()) != os.getpid()   # a worker process runs
        processes = _ray_processes()
        names = {p.name() for p in processes}
        assert {"gcs_server", "raylet"} <= names and bystander.pid not in {p.pid for p in processes}
        started = time.monotonic()
        shutdown_ray()
        assert time.monotonic() - started < 8.0
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert bystander.poll() is None, "a child that is not Ray's was stopped"
    finally:
        bystander.kill()
        bystander.wait()
