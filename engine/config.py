"""Engine configuration: the knobs of one worker's engine, fixed at start-up."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineRole(str, enum.Enum):
    """What the step loop does with a request.

    COLOCATED: prefill and decode mixed in one packed batch (baseline and fallback).
    PREFILL: run the prompt, sample the first token, then hold the KV blocks for export.
    DECODE: requests arrive with KV already computed elsewhere (or recompute after preemption).
    """

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    max_num_batched_tokens: int = 512   # token budget of one step (chunked prefill splits prompts to fit)
    max_num_seqs: int = 64              # running requests at most
    # KV pool size: explicit block count wins; else a byte budget; else a fraction of free memory.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None      # torch intra-op threads; None leaves the process setting alone
    role: EngineRole = EngineRole.COLOCATED
    decode_attention_group: int = 16    # decode requests gathered per attention call (keeps the gather in cache)
    kv_cache_shm_path: str | None = None  # back the KV pool with a /dev/shm file (decode workers, for kvtransfer)
    num_recent_steps: int = 64          # step timings kept for stats
    enable_prefix_caching: bool = True  # share the KV of full blocks of common prefixes (engine.kv_manager)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        self.role = EngineRole(self.role)
