"""Engine configuration: the knobs of one worker's engine, fixed at start-up.

The device's defaults live here, once: ``dtype="auto"`` is bfloat16 on CUDA and float32
elsewhere, and ``max_num_batched_tokens=None`` is the device's token budget (``default_token_budget``),
each decided as soon as the device is known (a config built with ``device="auto"`` keeps them
open until the launcher picks the device with ``dataclasses.replace``, which decides them then).
Exactness runs ask for float32 explicitly.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from engine.errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16")   # what the engine serves (engine/dtypes.py maps them to torch)
_DEVICE = re.compile(r"(cpu|cuda(:\d+)?|auto)")


class EngineRole(str, enum.Enum):
    """What the step loop does with a request.

    COLOCATED: prefill and decode mixed in one packed batch (baseline and fallback).
    PREFILL: run the prompt, sample the first token, then hold the KV blocks for export.
    DECODE: requests arrive with KV already computed elsewhere (or recompute after preemption).
    """

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


class GraphMode(str, enum.Enum):
    """How decode-only steps run (engine.cuda_graphs); prefill and mixed steps are always eager.

    AUTO: CUDA graphs on CUDA, eager elsewhere.
    EAGER: every step eager (vLLM's ``--enforce-eager``).
    UNCAPTURED: the graphs' fixed-shape static-buffer path, run without capture on any device
      (the CPU tests run the replayed code through it; a debugging aid on a GPU).
    """

    AUTO = "auto"
    EAGER = "eager"
    UNCAPTURED = "uncaptured"


def default_dtype(device: str) -> str:
    """What ``dtype="auto"`` means on ``device``."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def default_token_budget(device: str) -> int:
    """What ``max_num_batched_tokens=None`` means on ``device``. CPU: 512, a step two cores run in
    well under a second, so decode tokens batched with a prompt chunk wait little. CUDA: 8192,
    vLLM's budget for a server on a GPU: a step's prompt tokens cost the GPU little, its kernel
    launches cost the host much, so fewer, larger prompt steps (the W64 run on an H100 spent 1.2 of
    its 1.5 s in ten 2,048-token prompt steps)."""
    return 8192 if device.startswith("cuda") else 512


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    # token budget of one step (chunked prefill splits prompts to fit); None: default_token_budget(device)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64              # running requests at most
    # KV pool size: explicit block count wins; else a byte budget; else a fraction of free memory.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    dtype: str = "auto"                 # "auto": default_dtype(device); else a torch dtype name
    device: str = "cpu"
    num_threads: int | None = None      # torch intra-op threads; None leaves the process setting alone
    role: EngineRole = EngineRole.COLOCATED
    decode_attention_group: int = 16    # decode requests gathered per attention call (keeps the gather in cache)
    kv_cache_shm_path: str | None = None  # back the KV pool with a /dev/shm file (decode workers, for kvtransfer)
    num_recent_steps: int = 64          # step timings kept for stats
    enable_prefix_caching: bool = True  # share the KV of full blocks of common prefixes (engine.kv_manager)
    decode_graphs: GraphMode = GraphMode.AUTO
    cuda_graph_max_context: int = 2048  # longer decode contexts run eager (vLLM's max_seq_len_to_capture)

    def __post_init__(self) -> None:
        budget = self.max_num_batched_tokens
        if self.block_size < 1 or (budget is not None and budget < 1) or self.max_num_seqs < 1:
            raise ConfigError("{block_size}, {max_num_batched_tokens} and {max_num_seqs} must be >= 1")
        self._check_sizes()
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError.on("device", f"must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError.on("dtype", f"must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.role = EngineRole(self.role)
        self.decode_graphs = GraphMode(self.decode_graphs)
        if self.dtype == "auto" and self.device != "auto":
            self.dtype = default_dtype(self.device)
        if self.max_num_batched_tokens is None and self.device != "auto":
            self.max_num_batched_tokens = default_token_budget(self.device)

    def _check_sizes(self) -> None:
        """Sizes a worker could not start (or serve) with, refused here with the field's name."""
        for name in ("num_kv_blocks", "kv_cache_bytes", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError.on(name, f"must be >= 1 (or None), got {value}")
        for name in ("decode_attention_group", "num_recent_steps", "cuda_graph_max_context"):
            if getattr(self, name) < 1:
                raise ConfigError.on(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ConfigError.on("kv_cache_memory_fraction", f"must be in (0, 1], got {self.kv_cache_memory_fraction}")
