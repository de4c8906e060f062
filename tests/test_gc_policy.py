"""The router process's GC policy (router/gc_policy.py), applied in a fresh interpreter: the
policy changes process-wide collector state, which the test process must keep as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _apply(thresholds: bool) -> dict:
    code = (
        "import gc, json\n"
        "before = gc.get_threshold()\n"
        "from router.gc_policy import apply_serving_gc_policy\n"
        f"frozen = apply_serving_gc_policy(thresholds={thresholds})\n"
        "print(json.dumps({'before': before, 'after': gc.get_threshold(), 'frozen': frozen,"
        " 'count': gc.get_freeze_count()}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_policy_freezes_startup_heap_and_raises_generation_zero_only():
    from router.gc_policy import GEN0_THRESHOLD

    r = _apply(thresholds=True)
    assert r["frozen"] == r["count"] > 1000   # the interpreter's own start-up objects at least
    assert r["after"] == [GEN0_THRESHOLD, *r["before"][1:]]   # older generations keep Python's ratios


def test_policy_without_thresholds_only_freezes():
    r = _apply(thresholds=False)
    assert r["frozen"] > 1000 and r["after"] == r["before"]
