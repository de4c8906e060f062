"""Whether a model directory ships a tokenizer: the one rule the workers' model loader and the
router's tokenizer share (torch-free, so the router can import it). A directory without one is
served by token ids alone: text and chat prompts get INVALID_ARGUMENT naming the prompt."""

from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model_dir: str | os.PathLike[str]) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)
