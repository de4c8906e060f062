"""Reclaiming KV pools that crashed workers left in /dev/shm.

Role: a decode worker's KV pool is a tmpfs file ``/dev/shm/pdserve-{pid}-{worker_id}-{hex}.kv``
(``decode_worker.worker.shm_path_for``; the pid is the worker process's). A clean shutdown
unlinks it, and so does the launcher's ``stop()`` for a worker that died, but a crash of the
whole tree (the router killed with SIGKILL, a machine-level OOM kill, a power cut of the
container) leaves the file behind, and tmpfs pages are RAM: gigabytes per worker, until reboot.

Life cycle: ``reclaim_stale_segments()`` runs before anything on the node allocates a new pool
(``Cluster.start`` on the router's node, each decode worker before it allocates its own). It
unlinks every pool file whose owner pid is gone and logs each one with its size. A pid counts as
alive only if the process exists *and* its command line looks like a Python / Ray worker: a pid
that was reused by an unrelated program (a shell, a compiler) no longer owns the file. A live
owner's file is never touched, so concurrent clusters on one node leave each other alone.
"""

from __future__ import annotations

import enum
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
POOL_GLOB = "pdserve-*.kv"
_OWNER_PID = re.compile(r"^pdserve-(\d+)-")
# What a pool owner's /proc/PID/cmdline shows: the interpreter (``python ...``) before Ray
# renames the process, ``ray::DecodeActor...`` after (setproctitle rewrites argv).
_OWNER_MARKERS = (b"python", b"ray::", b"pdserve")


class Owner(enum.Enum):
    ALIVE = "alive"          # a Python / Ray process with that pid runs: keep the file
    DEAD = "dead"            # no such process: reclaim
    REUSED = "reused"        # the pid runs something else now: the owner is gone, reclaim
    UNKNOWN = "unknown"      # the name carries no pid: not ours to judge, keep


@dataclass(frozen=True, slots=True)
class Reclaimed:
    path: str
    num_bytes: int
    owner_pid: int
    owner: Owner


def owner_pid(path: Path) -> int | None:
    """The pid in a pool file's name, or None if it does not follow ``shm_path_for``."""
    m = _OWNER_PID.match(path.name)
    return int(m.group(1)) if m else None


def owner_state(pid: int | None) -> Owner:
    if pid is None or pid <= 0:
        return Owner.UNKNOWN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return Owner.DEAD
    except PermissionError:
        pass  # exists, another user's: its cmdline still tells what it is
    return Owner.ALIVE if _looks_like_worker(pid) else Owner.REUSED


def _looks_like_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False  # exited between the kill(0) and now
    except OSError:
        return True   # cannot tell (no /proc access): keeping a file is the safe mistake
    return any(marker in cmdline for marker in _OWNER_MARKERS)


def reclaim_stale_segments(shm_dir: Path = SHM_DIR) -> list[Reclaimed]:
    """Unlink every pdserve KV pool in ``shm_dir`` whose owner is gone; returns what was freed."""
    if not shm_dir.is_dir():
        return []
    freed = []
    for path in sorted(shm_dir.glob(POOL_GLOB)):
        pid = owner_pid(path)
        state = owner_state(pid)
        if state in (Owner.DEAD, Owner.REUSED):
            reclaimed = _unlink(path, pid, state)
            if reclaimed is not None:
                freed.append(reclaimed)
    return freed


def _unlink(path: Path, pid: int, state: Owner) -> Reclaimed | None:
    try:
        num_bytes = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return None  # another reclaimer (a second worker on this node) got there first
    except PermissionError as exc:
        logger.warning("stale KV pool %s (owner pid %d %s) cannot be removed: %s", path, pid, state.value, exc)
        return None
    logger.warning("reclaimed stale KV pool %s: %.1f MiB, owner pid %d %s",
                   path, num_bytes / 2**20, pid, state.value)
    return Reclaimed(str(path), num_bytes, pid, state)
