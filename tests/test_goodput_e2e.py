"""Goodput end to end (real Ray actors, real gRPC): a burst beyond capacity gets
RESOURCE_EXHAUSTED for some requests while every admitted one meets its TTFT target; the
metrics endpoint, scraped after that traffic, passes ``promtool check metrics`` and its TTFT
histogram counts equal the requests served."""

from __future__ import annotations

import asyncio
import re
import statistics
import subprocess
import urllib.request

import grpc
import pytest

from deploy.launcher import ClusterConfig, ClusterThread
from engine.config import EngineConfig
from router.client import AsyncPdserveClient
from tests.conftest import cluster_leaks, require_promtool

# Big enough that prefill takes real time on this CPU, small enough to load at once.
MODEL = {"seed": 1, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024}
PROMPT = 400


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = ClusterConfig(
        mode="disaggregated", random_model=MODEL, port=0, metrics_port=0, cpus_per_worker=0.5,
        threads_per_worker=1, conditional_disagg=False,
        prefill_engine=EngineConfig(num_kv_blocks=512, max_num_batched_tokens=512),
        decode_engine=EngineConfig(num_kv_blocks=1024, max_num_seqs=128),
    )
    cluster = ClusterThread(config)
    cluster.start()
    yield cluster
    cluster.stop()


async def _one(client, i, **kwargs):
    ids = [(i * 7 + j) % 500 + 3 for j in range(PROMPT)]
    try:
        return await client.generate_text(token_ids=ids, max_tokens=8, ignore_eos=True, **kwargs)
    except grpc.aio.AioRpcError as exc:
        return exc


async def _traffic(address: str):
    async with AsyncPdserveClient(address) as client:
        warm = [await _one(client, i) for i in range(3)]          # unloaded TTFT
        unloaded_ttft = statistics.median(r.timings.ttft_s for r in warm)
        # Room for several prompts at once even when the TTFT correction sits at its clamp (3x: a
        # loaded 2-core box) under the 40% safety margin: each queued prompt then predicts ~3 x
        # unloaded, so 25 x admits ~5 (15 x admitted only 2 on a clean-clone CI run: 3 prompts
        # predicted 608 ms of a 925 ms target); the burst of 48 needs ~240 x.
        ttft_target_ms = max(250.0, 25 * unloaded_ttft * 1000)
        # Concurrent warm-up: the models learn the loaded machine too, the last round a burst as
        # loaded as the one below gets once admitted (~16 at once; 8 at once left the TTFT
        # correction ~20% low for it: an admitted request then missed by 4% now and then).
        for round_, concurrent in enumerate((8, 8, 16)):
            warm += await asyncio.gather(*(_one(client, 20 * round_ + i) for i in range(concurrent)))
        # A rehearsal of the burst: the corrections and the safety margin learn a machine loaded
        # exactly as the measured burst loads it (what a served system has seen before its next
        # burst). Warm-up rounds alone left it a few % short now and then on a loaded CI box
        # (3 admitted requests 2-7% past a 3.5 s target once in ~6 clean-clone runs).
        rehearsal = await asyncio.gather(*(_one(client, 200 + i, ttft_ms=ttft_target_ms) for i in range(48)))
        burst = await asyncio.gather(*(_one(client, 100 + i, ttft_ms=ttft_target_ms) for i in range(48)))
    return warm, rehearsal, burst, ttft_target_ms


def test_burst_is_shed_and_admitted_requests_meet_ttft_then_metrics_validate(cluster):
    warm, rehearsal, burst, target_ms = asyncio.run(_traffic(f"127.0.0.1:{cluster.cluster.port}"))
    rejected = [r for r in burst if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in burst if not isinstance(r, grpc.aio.AioRpcError)]
    warm += [r for r in rehearsal if not isinstance(r, grpc.aio.AioRpcError)]
    rejected_before = sum(isinstance(r, grpc.aio.AioRpcError) for r in rehearsal)
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "TTFT" in r.details() for r in rejected)
    # gRPC's server pushback: a client retry policy waits this long (the predicted excess, 1-60 s)
    pushback = [dict(r.trailing_metadata()).get("grpc-retry-pushback-ms") for r in rejected]
    assert all(p is not None and 1000 <= int(p) <= 60_000 for p in pushback), pushback
    assert rejected, "a burst of 48 long prompts must exceed what meets the TTFT target"
    assert len(served) >= 3, f"admission must not refuse everything: {rejected[0].details()} (target {target_ms:.0f} ms)"
    late = [r.timings.ttft_s * 1000 for r in served if r.timings.ttft_s * 1000 > target_ms]
    assert not late, f"admitted requests missed the {target_ms:.0f} ms TTFT target: {late}"
    assert cluster_leaks(cluster) == {}

    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.cluster.metrics_port}/metrics", timeout=10).read().decode()
    counts = re.findall(r'^pdserve_time_to_first_token_seconds_count\{[^}]*\} (\S+)$', text, re.M)
    assert sum(float(c) for c in counts) == len(warm) + len(served)
    rejected_total = re.search(r'^pdserve_requests_total\{outcome="rejected"\} (\S+)$', text, re.M)
    assert float(rejected_total.group(1)) == len(rejected) + rejected_before
    # Each refusal counted under its cause (a probe found all of them under "capacity"): the
    # prediction (ttft), or a wait in the queue that ran past the target (queue_deadline).
    reasons = dict(re.findall(r'^pdserve_admission_decisions_total\{decision="reject",reason="(\w+)"\} (\S+)$', text, re.M))
    assert set(reasons) <= {"ttft", "queue_deadline"} and sum(map(float, reasons.values())) == len(rejected) + rejected_before, reasons
    promtool = require_promtool()
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
