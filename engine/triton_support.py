"""What the engine's Triton kernels share (engine/triton_attention.py, engine/triton_prefill.py,
engine/triton_fused.py): importing Triton where it is installed, the device a launch runs on, tile
sizes. (The attention kernels' shared device functions are in engine/triton_steps.py.)

Triton is optional: CUDA images carry it with torch, CPU installs do not. A module's kernels are
defined inside a builder decorated with ``kernels``, which returns None without Triton.
"""

from __future__ import annotations

import contextlib
import functools

import torch


@functools.cache
def modules():
    """``(triton, triton.language)``, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def kernels(build):
    """Decorator of a module's kernel builder ``build(triton, tl) -> kernels``: called with no
    arguments, it builds them once (compiling happens at each kernel's first launch) and returns
    them, or None where Triton does not import."""

    @functools.cache
    def built():
        found = modules()
        return None if found is None else build(*found)

    return built


def launch_device(x: torch.Tensor):
    """Triton launches on the current CUDA device, not on the tensors': make it ``x``'s. (CPU
    tensors run under Triton's interpreter: nothing to set.)"""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0
