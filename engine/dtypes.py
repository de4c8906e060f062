"""The one table between a dtype's name and torch's dtype.

Names are what crosses processes and configs (``EngineConfig.dtype``, ``KVLayout.dtype``, a CUDA
IPC locator): plain strings. Every place that turns one into a tensor dtype, or back, goes
through here, so the set the engine serves is written once.
"""

from __future__ import annotations

import torch

from engine.config import DTYPES

_TABLE = {name: getattr(torch, name) for name in DTYPES}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError naming the choices for any other name."""
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_TABLE)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
