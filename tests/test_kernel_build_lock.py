"""engine.cpu_kernels' build lock: a loader that dies mid-build (killed while it held the lock and
torch's own lock file) does not block the next one, and loaders wait for a live builder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
LOAD = "from engine import cpu_kernels; print('loaded', cpu_kernels.available(), flush=True)"
# A builder mid-build: our flock held and torch's lock file written, then it waits to be killed.
HOLD = ("import fcntl, pathlib, sys, time; d = pathlib.Path(sys.argv[1]); f = open(d / 'build.flock', 'a');"
        " fcntl.flock(f, fcntl.LOCK_EX); (d / 'lock').touch(); print('held', flush=True); time.sleep(600)")

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")


def _holder(build_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(build_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _loader() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_a_builder_killed_mid_build_leaves_nothing_that_blocks():
    build_dir = cpu_kernels.build_directory()
    holder = _holder(build_dir)
    holder.kill()
    holder.wait()
    assert (build_dir / "lock").exists()   # what a killed torch build leaves behind
    loader = _loader()
    out, _ = loader.communicate(timeout=120)
    assert out.strip() == "loaded True"
    assert not (build_dir / "lock").exists()


def test_a_loader_waits_for_a_live_builder():
    build_dir = cpu_kernels.build_directory()
    holder = _holder(build_dir)
    loader = _loader()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            loader.communicate(timeout=5)   # the build is someone else's, still running
    finally:
        holder.kill()
        holder.wait()
    out, _ = loader.communicate(timeout=120)
    assert out.strip() == "loaded True"
