"""Writing a benchmark's results file without losing the runs before it.

A results file is the record an issue's claims rest on (benchmarks/results/): the newest run on
top, each earlier one below a marker line, as they came. A benchmark's rerun used to replace the
file, so the runs (and the readings written under them) that earlier claims cite were kept only
when someone copied them back by hand. ``write_run`` puts the new run on top and everything the
file held below one more marker, byte for byte.

Life cycle: a benchmark builds its report, prints it, and calls ``write_run`` once at the end of
its run; nothing is read back. A run made elsewhere (the lent GPU machine writes into its own
empty folder) joins the repository's files the same way: ``python -m benchmarks.results_file
FROM_DIR TO_DIR`` puts each file of FROM_DIR on top of its namesake in TO_DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

EARLIER = "--- earlier runs ---"


def write_run(path: Path | str, text: str) -> None:
    """``text`` becomes the top of ``path``; what the file held goes below ``EARLIER``, unchanged."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = text.rstrip("\n") + "\n"
    before = path.read_text() if path.exists() else ""
    if before.strip():
        text += f"\n{EARLIER}\n{before}"
    path.write_text(text)
    print(f"wrote {path}")


def merge_dir(source: Path | str, dest: Path | str) -> None:
    """Each file of ``source`` (one run's results) as the newest run of its namesake in ``dest``."""
    for path in sorted(Path(source).iterdir()):
        if path.is_file():
            write_run(Path(dest) / path.name, path.read_text())


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.results_file FROM_DIR TO_DIR")
    merge_dir(sys.argv[1], sys.argv[2])
