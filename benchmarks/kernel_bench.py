"""What the CPU-kernel benchmarks (bench_attention.py, bench_linear.py) share: their command line
and the header lines every results file starts with (when, which machine, its load, torch threads)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import results_file


def parse_args(doc: str, threads: int, results: Path,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """``--passes --steps --threads --skip-model --out`` and what ``extra`` adds; sets torch's
    threads before returning."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra is not None:
        extra(ap)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--out", type=Path, default=results)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def header(name: str) -> list[str]:
    load = os.getloadavg()
    return [
        f"{name}  {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"machine: {os.cpu_count()} cores ({cpu_model()}), load avg at start "
        f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; torch {torch.__version__}, {torch.get_num_threads()} threads",
    ]


def cpu_model() -> str:
    """The CPU's model name and the SIMD flags the kernels' build selects on, e.g. 'AMD EPYC; avx2 fma'."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return f"{model}; {' '.join(f for f in ('avx512f', 'avx2', 'fma') if f in flags) or 'no AVX2/AVX-512'}"


def write(out: Path, lines: list[str]) -> None:
    results_file.write_run(out, "\n".join(lines))
