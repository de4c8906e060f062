"""Greedy sampling's argmax, with the finiteness check that decides whether it stands: each row's
first index of its largest logit and whether every logit of the batch is finite, brought to the
host in one piece (``engine.sampler`` acts on both).

On CPU with float32 logits this is one call of ``engine/csrc/greedy_argmax.cpp`` (torch's CPU
argmax runs ~12x slower than a max over the same row: 2.6 ms of a decode step at batch 64 on
SmolLM2's 49,152-token vocabulary; benchmarks/bench_greedy_argmax.py). Elsewhere (a GPU, another
dtype, the kernels unavailable, or ``PDSERVE_ARGMAX_KERNEL=off``) torch's ops do it, with one
transfer to the host (on a GPU each transfer waits for the device). Both give torch.argmax's index
on finite rows; when the flag is False the indices are not to be used.
"""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.switches import switched_off

ENV_VAR = "PDSERVE_ARGMAX_KERNEL"


def argmax_if_finite(logits: torch.Tensor) -> tuple[list[int], bool]:
    """``logits`` [B, V]: (each row's argmax, whether every logit is finite)."""
    module = _kernel_for(logits)
    if module is not None:
        out = torch.empty(logits.shape[0] + 1, dtype=torch.long)
        module.greedy_argmax(out, logits)
        *tokens, flag = out.tolist()
        return tokens, bool(flag)
    return _torch_argmax_if_finite(logits)


def _kernel_for(logits: torch.Tensor):
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 \
            or logits.shape[1] == 0 or logits.stride(1) != 1 or switched_off(ENV_VAR):
        return None
    return cpu_kernels.module()


def _torch_argmax_if_finite(logits: torch.Tensor) -> tuple[list[int], bool]:
    """One pass decides finiteness: any NaN or ±inf makes the sum non-finite (finite logits
    overflowing it only send the batch down the careful path); isfinite().all() made four
    passes over the batch."""
    finite = torch.isfinite(logits.sum()).to(torch.long)
    *tokens, flag = torch.cat((logits.argmax(dim=-1), finite[None])).tolist()
    return tokens, bool(flag)
