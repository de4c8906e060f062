"""deploy/embedded_ray_env.py: an embedded Ray gets a short wait for a lost GCS (its own child,
restarted by nothing); a joined cluster keeps Ray's, and an operator's value always stands. The
exit it bounds is test_serve_cli's group-SIGTERM test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy.embedded_ray_env import EMBEDDED_GCS_RECONNECT_S, GCS_RECONNECT_ENV, is_embedded, prepare


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(GCS_RECONNECT_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return monkeypatch


def test_an_embedded_start_gets_the_short_wait(env):
    prepare(None)
    assert is_embedded(None)
    assert os.environ[GCS_RECONNECT_ENV] == str(EMBEDDED_GCS_RECONNECT_S)


@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS"])
def test_joining_a_cluster_keeps_rays_wait(env, how):
    if how == "RAY_ADDRESS":
        env.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    prepare("10.0.0.1:6379" if how == "--address" else None)
    assert GCS_RECONNECT_ENV not in os.environ


def test_an_operators_value_stands(env):
    env.setenv(GCS_RECONNECT_ENV, "45")
    prepare(None)
    assert os.environ[GCS_RECONNECT_ENV] == "45"


def test_the_serve_command_prepares_before_ray_is_imported():
    """The variable is read once, as Ray's library loads: it must be set before the first
    ``import ray`` of `pdserve serve`, which ``cluster_config`` makes."""
    code = ("import sys, deploy.cli as c\n"
            "c.embedded_ray_env.prepare = lambda a: print('ray' in sys.modules)\n"
            "c._run_serve(c._parser().parse_args(['serve', '--random-model', '--ttft-ms', '-1']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines()[0] == "False", out
