"""RMSNorm layers of an engine forward on torch's fused ``F.rms_norm``.

Hugging Face's RMSNorm (Llama and its kin) runs five ops per call (to, pow, mean, rsqrt, two
muls), each a pass over the activations with its own temporary; ``F.rms_norm`` is one fused pass.
In float32 on CPU it returns the same bits (tests/test_fast_norm.py checks it on the model's
shapes), so greedy outputs do not move.

Life cycle: ``install(model)`` (ModelRunner, once) turns the model's RMSNorm modules into
``FastRMSNorm`` in place (same parameters). They take ``F.rms_norm`` only inside ``active()``,
which the ModelRunner enters around its own forward; everywhere else (a Hugging Face reference on
a deep copy) they run the model's own code. Off with ``PDSERVE_FAST_NORM=off``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.switches import switched_off
from engine.thread_switch import ThreadSwitch

ENV_VAR = "PDSERVE_FAST_NORM"   # "off": the model's own RMSNorm (comparison, tests)

active = ThreadSwitch()   # held by the ModelRunner around its forward (engine.thread_switch)


def enabled() -> bool:
    return not switched_off(ENV_VAR)


def _eligible(module: torch.nn.Module) -> bool:
    """An RMSNorm in Hugging Face's form: a weight of the hidden size and ``variance_epsilon``,
    computing ``weight * (x * rsqrt(mean(x^2) + eps))`` (checked on Llama-family classes only)."""
    name = type(module).__name__
    return (name.endswith("RMSNorm") and name.startswith(("Llama", "Mistral", "Qwen2"))
            and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def install(model: torch.nn.Module) -> int:
    """Turn the model's eligible RMSNorm modules into FastRMSNorm subclasses (in place); returns how many."""
    count = 0
    for m in model.modules():
        if _eligible(m):
            m.__class__ = _fast_class(type(m))   # keeps parameters, buffers and hooks: only forward changes
            count += 1
    return count


def installed(module: torch.nn.Module) -> bool:
    """``install`` turned this module into a FastRMSNorm."""
    return type(module).forward is _forward


_classes: dict[type, type] = {}


def _fast_class(base: type) -> type:
    """One subclass per model class, so that ``isinstance`` checks on the model's own class still hold."""
    if base not in _classes:
        _classes[base] = type(f"Fast{base.__name__}", (base,), {"forward": _forward})
    return _classes[base]


def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if active.on and hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32 \
            and hidden_states.device.type == "cpu":
        return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
    return super(type(self), self).forward(hidden_states)
