"""The lean forward's decoder layers on CPU in float32 as straight-line calls of the engine's
kernels, for steps of any shape (decode, prefill, mixed).

Why: at low batch a CPU decode step of a small model is largely the Python around its ops. Each
layer of the lean forward's general loop goes through module calls and the fast paths' per-call
checks: the norms (``fast_norm``), the fused projections (``fused_linear.outputs``: group lookup
and intactness per call), the linear kernels' row checks (``skinny_linear.linear``), the MLP's
activation module. A 30-layer forward of a 2-head, 128-wide Llama (ops that cost next to nothing)
took 6.5 ms at batch 1 on the general loop, 5.3 ms here, 2.5 ms as one C++ call (below); on
SmolLM2 a batch-1 decode step 34.6 -> 29.6 ms (benchmarks/bench_decode_step.py). Here each layer is the same ops on the same tensors, in the same order, with what does not
change between forwards read once (weights, fused weights and their split sizes, norms' eps)
and what depends on the step resolved once per forward (the linear kernel for its row count),
so the logits are bit-identical to the general loop's and to the model's own call.

When (``CpuLayers.build`` once, ``applies`` per forward): every layer's q/k/v and gate/up are
fused groups (``engine.fused_linear``), its o_proj and down_proj ``skinny_linear``'s layers or plain ones,
its norms ``fast_norm``'s, its activation SiLU; and per forward: float32 hidden states on CPU,
the C++ rotary + KV-write kernel in use, no autograd, and the switches the general loop consults
on (``skinny_linear``, ``fused_linear`` with every group intact, ``fast_norm``). Anything else:
``None`` / False, and the general loop runs. No state between forwards.

Decode-only steps go further: the whole layer stack is one call of ``engine/csrc/decode_layers.cpp``
(the same calls from C++, the GIL released throughout; ``native``), else the Python loop below runs
them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import cpu_kernels, fast_norm, fused_linear, paged_kernel, skinny_linear
from engine.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class _CpuLayer:
    """One decoder layer's parameters as its calls take them."""

    input_norm: tuple[torch.Tensor, float]        # weight, eps
    qkv: fused_linear._Group
    attn: torch.nn.Module                         # the attention module (the registered function's first argument)
    head_dim: int
    scaling: float
    o_proj: tuple[torch.Tensor, torch.Tensor | None]
    post_norm: tuple[torch.Tensor, float]
    gate_up: fused_linear._Group
    down_proj: tuple[torch.Tensor, torch.Tensor | None]
    # o_proj, down_proj are skinny_linear's layers (the kernels may take them); else plain nn.Linear
    o_skinny: bool
    down_skinny: bool


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None


@dataclass(frozen=True, slots=True)
class NativeLayers:
    """What ``decode_layers`` (engine/csrc/decode_layers.cpp) takes of the model, gathered once."""

    norms: list[torch.Tensor]   # each layer's input and post-attention norm weights
    eps: list[float]
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]   # a projection with a bias runs on torch's linear, as in Python
    o_bias: list[torch.Tensor | None]
    gate_up_bias: list[torch.Tensor | None]
    down_bias: list[torch.Tensor | None]
    scales: list[float]
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def build(cls, layers: list[_CpuLayer]) -> NativeLayers | None:
        """None unless every layer's o_proj and down_proj are the linear kernels' layers or have a bias
        (torch's linear either way), its gate/up halves are even, all have the same heads, each sits
        at its own cache index, and the extension has the call."""
        module = cpu_kernels.module()
        if not layers or module is None or not hasattr(module, "decode_layers"):
            return None
        hd = layers[0].head_dim
        heads, kv_heads = layers[0].qkv.sizes[0] // hd, layers[0].qkv.sizes[1] // hd
        for i, layer in enumerate(layers):
            if not (layer.o_skinny or layer.o_proj[1] is not None) \
                    or not (layer.down_skinny or layer.down_proj[1] is not None) or layer.attn.layer_idx != i or layer.head_dim != hd \
                    or layer.qkv.sizes != [heads * hd, kv_heads * hd, kv_heads * hd] \
                    or len(set(layer.gate_up.sizes)) != 1:
                return None
        return cls([n for layer in layers for n in (layer.input_norm[0], layer.post_norm[0])],
                   [e for layer in layers for e in (layer.input_norm[1], layer.post_norm[1])],
                   [layer.qkv.weight for layer in layers], [layer.o_proj[0] for layer in layers],
                   [layer.gate_up.weight for layer in layers], [layer.down_proj[0] for layer in layers],
                   [layer.qkv.bias for layer in layers], [layer.o_proj[1] for layer in layers],
                   [layer.gate_up.bias for layer in layers], [layer.down_proj[1] for layer in layers],
                   [layer.scaling for layer in layers], heads, kv_heads, hd)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: Linear,
                 metadata: AttentionMetadata) -> torch.Tensor:
        group = metadata.decode_only_group
        out = cpu_kernels.module().decode_layers(
            hidden[0], self.norms, self.eps, self.qkv, self.o, self.gate_up, self.down, self.qkv_bias, self.o_bias,
            self.gate_up_bias, self.down_bias, metadata.kv_cache,
            self.scales, self.heads, self.kv_heads, self.head_dim, cos.contiguous(), sin.contiguous(),
            metadata.slot_mapping, group.block_tables, group.context_lens, _KERNEL_CODES[kernel])
        return out[None]


# skinny_linear.kernel_for's answer as decode_layers.cpp names it.
_KERNEL_CODES = {None: 0, skinny_linear.skinny_linear: 1, skinny_linear.panel_linear: 2}


def _decode_only(metadata: AttentionMetadata) -> bool:
    """The step is one group of decode tokens in step order on the paged decode kernel (what
    ``engine.attention.paged_attention`` then runs directly)."""
    group = metadata.decode_only_group
    return group is not None and group.context_lens is not None and paged_kernel.enabled()


class CpuLayers:
    def __init__(self, layers: list[_CpuLayer], attention: Callable, rope: Callable) -> None:
        self.layers = layers
        self.attention = attention
        self.rope = rope
        self._groups = [g for layer in layers for g in (layer.qkv, layer.gate_up)]
        self.native = NativeLayers.build(layers)   # None: decode-only steps take the Python loop too

    @classmethod
    def build(cls, lean_layers: Sequence, attention: Callable, rope: Callable) -> CpuLayers | None:
        """From the lean forward's ``_Layer`` list; None when a layer is not in the form above."""
        layers = []
        for layer in lean_layers:
            qkv = fused_linear.group_of(layer.q_proj, layer.k_proj, layer.v_proj)
            gate_up = fused_linear.group_of(layer.gate_proj, layer.up_proj)
            if qkv is None or gate_up is None or not layer.silu or not all(
                    _fast_norm(n) for n in (layer.input_norm, layer.post_norm)) or not all(
                    type(m) in (skinny_linear.SkinnyLinear, torch.nn.Linear) for m in (layer.o_proj, layer.down_proj)):
                return None
            layers.append(_CpuLayer(
                (layer.input_norm.weight, layer.input_norm.variance_epsilon), qkv, layer.attn, layer.head_dim,
                layer.scaling, (layer.o_proj.weight, layer.o_proj.bias),
                (layer.post_norm.weight, layer.post_norm.variance_epsilon), gate_up,
                (layer.down_proj.weight, layer.down_proj.bias), _skinny(layer.o_proj), _skinny(layer.down_proj)))
        return cls(layers, attention, rope)

    def applies(self, hidden: torch.Tensor, rope: Callable | None) -> bool:
        """Whether this forward may run here: what the general loop would consult, checked once."""
        return (rope is self.rope and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
                and fast_norm.active.on and all(g.in_use() for g in self._groups))

    def __call__(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 metadata: AttentionMetadata) -> torch.Tensor:
        """The decoder layers on ``hidden`` [1, tokens, hidden]; returns the last residual stream."""
        tokens = hidden.shape[1]
        kernel = skinny_linear.kernel_for(tokens)   # every layer's projections have one row per token
        cos, sin = cos_sin[0][0], cos_sin[1][0]
        if self.native is not None and _decode_only(metadata):
            return self.native(hidden, cos, sin, kernel, metadata)
        for layer in self.layers:
            x = F.rms_norm(hidden, layer.input_norm[0].shape, *layer.input_norm)
            hidden = hidden + self._attention(layer, x, kernel, cos, sin, metadata)
            x = F.rms_norm(hidden, layer.post_norm[0].shape, *layer.post_norm)
            gate, up = _linear(kernel, x, layer.gate_up.weight, layer.gate_up.bias).split(layer.gate_up.sizes, dim=-1)
            hidden = hidden + _linear(kernel if layer.down_skinny else None, F.silu(gate) * up, *layer.down_proj)
        return hidden

    def _attention(self, layer: _CpuLayer, x: torch.Tensor, kernel: Linear, cos, sin,
                   metadata: AttentionMetadata) -> torch.Tensor:
        tokens, hd = x.shape[1], layer.head_dim
        q, k, v = _linear(kernel, x, layer.qkv.weight, layer.qkv.bias).split(layer.qkv.sizes, dim=-1)
        k_cache, v_cache = metadata.kv_cache[layer.attn.layer_idx]
        q = self.rope(q[0].view(tokens, -1, hd), k[0].view(tokens, -1, hd), v[0].view(tokens, -1, hd), cos, sin,
                      k_cache, v_cache, metadata.slot_mapping)
        out, _ = self.attention(layer.attn, q.transpose(0, 1)[None], None, None, None, dropout=0.0,
                                scaling=layer.scaling, pdserve_attn=metadata, pdserve_kv_written=True)
        return _linear(kernel if layer.o_skinny else None, out.reshape(1, tokens, -1).contiguous(), *layer.o_proj)


def _linear(kernel: Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``skinny_linear.linear`` with its kernel chosen for the forward: x [1, rows, in]."""
    if kernel is None or bias is not None or not x.is_contiguous():
        return F.linear(x, weight, bias)
    return kernel(x[0], weight)[None]


def _skinny(module: torch.nn.Module) -> bool:
    return type(module) is skinny_linear.SkinnyLinear


def _fast_norm(module: torch.nn.Module) -> bool:
    return fast_norm.installed(module) and module.weight.dtype == torch.float32
