"""Resolves the model once, before any worker starts: a GGUF is converted to a cached
safetensors directory (about 18 s once, then every worker loads in seconds).

Runs inside a Ray task so the driver (router) process never imports torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreparedModel:
    path: str   # the HF directory every worker loads (a GGUF's converted cache)
    name: str   # the model's clean name (engine.model_loader.model_name)
    converted_s: float | None = None   # a GGUF converted by this call, not found cached: how long it took


@ray.remote(num_cpus=0)
def prepare_model(source: str | None) -> PreparedModel:
    from engine.model_loader import ensure_converted, gguf_cache_path, model_name, resolve_source

    path, is_gguf = resolve_source(source)
    name = model_name(source, path, is_gguf)
    if not is_gguf:
        return PreparedModel(str(path), name)
    cached = (gguf_cache_path(path) / "config.json").is_file()
    started = time.monotonic()
    converted = ensure_converted(path)
    return PreparedModel(str(converted), name, None if cached else time.monotonic() - started)


def load_tokenizer(model_dir: str):
    """The router's tokenizer (transformers' fast tokenizer class does not import torch); None
    for a model directory without one: the router then serves token ids alone, as the workers do."""
    from engine.tokenizer_files import has_tokenizer
    from transformers import PreTrainedTokenizerFast

    if not has_tokenizer(model_dir):
        logger.warning("no tokenizer files in %s; the router serves token ids only", model_dir)
        return None
    return PreTrainedTokenizerFast.from_pretrained(model_dir)
