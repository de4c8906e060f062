"""How the launcher asks for a worker: the one type the router process shares with the worker
processes' constructors. Torch-free, so the router (which passes it to the actor classes) never
imports the engine; made once per worker by the launcher, read in the worker's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import tracing
from engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How the launcher asks for a worker."""

    worker_id: str
    model: str | None = None                 # None: the embedded default model
    random_model: dict | None = None         # tests: tiny random Llama overrides (seed etc.)
    engine: EngineConfig = field(default_factory=EngineConfig)
    num_threads: int = 1                     # torch threads: the worker's share of the cores
    allow_fault_injection: bool = False      # tests only: enables ``inject_fault``
    tracing: tracing.TracingConfig | None = None  # where this worker exports its spans; None: off
