"""engine.freed_memory: with freed memory kept, an engine's prefills reuse their activation buffers
instead of page-faulting fresh pages in (the cost it removes, counted in a fresh process each way);
the switch-off leaves the allocator alone; it is tried once per process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine import freed_memory

ROOT = Path(__file__).resolve().parents[1]

# A fresh process (glibc's state is per process): a random Llama whose prefills of 64-1,024 tokens
# make activations of a few hundred KB to a few MB, in varying sizes as a server's steps do (with
# one size only, glibc's own adaptive threshold can settle on it); prints the minor page faults of
# six prefills after a warm-up.
FAULTS_PER_PREFILL = """
import resource, torch
torch.set_num_threads(1)
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import random_model
from engine.types import RequestSpec, SamplingParams
loaded = random_model(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, max_position_embeddings=2048)
engine = LLMEngine(loaded, EngineConfig(kv_cache_bytes=64 << 20, max_num_batched_tokens=1024,
                                        enable_prefix_caching=False))
def prefill(i, n):
    spec = RequestSpec(f"r{i}", tuple(3 + t % 500 for t in range(n)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.generate([spec])
prefill(0, 1024)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i, n in enumerate((1024, 300, 700, 1024, 64, 1024)):
    prefill(i + 1, n)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: str) -> int:
    env = {**os.environ, freed_memory.ENV_VAR: keep, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", FAULTS_PER_PREFILL], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_engine_prefill_stops_page_faulting():
    kept, default = _faults("on"), _faults("off")
    # measured: kept 1,026-2,307, default 11,920-25,668 over the six prefills
    assert default > 4000, f"the allocator's defaults fault only {default} pages over six prefills: nothing to show"
    assert kept < default / 3, f"kept {kept} vs default {default} minor faults over six prefills"


def test_switched_off_before_the_first_call_changes_nothing(monkeypatch):
    monkeypatch.setattr(freed_memory, "_outcome", None)
    monkeypatch.setenv(freed_memory.ENV_VAR, "off")
    called = []
    monkeypatch.setattr(freed_memory, "_mallopt", lambda: called.append(1) or True)
    assert freed_memory.keep() is False
    assert not called and freed_memory._outcome is None


def test_tried_once_per_process(monkeypatch):
    monkeypatch.setattr(freed_memory, "_outcome", None)
    monkeypatch.delenv(freed_memory.ENV_VAR, raising=False)
    calls = []
    monkeypatch.setattr(freed_memory, "_mallopt", lambda: calls.append(1) or False)
    assert freed_memory.keep() is False and freed_memory.keep() is False
    assert len(calls) == 1
