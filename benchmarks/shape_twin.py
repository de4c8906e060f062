"""Writes a shape twin of a model: its config, generation config and tokenizer files, with
random weights drawn from a seed, as a Hugging Face directory ``load_model`` reads.

Why: timing runs on the lent GPU machine, where the embedded SmolLM2 cannot travel (its
working-tree transfer is capped at 64 MiB; the GGUF alone is 98 MB). Dense fp32/bf16 kernels
take the same time whatever the weights hold, so a twin times like the real model; its text
is noise, so runs using one say so and ignore EOS. Correctness is shown elsewhere, on real
and on tiny random models alike (greedy output equals HF ``generate``).

    python -m benchmarks.shape_twin SRC_DIR OUT_DIR [--seed 0]

SRC_DIR holds ``config.json`` and the tokenizer (a converted model directory, or just those
files); weights are not read.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig

from engine.model_loader import random_model

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_twin(src: Path, out: Path, seed: int = 0) -> Path:
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    model = random_model(config, seed=seed).model
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(4)
    print(write_twin(args.src, args.out, args.seed))


if __name__ == "__main__":
    main()
