"""The engine's forward of a Llama-family model on packed tokens, without Hugging Face's plumbing.

Why: ``model(input_ids=..., pdserve_attn=...)`` runs, per layer, Hugging Face's decorated forward
bodies (kwargs merging and deprecation wrappers, the gradient-checkpointing ``__call__``, the
attention-interface lookup, output dataclasses) and, per forward, its mask and output capture:
single-threaded Python that does not shrink with more threads (~4-5 ms of a 30-layer SmolLM2
forward; at batch 64 and 2 threads a decode forward gains 2.6-5.5%: benchmarks/results/lean_forward.txt).
This module runs the same model directly:

    embed -> rotary cos/sin (the model's own rotary_emb, once) -> per layer: input norm, q/k/v
    projections (one fused GEMM where engine.fused_linear installed it), the model's own
    apply_rotary_pos_emb, the registered paged attention, o_proj, residual, post-attention norm,
    MLP (gate/up fused likewise), residual -> final norm -> lm_head on the kept positions.

On float32 CPU, where the C++ kernels take the head dim, the rotary embedding and the attention's
KV-cache write run as one call (paged_kernel.rope_write_kv: the same float32 operations in the
same order, so the same bits; ~12 dispatches per layer fewer: a decode step at batch 64 of
SmolLM2 190 vs 197 ms, a 512-token prefill 798 vs 821 ms, interleaved). On CUDA with Triton the
elementwise work runs on engine.triton_fused's kernels: each residual add fused into the norm after
it, the rotary embedding with the KV write, SiLU with its multiply (ten kernels a layer, not ~45).
On float32 CPU with those C++ kernels the layers run as straight-line calls (engine.lean_cpu), and
a decode-only step's whole layer stack as one C++ call with the GIL released: the same ops, the same bits.

It calls the model's own modules and parameters (no copies), the same ops in the same order on
the same shapes as the Hugging Face bodies, so its logits are bit-identical to the model's call
(tests/test_lean_forward.py checks torch.equal). Plain torch ops and no branching on tensor
values: the CUDA-graph capture (engine.cuda_graphs) records it like the model's call.

Which models: the stock Llama, Mistral and Qwen2 causal LMs of the installed transformers (exact
classes: a subclass or another family, e.g. Qwen3's qk-norm, may run other code), whose attention
never binds a sliding window and whose modules carry no hooks (the containers' would be skipped).
``refusal(model)`` says why a model is refused; a refused model runs through its own call.

Life cycle: ``build(model)`` (ModelRunner, once, after its installs) returns a ``LeanForward``,
or None when refused or switched off (``PDSERVE_LEAN_FORWARD=off``); the runner calls it per
forward inside its switches (skinny_linear, fused_linear, fast_norm stay in force: the modules
called here are the installed ones). It holds references to the model's modules only: no state.
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine import attention, fused_linear, paged_kernel, triton_fused
from engine.lean_cpu import CpuLayers
from engine.sliding_window import binding_window
from engine.switches import switched_off

logger = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_LEAN_FORWARD"   # "off": the model's own call (comparison, tests)
# Causal LM class name -> its transformers module; the stock classes are looked up there.
FAMILIES = {
    "LlamaForCausalLM": "transformers.models.llama.modeling_llama",
    "MistralForCausalLM": "transformers.models.mistral.modeling_mistral",
    "Qwen2ForCausalLM": "transformers.models.qwen2.modeling_qwen2",
}


class Refusal(enum.Enum):
    """Why a model runs through its own call instead."""

    ARCHITECTURE = "architecture"      # not a stock Llama/Mistral/Qwen2 causal LM (or a layer is not stock)
    SLIDING_WINDOW = "sliding_window"  # a layer's attention window is shorter than the model's context
    HOOKS = "hooks"                    # a module carries forward hooks or an instance forward (accelerate's)


def enabled() -> bool:
    return not switched_off(ENV_VAR)


def refusal(model: torch.nn.Module) -> Refusal | None:
    """None when ``LeanForward`` runs this model bit-identically to its own call."""
    family = FAMILIES.get(type(model).__name__)
    hf = importlib.import_module(family) if family is not None else None
    if hf is None or type(model) is not getattr(hf, type(model).__name__) or not _stock_layers(model, hf):
        return Refusal.ARCHITECTURE
    if binding_window(model.config) is not None:
        return Refusal.SLIDING_WINDOW
    if any(_hooked(m) for m in model.modules()):
        return Refusal.HOOKS
    return None


def _stock_layers(model: torch.nn.Module, hf) -> bool:
    prefix = type(model).__name__.removesuffix("ForCausalLM")
    base = model.model
    if type(base) is not getattr(hf, f"{prefix}Model"):
        return False
    norm = getattr(hf, f"{prefix}RMSNorm")   # isinstance: engine.fast_norm's subclass gives the same bits
    return isinstance(base.norm, norm) and all(
        type(layer) is getattr(hf, f"{prefix}DecoderLayer")
        and type(layer.self_attn) is getattr(hf, f"{prefix}Attention")
        and type(layer.mlp) is getattr(hf, f"{prefix}MLP")
        and isinstance(layer.input_layernorm, norm) and isinstance(layer.post_attention_layernorm, norm)
        for layer in base.layers
    )


def _hooked(module: torch.nn.Module) -> bool:
    """Forward hooks, or a forward set on the instance (accelerate's device hooks wrap it so):
    the lean forward never calls the containers (layers, attention, MLP) whose hooks would run."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or "forward" in vars(module)



def _is_silu(act_fn) -> bool:
    from transformers import activations   # SiLUActivation where this transformers has it, else nn.SiLU
    return isinstance(act_fn, (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU)))


def build(model: torch.nn.Module) -> LeanForward | None:
    """The lean forward of ``model``; None when switched off or refused (logged)."""
    if not enabled():
        return None
    reason = refusal(model)
    if reason is not None:
        logger.info("lean forward refused (%s): %s runs through its own call", reason.value, type(model).__name__)
        return None
    return LeanForward(model)


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's modules, read once (the forward reaches them without attribute walks)."""

    input_norm: torch.nn.Module
    attn: torch.nn.Module
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_proj: torch.nn.Module
    up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    head_dim: int
    scaling: float
    silu: bool                 # act_fn is SiLU: triton_fused.silu_mul may replace act_fn(gate) * up


class LeanForward:
    def __init__(self, model: torch.nn.Module) -> None:
        base = model.model
        self.embed_tokens = base.embed_tokens
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm
        self.lm_head = model.lm_head
        # The family's own function, as its attention forward calls it.
        self.apply_rotary = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
        # Resolved as the model's attention resolves it: the registry entry engine.attention registered.
        self.attention = attention.registered()
        self.layers = [
            _Layer(layer.input_layernorm, layer.self_attn, layer.self_attn.q_proj, layer.self_attn.k_proj,
                   layer.self_attn.v_proj, layer.self_attn.o_proj, layer.post_attention_layernorm,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, layer.mlp.act_fn,
                   layer.self_attn.head_dim, layer.self_attn.scaling, _is_silu(layer.mlp.act_fn))
            for layer in base.layers[: model.config.num_hidden_layers]
        ]
        # Every norm in the order the forward meets them (each layer's two, then the final one): the
        # fused path adds each residual into the norm that follows it.
        self.norm_chain = [n for layer in self.layers for n in (layer.input_norm, layer.post_norm)] + [self.norm]
        # float32 CPU forwards: the same layers as straight-line calls (engine.lean_cpu), where they apply.
        self.cpu_layers = CpuLayers.build(self.layers, self.attention, paged_kernel.rope_write_kv)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor,
                 metadata: attention.AttentionMetadata) -> torch.Tensor:
        """Logits [num_kept, vocab] at the packed positions ``logits_indices`` (input_ids,
        position_ids: [1, num_tokens])."""
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(hidden, position_ids=position_ids)
        fused = triton_fused.applies(hidden, self.norm.weight)
        rope = self._rope_kernel(hidden, cos_sin, fused)
        attend = functools.partial(self._attention_fused_rope, rope) if rope is not None else self._attention
        if fused:
            hidden = self._layers_fused(hidden, cos_sin, attend, metadata)
        elif self.cpu_layers is not None and self.cpu_layers.applies(hidden, rope):
            hidden = self.norm(self.cpu_layers(hidden, cos_sin, metadata))
        else:
            for layer in self.layers:
                hidden = hidden + attend(layer, layer.input_norm(hidden), cos_sin, metadata)
                hidden = hidden + self._mlp(layer, layer.post_norm(hidden))
            hidden = self.norm(hidden)
        return self.lm_head(hidden[:, logits_indices, :])[0]

    def _layers_fused(self, hidden: torch.Tensor, cos_sin, attend, metadata) -> torch.Tensor:
        """The decoder layers and the final norm with each residual add fused into the norm after
        it and SiLU into its multiply (engine.triton_fused: GPU kernels)."""
        norms = self.norm_chain
        x, residual = triton_fused.add_rms_norm(hidden, None, norms[0].weight, norms[0].variance_epsilon)
        for i, layer in enumerate(self.layers):
            post, following = norms[2 * i + 1], norms[2 * i + 2]
            delta = attend(layer, x, cos_sin, metadata)
            x, residual = triton_fused.add_rms_norm(delta, residual, post.weight, post.variance_epsilon)
            delta = self._mlp(layer, x, fused=True)
            x, residual = triton_fused.add_rms_norm(delta, residual, following.weight, following.variance_epsilon)
        return x

    def _attention(self, layer: _Layer, x: torch.Tensor, cos_sin, metadata) -> torch.Tensor:
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, layer.head_dim)
        q, k, v = fused_linear.outputs((layer.q_proj, layer.k_proj, layer.v_proj), x)
        q = q.view(hidden_shape).transpose(1, 2)
        k = k.view(hidden_shape).transpose(1, 2)
        v = v.view(hidden_shape).transpose(1, 2)
        q, k = self.apply_rotary(q, k, *cos_sin)
        out, _ = self.attention(layer.attn, q, k, v, None, dropout=0.0, scaling=layer.scaling, pdserve_attn=metadata)
        return layer.o_proj(out.reshape(*input_shape, -1).contiguous())

    def _rope_kernel(self, hidden: torch.Tensor, cos_sin, fused: bool):
        """The rotary embedding + KV-cache write as one call, or None (the model's own ops): the
        Triton kernel with the other fused kernels (GPU), the C++ one for float32 on CPU (the
        same bits as the model's rotary and cache write). Both need cos/sin covering the head."""
        head_dim = self.layers[0].head_dim if self.layers else 0
        if fused and triton_fused.rope_supports(head_dim, cos_sin[0]):
            return triton_fused.rope_write_kv
        if (hidden.device.type == "cpu" and hidden.dtype == torch.float32 and cos_sin[0].dtype == torch.float32
                and cos_sin[0].shape[-1] == head_dim and paged_kernel.rope_supports(head_dim)):
            return paged_kernel.rope_write_kv
        return None

    def _attention_fused_rope(self, rope, layer: _Layer, x: torch.Tensor, cos_sin, metadata) -> torch.Tensor:
        """``_attention`` with the rotary embedding and the KV-cache write as one ``rope`` call."""
        tokens = x.shape[1]
        q, k, v = fused_linear.outputs((layer.q_proj, layer.k_proj, layer.v_proj), x)
        k_cache, v_cache = metadata.kv_cache[layer.attn.layer_idx]
        q = rope(q[0].view(tokens, -1, layer.head_dim), k[0].view(tokens, -1, layer.head_dim),
                 v[0].view(tokens, -1, layer.head_dim), cos_sin[0][0], cos_sin[1][0], k_cache, v_cache,
                 metadata.slot_mapping)
        out, _ = self.attention(layer.attn, q.transpose(0, 1)[None], None, None, None, dropout=0.0,
                                scaling=layer.scaling, pdserve_attn=metadata, pdserve_kv_written=True)
        return layer.o_proj(out.reshape(1, tokens, -1).contiguous())

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate, up = fused_linear.outputs((layer.gate_proj, layer.up_proj), x)
        if fused and layer.silu:
            return layer.down_proj(triton_fused.silu_mul(gate, up))
        return layer.down_proj(layer.act_fn(gate) * up)
