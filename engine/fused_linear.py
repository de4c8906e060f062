"""Sibling linear layers that read the same input run as one GEMM: q/k/v projections, gate/up.

A transformers decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden states,
and ``gate_proj`` and ``up_proj`` on the same MLP input: five GEMMs (or skinny-kernel calls) per
layer that could be two. Fused, each reads its input once, runs one larger GEMM, and pays one
call's Python and threading overhead instead of three (or two).

Life cycle: ``install(model)`` (ModelRunner, once) finds each module's sibling groups with the same
input size, dtype and device and the same bias-ness, concatenates their weights (and biases) into
one tensor per group and points each member's weight at its row slice of it: a view, so no
memory is added and ``state_dict``, in-place weight loads and the modules' own code all see the
fused tensor. Inside ``active()`` (entered by the ModelRunner around its forward) the first member
called computes the whole group's output in one call and the others return their column slices
of it. The model's code is untouched: it still calls q, k, v (gate, up) in turn. Everywhere else,
or if a member's weight no longer lies in its group's tensor (a deep copy, a ``.to()`` elsewhere),
each member is a plain linear layer. Off with ``PDSERVE_FUSED_LINEAR=off``.
"""

from __future__ import annotations

import torch

from engine import skinny_linear
from engine.switches import switched_off
from engine.thread_switch import ThreadSwitch

ENV_VAR = "PDSERVE_FUSED_LINEAR"   # "off": every projection on its own (comparison, tests)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

active = ThreadSwitch()   # held by the ModelRunner around its forward (engine.thread_switch)


def enabled() -> bool:
    return not switched_off(ENV_VAR)


class _Group:
    """One fused weight (and bias) and the members that slice it; caches the output of the
    last input until every member has taken its slice."""

    def __init__(self, members: list[torch.nn.Linear]) -> None:
        self.members = tuple(members)
        self.sizes = [m.out_features for m in members]
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in members]).contiguous()
            has_bias = members[0].bias is not None
            self.bias = torch.cat([m.bias for m in members]).contiguous() if has_bias else None
            start = 0
            for m, size in zip(members, self.sizes):
                m.weight.data = self.weight[start : start + size]
                if has_bias:
                    m.bias.data = self.bias[start : start + size]
                start += size
        self._views = [(m.weight, m.weight.data_ptr()) for m in members]
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []
        self._pending = 0

    def intact(self) -> bool:
        """Every member still computes with its slice of the fused weight (same parameter, same memory)."""
        return all(m.weight is w and w.data_ptr() == ptr for m, (w, ptr) in zip(self.members, self._views))

    def in_use(self) -> bool:
        """The fused GEMM serves the members now: inside ``active()``, no autograd, weights intact."""
        return active.on and not torch.is_grad_enabled() and self.intact()

    def compute(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's output for ``x`` from one call: column slices of the fused output."""
        return list(skinny_linear.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        # Keyed on the input tensor itself (held, so its id cannot be reused): the members are
        # called one after the other on the same hidden states, which the model does not change
        # in place in between (inference tensors keep no version counter to check that).
        if self._input is not x:
            self._outputs = self.compute(x)
            self._input, self._pending = x, len(self.members)
        out = self._outputs[index]
        self._pending -= 1
        if self._pending == 0:   # every member served: hold no activations between calls
            self._input, self._outputs = None, []
        return out


class FusedLinear(torch.nn.Linear):
    """A member of a fused group: inside ``active()`` its output is its slice of the group's GEMM."""

    _fused_group: _Group
    _fused_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._fused_group
        if group.in_use():
            return group.output(self._fused_index, x)
        return skinny_linear.linear(x, self.weight, self.bias)


def group_of(*members: torch.nn.Module) -> _Group | None:
    """The fused group ``members`` make up, whole and in order; None when they are not one."""
    group = getattr(members[0], "_fused_group", None)
    return group if group is not None and group.members == members else None


def outputs(members: tuple[torch.nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Each member's output for ``x``, as calling them in turn gives it: in one call when they are
    a whole fused group in use (engine.lean_forward takes them so, skipping the members' calls)."""
    group = group_of(*members)
    if group is not None and group.in_use():
        return group.compute(x)
    return [m(x) for m in members]


def _fusable(members: list[torch.nn.Module]) -> bool:
    first = members[0]
    return all(
        type(m) in (torch.nn.Linear, skinny_linear.SkinnyLinear)
        and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in members
    )


def install(model: torch.nn.Module) -> int:
    """Fuse every sibling group found (in place); returns how many groups."""
    count = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if any(m is None for m in members) or not _fusable(members):
                continue
            group = _Group(members)
            for index, m in enumerate(members):
                m.__class__ = FusedLinear   # keeps parameters, buffers and hooks: only forward changes
                m._fused_group, m._fused_index = group, index
            count += 1
    return count

