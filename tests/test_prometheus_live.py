"""A real Prometheus (Debian's ``prometheus`` server) scraping a live cluster with
``deploy/prometheus.yml`` (rewritten to this test's metrics port, 1 s scrapes), after a short
load: its HTTP API answers TTFT and TPOT histogram quantiles and the goodput gauge, and every
panel query of ``deploy/grafana/dashboards/pdserve.json`` returns data. Skipped where the
binary is missing, except under CI=true, where that fails (like ``require_promtool``).
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from router.client import AsyncPdserveClient
from kvtransfer.rendezvous import free_port
from tests.conftest import cluster_leaks, require_tool
from tests.test_cluster_e2e import address, start_cluster

ROOT = Path(__file__).resolve().parents[1]
RATE_WINDOW = "30s"   # Grafana's $__rate_interval, wide enough for the whole load at 1 s scrapes


def require_prometheus() -> str:
    return require_tool("prometheus")


def _config(metrics_port: int) -> dict:
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
    return config


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = start_cluster("disaggregated", metrics_port=0)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    binary = require_prometheus()
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(_config(cluster.cluster.metrics_port)))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _ready(url), 30, "prometheus did not become ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _ready(url: str) -> bool:
    try:
        return urllib.request.urlopen(url + "/-/ready", timeout=2).status == 200
    except OSError:
        return False


def _until(predicate, timeout_s: float, message: str) -> None:
    """Bounded wait on an external process (Prometheus scrapes on its own clock)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(0.25)


def query(url: str, expr: str) -> list[dict]:
    qs = urllib.parse.urlencode({"query": expr})
    body = json.load(urllib.request.urlopen(f"{url}/api/v1/query?{qs}", timeout=10))
    assert body["status"] == "success", body
    return body["data"]["result"]


def _values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result]


async def _load(addr: str, n: int) -> None:
    async with AsyncPdserveClient(addr) as client:
        for wave in range(n // 4):
            await asyncio.gather(*(client.generate_text(token_ids=[(wave * 4 + i) % 400 + 3] * 20, max_tokens=12,
                                                        ignore_eos=True) for i in range(4)))


def _panel_queries() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/pdserve.json").read_text())
    panels = dashboard["panels"] + [q for p in dashboard["panels"] for q in p.get("panels", [])]
    exprs = [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]
    return [e.replace("$__rate_interval", RATE_WINDOW).replace("$mode", ".*").replace("$worker", ".*") for e in exprs]


def test_prometheus_scrapes_the_cluster_and_every_panel_has_data(cluster, prometheus):
    def seen() -> float:
        return sum(_values(query(prometheus, 'pdserve_requests_total{outcome="finished_length"}')))

    # A first wave creates every labelled series; once scraped, the load's increase is a rate.
    asyncio.run(_load(address(cluster), 4))
    _until(lambda: seen() >= 4, 30, "prometheus never scraped the cluster")
    n = 24
    asyncio.run(_load(address(cluster), n))
    _until(lambda: seen() >= 4 + n, 30, "prometheus never saw the load")
    time.sleep(2)   # two more scrapes: rate() windows hold samples on both sides of the load
    ttft = _values(query(prometheus, "histogram_quantile(0.9, sum by (le) (rate("
                                     f"pdserve_time_to_first_token_seconds_bucket[{RATE_WINDOW}])))"))
    tpot = _values(query(prometheus, "histogram_quantile(0.5, sum by (le) (rate("
                                     f"pdserve_time_per_output_token_seconds_bucket[{RATE_WINDOW}])))"))
    goodput = _values(query(prometheus, "pdserve_goodput_requests_per_second"))
    assert ttft and 0 < ttft[0] < 60 and tpot and 0 < tpot[0] < 10, (ttft, tpot)
    assert goodput and goodput[0] > 0, goodput
    empty = [e for e in _panel_queries() if not query(prometheus, e)]
    assert not empty, f"dashboard panels without data: {empty}"
    nan_only = [e for e in _panel_queries() if "quantile" in e and "prediction" not in e
                and all(math.isnan(v) for v in _values(query(prometheus, e)))]
    assert not nan_only, f"quantile panels with only NaN: {nan_only}"
    assert cluster_leaks(cluster) == {}
