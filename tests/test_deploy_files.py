"""deploy/ files stay consistent with the code: dashboard, provisioning, Prometheus, cluster YAML.

- Every PromQL expression in the Grafana dashboard names only series ``RouterMetrics`` exports
  (a renamed metric would otherwise leave a silently empty panel), and parses as PromQL when
  promtool is installed.
- The provisioning and Prometheus YAMLs load and point where the code and the dashboard expect.
- ``deploy/cluster.yaml`` passes the checks ``ray up`` runs before it touches the cloud: Ray's
  JSON schema, then ``prepare_config`` + ``validate_config``.
- The router runs under systemd on the head (``deploy/pdserve-router.service``): restarted
  always, stopped with SIGTERM and given longer than pdserve's graceful stop; the cluster YAML
  installs and (re)starts it after Ray starts.
"""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from router.metrics import DEFAULT_METRICS_PORT, RouterMetrics
from tests.conftest import require_promtool

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pdserve.json"
METRIC_NAME = re.compile(r"\bpdserve_[a-zA-Z0-9_]+")  # Prometheus names allow digits (e2e)
# The sample names each family type puts in an exposition (the family name is the base).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
}


def exported_series() -> dict[str, str]:
    """Every queryable series name of a fresh RouterMetrics -> its family name."""
    out = {}
    for family in RouterMetrics().registry.collect():
        for suffix in SAMPLE_SUFFIXES[family.type]:
            out[family.name + suffix] = family.name
    return out


def dashboard_panels(panels: list[dict]) -> list[dict]:
    """Panels, including those nested inside collapsed rows."""
    out = []
    for p in panels:
        out.append(p)
        out.extend(dashboard_panels(p.get("panels", [])))
    return out


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard_panels(dash["panels"]) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs




# ---------------------------------------------------------------- Grafana dashboard


def test_dashboard_shape():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "pdserve" and 36 <= dash["schemaVersion"] <= 41
    panels = dashboard_panels(dash["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    ds_vars = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert [v["name"] for v in ds_vars] == ["DS_PROMETHEUS"] and ds_vars[0]["query"] == "prometheus"
    for p in panels:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"], f"panel {p['title']!r} has no query"
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]


def test_dashboard_covers_the_required_views():
    titles = {p["title"] for p in dashboard_panels(json.loads(DASHBOARD.read_text())["panels"])}
    required = {"Time to first token", "Time per output token", "Inter-token latency", "Goodput",
                "SLO attainment", "Rejection rate", "Requests by outcome", "Queue depth", "Running requests",
                "KV cache usage", "KV hand-off time", "KV hand-off throughput", "Preemptions", "Engine step time"}
    assert required <= titles, required - titles


def test_dashboard_queries_name_only_exported_metrics():
    series = exported_series()
    used = {name for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    assert used, "no pdserve metric found in the dashboard"
    unknown = sorted(used - series.keys())
    assert not unknown, f"dashboard queries series RouterMetrics does not export: {unknown}"
    # Histograms are only meaningful through _bucket/_sum/_count; quantiles need _bucket.
    for expr in dashboard_exprs():
        if "histogram_quantile" in expr:
            assert "_bucket" in expr, expr


def test_dashboard_queries_parse_as_promql(tmp_path):
    promtool = require_promtool()
    # Grafana's variables are not PromQL: substitute what Grafana would at query time.
    subst = {"$__rate_interval": "20s", "$mode": ".*", "$worker": ".*"}
    rules = []
    for i, expr in enumerate(e for e in dashboard_exprs() if not e.startswith("label_values(")):
        for var, value in subst.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unsubstituted Grafana variable in {expr}"
        rules.append({"record": f"pdserve:dashboard_check_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- Grafana provisioning, Prometheus


def test_grafana_provisioning():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    (prom,) = ds["datasources"]
    assert prom["type"] == "prometheus" and prom["isDefault"] and prom["url"].startswith("http")
    boards = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pdserve.yml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    # deploy/README.md mounts the dashboards directory at exactly this path.
    assert provider["options"]["path"] in (DEPLOY / "README.md").read_text()


def test_prometheus_scrapes_the_router():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "pdserve"]
    assert job.get("scrape_interval", cfg["global"]["scrape_interval"]) == "5s"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets and all(t.endswith(f":{DEFAULT_METRICS_PORT}") for t in targets)


def test_prometheus_config_passes_promtool():
    promtool = require_promtool()
    proc = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- ray up cluster config


def load_cluster() -> dict:
    return yaml.safe_load((DEPLOY / "cluster.yaml").read_text())


def test_cluster_yaml_matches_ray_schema():
    import jsonschema  # a dependency of ray[default]
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(load_cluster(), schema)


def test_cluster_yaml_passes_ray_up_checks():
    # What `ray up` does before contacting the provider: fill defaults, merge setup commands, validate.
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(load_cluster())
    validate_config(cfg)
    gpu = {name: t for name, t in cfg["available_node_types"].items() if t["resources"].get("GPU")}
    assert gpu and all(t["resources"]["GPU"] == 1 for t in gpu.values())
    assert sum(t.get("min_workers", 0) for t in gpu.values()) >= 2, "need a prefill and a decode GPU"
    assert cfg["head_node_type"] not in gpu
    assert any("pip install" in c and "pdserve" in c for c in cfg["head_setup_commands"])
    assert any("torch==2.13.0" in c for c in cfg["worker_setup_commands"])


def test_serve_flags_reach_the_cluster_config():
    from deploy.cli import _parser, cluster_config

    args = _parser().parse_args(["serve", "--mode", "colocated", "--ttft-ms", "500", "--tpot-ms", "50",
                                 "--no-admission", "--no-conditional-disagg"])
    cfg = cluster_config(args)
    assert (cfg.mode, cfg.admission, cfg.conditional_disagg) == ("colocated", False, False)
    assert cfg.defaults == {"max_tokens": 128, "ttft_s": 0.5, "tpot_s": 0.05}
    default = cluster_config(_parser().parse_args(["serve"]))
    assert default.admission and default.conditional_disagg
    assert (default.migration_limit, default.max_worker_restarts, default.standby_workers) == (3, None, True)
    failures = cluster_config(_parser().parse_args(["serve", "--migration-limit", "0", "--max-worker-restarts", "5",
                                                    "--no-standby"]))
    assert (failures.migration_limit, failures.max_worker_restarts, failures.standby_workers) == (0, 5, False)


def test_prefix_cache_on_by_default_and_switched_off_by_flag():
    from deploy.cli import _parser, cluster_config

    on = cluster_config(_parser().parse_args(["serve"]))
    assert on.prefill_engine.enable_prefix_caching and on.decode_engine.enable_prefix_caching
    off = cluster_config(_parser().parse_args(["serve", "--no-prefix-cache"]))
    assert not off.prefill_engine.enable_prefix_caching and not off.decode_engine.enable_prefix_caching


# ---------------------------------------------------------------- the router's supervisor


def load_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string((DEPLOY / "pdserve-router.service").read_text())
    return unit


def test_router_service_restarts_and_stops_gracefully():
    from deploy.cli import _parser

    unit = load_unit()
    svc = unit["Service"]
    assert svc["Restart"] == "always" and float(svc["RestartSec"]) > 0
    assert unit["Unit"]["StartLimitIntervalSec"] == "0", "systemd must never give up restarting it"
    assert "exec pdserve serve $$PDSERVE_ARGS" in svc["ExecStart"]
    # SIGTERM is pdserve serve's graceful stop; systemd must wait longer than that stop may take.
    assert svc.get("KillSignal", "SIGTERM") == "SIGTERM"
    defaults = _parser().parse_args(["serve"])
    assert float(svc["TimeoutStopSec"]) > defaults.drain_timeout + defaults.stop_timeout
    assert svc["User"] == load_cluster()["auth"]["ssh_user"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_router_service_passes_systemd_analyze(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    unit = tmp_path / "pdserve-router.service"
    unit.write_text((DEPLOY / "pdserve-router.service").read_text())
    proc = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if unit.name in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_cluster_yaml_installs_and_starts_the_router_service():
    cmds = load_cluster()["head_start_ray_commands"]
    at = {key: next(i for i, c in enumerate(cmds) if key in c)
          for key in ("systemctl stop pdserve-router", "ray stop", "ray start --head",
                      "pdserve-router.service /etc/systemd/system/", "systemctl enable pdserve-router",
                      "systemctl restart pdserve-router", "/etc/default/pdserve-router")}
    # Router stopped before Ray stops; installed, enabled and restarted after Ray starts.
    assert at["systemctl stop pdserve-router"] < at["ray stop"] < at["ray start --head"]
    assert at["ray start --head"] < at["pdserve-router.service /etc/systemd/system/"] < at["systemctl restart pdserve-router"]
    assert at["systemctl enable pdserve-router"] <= at["systemctl restart pdserve-router"]
    assert "--address auto" in cmds[at["/etc/default/pdserve-router"]], "the router must join the head's Ray"
    assert "tmux" not in (DEPLOY / "README.md").read_text(), "the README still starts the router by hand"


def test_limit_flags_reach_the_server_defaults():
    from deploy.cli import _parser, cluster_config
    from router.limits import SchedulingPolicy

    args = _parser().parse_args(["serve", "--max-stop-strings", "4", "--max-concurrent-streams", "9",
                                 "--scheduling-policy", "priority", "--max-priority", "3"])
    limits = cluster_config(args).defaults["limits"]
    assert (limits.max_stop_strings, limits.max_concurrent_streams, limits.max_priority) == (4, 9, 3)
    assert limits.scheduling_policy is SchedulingPolicy.PRIORITY
