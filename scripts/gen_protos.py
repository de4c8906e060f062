"""Regenerate the committed gRPC stubs in ``protos/`` from ``protos/pdserve.proto``.

Usage: ``python scripts/gen_protos.py [--out DIR]`` (default: ``protos/``). Needs grpcio-tools;
installs do not, because the stubs are committed. ``tests/test_protos.py`` runs this into a temp
dir and fails when the committed stubs differ.

protoc writes ``import pdserve_pb2`` into the ``_grpc`` module, which only works with ``protos/``
on ``sys.path``; we rewrite it to a package import so ``protos`` is an ordinary package.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "protos"
PROTO_NAME = "pdserve.proto"
STUBS = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # imported here: only this script needs grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO_NAME,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_NAME}")
    _fix_grpc_import(out_dir / "pdserve_pb2_grpc.py")
    return [out_dir / name for name in STUBS]


def _fix_grpc_import(path: Path) -> None:
    src = path.read_text()
    fixed, n = re.subn(r"^import pdserve_pb2 as ", "from protos import pdserve_pb2 as ", src, flags=re.M)
    if n != 1:
        raise RuntimeError(f"expected one 'import pdserve_pb2' line in {path}, found {n}")
    path.write_text(fixed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output directory (default: protos/)")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path)  # a CLI's output, not logging
    return 0


if __name__ == "__main__":
    sys.exit(main())
