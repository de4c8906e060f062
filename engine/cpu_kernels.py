"""Builds and loads pdserve's C++ CPU kernels: one extension from ``engine/csrc/`` holding the
paged decode and prefill attention and the fused rotary embedding + KV write
(``engine/paged_kernel.py``), the decode-step linear layers, skinny (few rows) and panel (a
few dozen rows) (``engine/skinny_linear.py``), greedy sampling's argmax
(``engine/greedy_argmax.py``), and a decode step's layer stack calling them (``engine/lean_cpu.py``).

Build: ``torch.utils.cpp_extension.load`` (needs a C++ compiler and the ``ninja`` binary: the
system's, or the ``ninja`` pip package's even when the venv is not activated) with
``-O3 -march=native -fopenmp``, compiled on first use (~30 s) into
``~/.cache/pdserve/torch_extensions/<tag>`` and loaded from there afterwards (~0.2 s); the tag
hashes the torch version and install path, the Python version, the CPU model/flags and the
bytes of the sources and of the headers they share (``csrc/*.h``), so a home directory shared across machines never loads a binary built for another
CPU, and two torch installs or two checkouts with different kernels (git worktrees) do not
rebuild over each other. Any build or load failure logs one warning and leaves
the torch paths in use.

Build lock: torch's own (a ``lock`` file its builder deletes when done) outlives a builder that
dies: a worker killed while it loads (a chaos kill, a supervisor's restart, Ctrl-C) would leave
every later worker waiting on it. So each loader first holds an ``flock`` on ``build.flock`` in
the build directory, which the kernel drops when its holder exits however it exits; whoever
holds it is the only one in torch's build, so a ``lock`` file seen then is a dead builder's and
is removed at once. Parallelism runs on torch's own OpenMP pool (at::parallel_for), so the
kernels never use more threads than ``torch.get_num_threads()``.

SIMD: each kernel has an AVX-512 path and an AVX2+FMA path, and ``-march=native`` compiles the one
the build machine has (``simd_width`` / ``skinny_linear_simd_width``: 16, 8, or 0 where neither
exists and the torch paths stay in use). Both are kept because the machines differ: a CI runner,
a developer's laptop or a serving host may have either (AMD EPYC before Zen 4 and many Intel
client CPUs have no AVX-512), and each path is tested on the machine that builds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "prefill_attention.cpp", "rope_kv.cpp", "skinny_linear.cpp",
                                    "panel_linear.cpp", "greedy_argmax.cpp", "decode_layers.cpp", "module.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module = None
_error: str | None = None       # why the kernel is unavailable, once a build was tried


def build_directory() -> Path:
    return Path.home() / ".cache" / "pdserve" / "torch_extensions" / _machine_tag()


def _machine_tag() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        cpu += "".join(sorted(set(lines)))
    except OSError:
        cpu += platform.processor()
    # The torch install path too: ninja rebuilds whenever the include paths in its command change.
    key = f"{torch.__version__}|{Path(torch.__file__).parent}|{sys.version_info[:2]}|{cpu}|{_sources_digest()}"
    return f"torch{torch.__version__.split('+')[0]}-py{sys.version_info[0]}{sys.version_info[1]}-" + \
        hashlib.sha256(key.encode()).hexdigest()[:12]


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h", ".hpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _load():
    global _module, _error
    if _module is not None:   # the hot path (every linear of every step): no lock once loaded
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load

            build_dir = build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            _find_ninja()
            with _build_lock(build_dir):
                _module = load(
                    name="pdserve_cpu_kernels",
                    sources=[str(s) for s in SOURCES],
                    extra_cflags=CFLAGS,
                    extra_ldflags=LDFLAGS,
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except Exception as e:  # noqa: BLE001 — any build/load failure means: use the torch path
            _error = f"{type(e).__name__}: {e}".strip()
            logger.warning("CPU kernels unavailable, using the torch paths (%s)", _error[-500:])
        return _module


def _find_ninja() -> None:
    """torch runs ``ninja`` from PATH; a venv used without activation has the pip package's
    binary off PATH, so put it there."""
    if shutil.which("ninja"):
        return
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Held across torch's load; torch's own lock file, if present now, is a dead builder's."""
    with open(build_dir / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # released by the kernel when this process ends, however
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s: left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def module():
    """The loaded extension (built on the first call), or None when it cannot be built."""
    return _load()


def available() -> bool:
    """True when the kernels are built and loaded (builds them on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error
