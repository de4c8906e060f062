"""Linear layers of an engine forward with few rows (decode steps) on the C++ kernels.

A decode step multiplies one row per running request by every weight matrix. At 2-32 rows MKL's
sgemm repacks the weight on each call and the step, memory-bound on the weights (536 MB of
float32 for SmolLM2-135M), costs ~2x a single row's; the skinny kernel
(``engine/csrc/skinny_linear.cpp``, AVX-512 or AVX2+FMA) streams each weight row once for all
rows. Past the skinny kernel's limit (a large decode batch, a short prefill chunk) the step is
compute-bound and the panel kernel (``engine/csrc/panel_linear.cpp``: an outer-product GEMM over
the weight in place) runs nearer the FLOP peak than MKL at these row counts, up to the panel
limit; larger inputs (long prefill chunks) stay on torch's linear. The limits depend on the
build's SIMD path, each measured on a machine that builds it (``ROW_LIMITS``).

Life cycle: ``install(model)`` (ModelRunner, once) turns the model's ``nn.Linear`` modules into
``SkinnyLinear`` in place (same parameters, tied weights stay tied). They take the kernel only
inside ``active()``, which the ModelRunner enters around its own forward; everywhere else (a Hugging
Face ``generate`` reference on a deep copy, training code) they are plain ``nn.Linear``.
Off with ``PDSERVE_LINEAR=torch``, on machines with neither AVX-512 nor AVX2+FMA, or when the
kernels cannot be built.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.thread_switch import ThreadSwitch

ENV_VAR = "PDSERVE_LINEAR"   # "torch": every linear on torch (comparison, tests)


@dataclass(frozen=True, slots=True)
class RowLimits:
    """How many rows each kernel takes on one SIMD path: the skinny kernel up to ``skinny``,
    the panel kernel from there up to ``panel``, torch's linear beyond."""

    skinny: int
    panel: int


# By the build's floats per vector (benchmarks/results/linear.txt, every SmolLM2 linear, 1 and
# 2 threads). AVX2+FMA: the skinny kernel beats MKL up to 32 rows (1.17x there), the panel one
# 1.15-1.25x at 48-96, 0.97x at 128. AVX-512 (Zen 4): the panel kernel is past the skinny one
# from ~24 rows (at 32: 164 vs 124 GFLOP/s at 2 threads) and past MKL up to ~256 (at 64:
# 1.4-1.8x, at 256 1.0-1.1x; at 512 MKL leads). Zen 4 runs AVX-512 on 256-bit units; an Intel core
# with two 512-bit FMA units is unmeasured (PDSERVE_LINEAR=torch is the comparison there).
ROW_LIMITS = {16: RowLimits(skinny=24, panel=256), 8: RowLimits(skinny=32, panel=96)}

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


@functools.cache
def row_limits() -> RowLimits:
    """This build's limits; none (0 rows) where no SIMD path was built."""
    return ROW_LIMITS.get(simd_width(), RowLimits(0, 0))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for contiguous float32 CPU x [M, K], weight [N, K] (no bias)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    cpu_kernels.module().skinny_linear(out, x, weight)
    return out


def panel_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` on the panel kernel, same contract as ``skinny_linear``."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    cpu_kernels.module().panel_linear(out, x, weight)
    return out


def kernel_for(rows: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The kernel ``linear`` takes for a contiguous float32 input of ``rows`` rows and no bias, or
    None (torch's linear): inside ``active()``, without autograd (the kernels record none), at most
    ``row_limits().panel`` rows, the skinny one up to ``row_limits().skinny``."""
    limits = row_limits()
    if rows > limits.panel or not active.on or torch.is_grad_enabled():
        return None
    return skinny_linear if rows <= limits.skinny else panel_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, on ``kernel_for``'s kernel where it takes the input. The weight must have passed
    ``_eligible``'s checks (float32, contiguous, CPU) for a kernel to be used."""
    # Cheap checks first: this runs ~200 times per step.
    if bias is None and x.dtype == torch.float32 and x.is_contiguous():
        in_features = weight.shape[1]
        kernel = kernel_for(x.numel() // in_features)
        if kernel is not None:
            return kernel(x.view(-1, in_features), weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class SkinnyLinear(torch.nn.Linear):
    """An ``nn.Linear`` that, inside ``active()``, sends inputs of few enough rows to the kernels."""

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

