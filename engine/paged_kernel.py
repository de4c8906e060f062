"""Builds, loads and calls the C++ paged decode-attention kernel (``engine/csrc/paged_attention.cpp``).

The kernel reads each decode request's K/V blocks in place through its block table, exactly once,
instead of gathering them into a padded copy that SDPA then reads again (decode attention is
memory-bound, so that halves its traffic). float32 on CPU only; ``engine.attention`` falls back to
its torch path for anything else, when the kernel cannot be built, or when
``PDSERVE_ATTENTION=torch``.

Build: ``torch.utils.cpp_extension.load`` (needs a C++ compiler and the ``ninja`` binary: the
system's, or the ``ninja`` pip package's even when the venv is not activated) with
``-O3 -march=native -fopenmp``, compiled on first use (~25 s) into
``~/.cache/pdserve/torch_extensions/<tag>`` and loaded from there afterwards (~0.2 s); the tag
hashes the torch version and install path, the Python version and the CPU model/flags, so a home
directory shared across machines never loads a binary built for another CPU, and two torch
installs do not rebuild over each other. Any build or load failure logs one warning and leaves
the torch path in use. Parallelism runs on torch's own OpenMP pool (at::parallel_for), so the
kernel never uses more threads than ``torch.get_num_threads()``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
STALE_LOCK_S = 600
ENV_VAR = "PDSERVE_ATTENTION"   # "torch": always use the torch path (comparison, tests)

_lock = threading.Lock()
_module = None
_error: str | None = None       # why the kernel is unavailable, once a build was tried


def build_directory() -> Path:
    return Path.home() / ".cache" / "pdserve" / "torch_extensions" / _machine_tag()


def _machine_tag() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags"))]
        cpu += "".join(sorted(set(lines)))
    except OSError:
        cpu += platform.processor()
    # The torch install path too: ninja rebuilds whenever the include paths in its command change.
    key = f"{torch.__version__}|{Path(torch.__file__).parent}|{sys.version_info[:2]}|{cpu}"
    return f"torch{torch.__version__.split('+')[0]}-py{sys.version_info[0]}{sys.version_info[1]}-" + \
        hashlib.sha256(key.encode()).hexdigest()[:12]


def _load():
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load

            build_dir = build_directory()
            build_dir.mkdir(parents=True, exist_ok=True)
            _clear_stale_lock(build_dir)
            _find_ninja()
            _module = load(
                name="pdserve_paged_attention",
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as e:  # noqa: BLE001 — any build/load failure means: use the torch path
            _error = f"{type(e).__name__}: {e}".strip()
            logger.warning("paged attention kernel unavailable, using the torch path (%s)", _error[-500:])
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


def _clear_stale_lock(build_dir: Path) -> None:
    """torch's build lock is a file another process removes when done; a process killed mid-build
    leaves it behind and every later load would wait on it forever. A build takes well under
    STALE_LOCK_S, so an older lock is abandoned."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing stale build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def available() -> bool:
    """True when the kernel is built and loaded (builds it on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def simd_width() -> int:
    """Floats per SIMD vector the kernel was built with (16 AVX-512, 8 AVX2, 0 none); 0 if unavailable."""
    module = _load()
    return int(module.simd_width) if module is not None else 0


def enabled() -> bool:
    """The kernel is available and not switched off with ``PDSERVE_ATTENTION=torch``."""
    return os.environ.get(ENV_VAR, "").lower() != "torch" and available()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """Decode attention of one query token per request over its paged KV.

    q [n, heads, head_dim] float32 (any strides with unit-stride head_dim); k_cache/v_cache
    [num_blocks, block_size, kv_heads, head_dim] contiguous float32; block_tables [n, max_blocks]
    int64 (entries past a request's ``ceil(context_len / block_size)`` blocks are never read);
    context_lens [n] int64, >= 1. Query head ``k * groups + g`` attends to KV head ``k``.
    Returns out [n, heads, head_dim]. ``portable=True`` forces the plain-loop path that
    machines without AVX2 (or unusual head dims) take, for tests.
    """
    module = _load()
    if module is None:
        raise RuntimeError(f"paged attention kernel unavailable: {_error}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    module.paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, float(scale), portable)
    return out
