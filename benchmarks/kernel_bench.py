"""What the CPU-kernel benchmarks (bench_attention.py, bench_linear.py) share: their command line
and the header lines every results file starts with (when, which machine, its load, torch threads)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from pathlib import Path

import torch


def parse_args(doc: str, threads: int, results: Path) -> argparse.Namespace:
    """``--passes --steps --threads --skip-model --out``; sets torch's threads before returning."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
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
        f"machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), load avg at start "
        f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; torch {torch.__version__}, {torch.get_num_threads()} threads",
    ]


def write(out: Path, lines: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
