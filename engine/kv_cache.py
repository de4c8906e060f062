"""Sizing and allocation of a worker's paged KV cache tensor.

The pool holds ``num_blocks`` blocks of ``block_size`` tokens for every layer, K and V, in one
contiguous tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
Bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes (SmolLM2-135M, fp32:
2 x 30 x 3 x 64 x 4 = 46,080 B, so 1 GiB holds about 23k tokens).
"""

from __future__ import annotations

import psutil
import torch

from engine.config import EngineConfig
from engine.dtypes import torch_dtype
from engine.types import KVLayout


def layout_for(model_config, config: EngineConfig) -> KVLayout:
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return KVLayout(
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=head_dim,
        block_size=config.block_size,
        dtype=config.dtype,
    )


def num_blocks_for(layout: KVLayout, config: EngineConfig) -> int:
    """Explicit block count, else a byte budget, else a fraction of the memory free now."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_bytes
    if budget is None:
        budget = int(_available_bytes(config.device) * config.kv_cache_memory_fraction)
    return max(1, budget // layout.bytes_per_block)


def _available_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    return psutil.virtual_memory().available


def allocate(layout: KVLayout, num_blocks: int, device: str) -> torch.Tensor:
    return torch.zeros(layout.cache_shape(num_blocks), dtype=torch_dtype(layout.dtype), device=device)
