"""Sliding-window attention: whether a model's window binds, and the context that keeps it exact.

The engine's attention (the paged kernel, SDPA over packed prompts) attends to every earlier
token. A model whose layers attend only to the last ``sliding_window`` tokens computes the same
thing while a sequence is no longer than the window, and something else past it. So a binding
window caps the context the engine serves at the window (vLLM's ``--disable-sliding-window`` does
the same): requests past it are refused with INVALID_ARGUMENT instead of answered wrongly.

Mistral windows every layer when ``sliding_window`` is set; Qwen2 only its layers typed
"sliding_attention" (``use_sliding_window`` with ``max_window_layers``). Neither binds when the
window covers the model's whole context.
"""

from __future__ import annotations

from transformers import PretrainedConfig


def binding_window(config: PretrainedConfig) -> int | None:
    """The attention window when some layer's is shorter than the model's context, else None."""
    window = getattr(config, "sliding_window", None)
    if window is None or window >= config.max_position_embeddings:
        return None
    types = getattr(config, "layer_types", None)
    return window if types is None or "sliding_attention" in types else None


def exact_context(config: PretrainedConfig) -> int:
    """The longest sequence the engine's full attention serves exactly: the window, when one binds."""
    window = binding_window(config)
    return config.max_position_embeddings if window is None else window
