"""Linear layers of an engine forward with few rows (decode steps) on the C++ skinny kernel.

A decode step multiplies one row per running request by every weight matrix. At 2-32 rows MKL's
sgemm repacks the weight on each call and the step, memory-bound on the weights (536 MB of
float32 for SmolLM2-135M), costs ~2x a single row's; the kernel (``engine/csrc/skinny_linear.cpp``,
AVX-512 or AVX2+FMA) streams each weight row once for all rows. Larger inputs (prefill chunks)
stay on torch's linear.

Life cycle: ``install(model)`` (ModelRunner, once) turns the model's ``nn.Linear`` modules into
``SkinnyLinear`` in place (same parameters, tied weights stay tied). They take the kernel only
inside ``active()``, which the ModelRunner enters around its own forward; everywhere else (a Hugging
Face ``generate`` reference on a deep copy, training code) they are plain ``nn.Linear``.
Off with ``PDSERVE_LINEAR=torch``, on machines with neither AVX-512 nor AVX2+FMA, or when the
kernels cannot be built.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.thread_switch import ThreadSwitch

ENV_VAR = "PDSERVE_LINEAR"   # "torch": every linear on torch (comparison, tests)
# Beyond, MKL catches up (benchmarks/results/linear.txt): AVX-512 1.14x at 32 rows, 1.00x at 64;
# AVX2 1.17x at 32 rows.
MAX_ROWS = 32

active = ThreadSwitch()   # held by the ModelRunner around its forward (engine.thread_switch)


def enabled() -> bool:
    """The kernel is built with a SIMD path (AVX-512, or AVX2+FMA) and not switched off with
    ``PDSERVE_LINEAR=torch``."""
    if os.environ.get(ENV_VAR, "").lower() == "torch":
        return False
    return simd_width() > 0


def simd_width() -> int:
    """Floats per vector of the kernel's build: 16 (AVX-512), 8 (AVX2+FMA), 0 (none, or not built)."""
    module = cpu_kernels.module()
    return int(module.skinny_linear_simd_width) if module is not None else 0


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for contiguous float32 CPU x [M, K], weight [N, K] (no bias)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    cpu_kernels.module().skinny_linear(out, x, weight)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, on the kernel inside ``active()`` for at most MAX_ROWS rows. The weight must
    have passed ``_eligible``'s checks (float32, contiguous, CPU) for the kernel to be used."""
    # Cheap checks first: this runs ~200 times per step. The kernel records no autograd.
    in_features = weight.shape[1]
    if x.numel() <= MAX_ROWS * in_features and bias is None and active.on \
            and x.dtype == torch.float32 and x.is_contiguous() and not torch.is_grad_enabled():
        rows = x.view(-1, in_features)
        return skinny_linear(rows, weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class SkinnyLinear(torch.nn.Linear):
    """An ``nn.Linear`` that, inside ``active()``, sends inputs of at most MAX_ROWS rows to the kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _eligible(module: torch.nn.Module) -> bool:
    if type(module) is not torch.nn.Linear:
        return False
    w = module.weight
    return module.bias is None and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()


def install(model: torch.nn.Module) -> int:
    """Turn the model's plain float32 CPU ``nn.Linear`` modules without bias into SkinnyLinear
    (in place); returns how many."""
    linears = [m for m in model.modules() if _eligible(m)]
    for m in linears:
        m.__class__ = SkinnyLinear   # keeps parameters, buffers and hooks: only forward changes
    return len(linears)

