"""Whether the engine can serve a model, decided when an engine is built: a model it cannot
serve is refused there, with the reason (``UnsupportedModelError``, so a worker's start fails
saying why), instead of being accepted and then failing or mis-answering every request.

The engine runs the model's own modules and swaps in its attention through transformers'
attention registry (engine/attention.py), so it serves any decoder whose attention goes through
that registry with the usual causal semantics. Two checks:
- the config (``config_refusal``, before any KV cache is sized): the head counts the cache is
  shaped by, and attention features the paged attention does not apply (logit soft-capping,
  ALiBi biases);
- one short prompt (``probe``, once the runner is built): the last position's logits through
  the engine's forward (its paged attention, its fast paths) against the model's own forward
  with SDPA. A model whose layers do not hand the engine's attention its metadata, or attend
  differently, fails here (seen: StableLM's layers drop the extra arguments).

Life cycle: ``LLMEngine.__init__`` calls ``config_refusal`` then, with its runner, ``probe``.
"""

from __future__ import annotations

import torch

from engine import kv_cache
from engine.attention import AttentionMetadata, PrefillSegment
from engine.errors import UnsupportedModelError
from engine.model_runner import ModelInputs, ModelRunner
from engine.types import KVLayout

PROBE_TOKENS = 5
# max |engine - model| over max |model| of the probe's logits. Float32 paths agree to ~1e-6 on
# CPU (an attention 1% off reads 1e-2); GPU kernels pick algorithms by shape, hence the room. Half
# types round every op to 8-11 bits and differ more between two correct attentions: there the
# probe looks for gross failures only (the config check covers features the attention lacks).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-8}
HALF_TOLERANCE = 0.25


def config_refusal(config) -> str | None:
    """Why the engine cannot serve a model of this config (None: it may; the probe decides)."""
    name = type(config).__name__
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size"):
        if getattr(config, field, None) is None:
            return f"{name} has no {field}: pdserve serves decoders with Llama-style configs"
    for field in ("attn_logit_softcapping",):
        if getattr(config, field, None):
            return f"{name} sets {field}: the engine's paged attention does not soft-cap attention logits"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        return f"{name} uses ALiBi position biases: the engine's paged attention adds none"
    return None


def check_config(config) -> None:
    reason = config_refusal(config)
    if reason is not None:
        raise UnsupportedModelError(reason)


def probe(runner: ModelRunner, layout: KVLayout) -> None:
    """One PROBE_TOKENS-token prompt through ``runner``'s forward on a throwaway KV cache, against
    the model's own forward: UnsupportedModelError when they disagree or the engine's fails."""
    model, device = runner.model, runner.device
    vocab = model.config.vocab_size
    ids = (torch.arange(PROBE_TOKENS, device=device) * 7919 + 11) % vocab
    expected = _reference_logits(model, ids)
    inputs = ModelInputs(ids[None], torch.arange(PROBE_TOKENS, device=device)[None],
                         torch.tensor([PROBE_TOKENS - 1], device=device), _metadata(layout, device), PROBE_TOKENS)
    try:
        got = runner.execute(inputs)
    except Exception as exc:   # noqa: BLE001 - any failure of the engine's forward is the refusal
        raise UnsupportedModelError(f"{type(model).__name__}: the engine's forward fails on it "
                                    f"({type(exc).__name__}: {exc})") from exc
    diff = (got[0].float() - expected.float()).abs().max().item() / max(expected.float().abs().max().item(), 1e-30)
    tolerance = TOLERANCE.get(expected.dtype, HALF_TOLERANCE)
    if not diff <= tolerance:
        raise UnsupportedModelError(f"{type(model).__name__}: the engine's attention does not reproduce the "
                                    f"model's own (logits differ by {diff:.2e} of their scale on a "
                                    f"{PROBE_TOKENS}-token prompt; tolerance {tolerance:.0e})")


def _reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits from the model's own forward with transformers' SDPA attention."""
    config = model.config
    engine_attention = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        with torch.inference_mode():
            return model(input_ids=ids[None], use_cache=False).logits[0, -1]
    finally:
        config._attn_implementation = engine_attention


def _metadata(layout: KVLayout, device: torch.device) -> AttentionMetadata:
    """The probe prompt as one causal prefill segment over a cache of its own (the engine's pool
    is not touched)."""
    blocks = -(-PROBE_TOKENS // layout.block_size)
    cache = kv_cache.allocate(layout, blocks, str(device))
    segment = PrefillSegment(q_start=0, q_len=PROBE_TOKENS, ctx_len=PROBE_TOKENS,
                             block_ids=torch.arange(blocks, device=device), mask=None)
    return AttentionMetadata(kv_cache=cache, slot_mapping=torch.arange(PROBE_TOKENS, device=device),
                             prefills=[segment], decode_groups=[])
