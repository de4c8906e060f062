"""Stale /dev/shm KV pools: a dead (or pid-reused) owner's file is reclaimed, a live owner's
file and a foreign name are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtransfer.shm_reclaim import SHM_DIR, Owner, owner_pid, owner_state, reclaim_stale_segments


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now (until the kernel reuses it)
    return proc.pid


def segment(directory: Path, pid: int, worker: str = "decode-0", size: int = 4096) -> Path:
    path = directory / f"pdserve-{pid}-{worker}-{os.urandom(4).hex()}.kv"
    path.write_bytes(b"\0" * size)
    return path


def test_owner_pid_parses_the_worker_file_name():
    assert owner_pid(Path("/dev/shm/pdserve-1234-decode-0-abcd1234.kv")) == 1234
    assert owner_pid(Path("/dev/shm/pdserve-x-decode-0.kv")) is None


def test_only_the_dead_owners_segment_is_reclaimed(tmp_path):
    dead = segment(tmp_path, dead_pid(), size=8192)
    live = segment(tmp_path, os.getpid())
    foreign = tmp_path / "pdserve-notapid.kv"
    foreign.write_bytes(b"x")
    freed = reclaim_stale_segments(tmp_path)
    assert [(r.path, r.num_bytes, r.owner) for r in freed] == [(str(dead), 8192, Owner.DEAD)]
    assert not dead.exists() and live.exists() and foreign.exists()


def test_a_reused_pid_running_something_else_does_not_own_the_segment(tmp_path):
    other = subprocess.Popen(["sleep", "60"])  # alive, but not a Python / Ray worker
    try:
        stale = segment(tmp_path, other.pid)
        assert owner_state(other.pid) is Owner.REUSED
        assert [r.owner for r in reclaim_stale_segments(tmp_path)] == [Owner.REUSED]
        assert not stale.exists()
    finally:
        other.kill()
        other.wait()


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_reclaim_in_dev_shm():
    dead = segment(SHM_DIR, dead_pid(), worker="decode-reclaimtest")
    live = segment(SHM_DIR, os.getpid(), worker="decode-reclaimtest")
    try:
        freed = {r.path for r in reclaim_stale_segments()}
        assert str(dead) in freed and str(live) not in freed
        assert not dead.exists() and live.exists()
    finally:
        for path in (dead, live):
            path.unlink(missing_ok=True)
