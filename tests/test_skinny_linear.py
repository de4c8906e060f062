"""The C++ few-rows linear kernel against float64 matmul, and its dispatch: only inside the
engine's forward, only for few rows, never for a Hugging Face reference sharing the model.
Both SIMD paths (AVX-512, AVX2+FMA) are covered by whichever the machine builds; skipped only where
the kernel cannot run (neither, or no compiler; never under CI)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels, skinny_linear
from engine.config import EngineConfig
from engine.engine import LLMEngine


@pytest.fixture(scope="module")
def kernel():
    if not skinny_linear.enabled():
        reason = "skinny linear kernel unavailable here (needs AVX-512 or AVX2+FMA, and a compiler)"
        if os.environ.get("CI") and os.environ.get(skinny_linear.ENV_VAR, "") != "torch":
            pytest.fail(reason)
        pytest.skip(reason)
    return skinny_linear


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 32])
@pytest.mark.parametrize("out_features,in_features",
                         [(1, 1), (3, 17), (7, 24), (4, 31), (5, 576), (193, 64), (1536, 577)])
def test_matches_float64_matmul(kernel, rows, out_features, in_features):
    """Every tile shape of both paths: partial weight tiles (N % 4 on AVX-512, N % 3 on AVX2),
    partial row tiles (M % 6, M % 4), K in whole cache lines, plus one 8-float vector (AVX2), plus
    a masked tail."""
    _assert_matches_float64(kernel.skinny_linear, rows, out_features, in_features)


@pytest.mark.parametrize("rows", [1, 17, 25, 33, 40, 47, 48, 49, 64, 65, 96, 97, 144, 145, 256])
@pytest.mark.parametrize("out_features,in_features",
                         [(1, 1), (3, 0), (5, 17), (7, 576), (13, 769), (15, 33), (193, 64), (1536, 1537)])
def test_panel_matches_float64_matmul(kernel, rows, out_features, in_features):
    """The panel kernel (decode batches past the skinny limit): every tile shape of both builds
    (AVX2 6 x 2 vectors; AVX-512 14 x 2 and 9 x 3, the one that pads the rows least), partial
    weight tiles (N % 6, N % 14, N % 9), partial and whole input panels (of 16 rows on AVX2, 32
    and 48 on AVX-512), K in one block and in several (past 768), K = 0."""
    _assert_matches_float64(kernel.panel_linear, rows, out_features, in_features)


def _assert_matches_float64(linear, rows: int, out_features: int, in_features: int) -> None:
    """``linear(x, w)`` on seeded random inputs equals x @ w.T computed in float64."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    got = linear(x, w)
    assert got.shape == (rows, out_features)
    assert rel_err(got, x.double() @ w.double().T) < 1e-5


def test_simd_path_matches_the_cpu():
    """A machine with AVX-512, or AVX2+FMA, builds that path: the kernel never silently falls back."""
    module = cpu_kernels.module()
    if module is None:
        pytest.skip(f"CPU kernels not built here: {cpu_kernels.unavailable_reason()}")
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    with open("/proc/cpuinfo") as f:
        flags = set(next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), []))
    want = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 0
    assert module.skinny_linear_simd_width == want
    assert skinny_linear.simd_width() == want


@pytest.mark.parametrize("name, rows", [("skinny_linear", 9), ("panel_linear", 64)])
def test_threads_split_the_weight_rows(kernel, name, rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g), torch.randn(4099, 576, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = getattr(kernel, name)(x, w)
    finally:
        torch.set_num_threads(before)
    assert rel_err(got, x.double() @ w.double().T) < 1e-5


def test_rejects_bad_inputs(kernel):
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernel.skinny_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.skinny_linear(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))


def _counting(monkeypatch, name: str = "skinny_linear") -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = getattr(skinny_linear, name)

    def spy(x, w):
        calls.append((x.shape[0], w.shape[0]))
        return real(x, w)

    monkeypatch.setattr(skinny_linear, name, spy)
    return calls


def test_dispatch_only_inside_active_and_for_few_rows(kernel, monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 8, bias=True))
    assert skinny_linear.install(model) == 1            # the biased layer stays a plain nn.Linear
    assert type(model[0]) is skinny_linear.SkinnyLinear and type(model[1]) is torch.nn.Linear
    calls = _counting(monkeypatch)
    panel_calls = _counting(monkeypatch, "panel_linear")
    limits = skinny_linear.row_limits()
    assert limits == skinny_linear.ROW_LIMITS[skinny_linear.simd_width()]
    assert 0 < limits.skinny < limits.panel
    few, many = torch.randn(1, 3, 64), torch.randn(1, limits.panel + 1, 64)
    middle, most = torch.randn(1, limits.skinny + 1, 64), torch.randn(1, limits.panel, 64)

    with skinny_linear.active():
        model[0](few).sum().backward()                 # autograd on: torch's linear, gradients flow
    assert not calls and model[0].weight.grad is not None
    with torch.no_grad():
        outside = model[0](few)
        with skinny_linear.active():
            inside = model[0](few)
            big = model[0](many)
            mid = model[0](middle)
            top = model[0](most)
            with skinny_linear.active(False):
                nested_off = model[0](few)
        want = F.linear(few.double(), model[0].weight.double())
        assert calls == [(3, 96)], "only the few-row call inside active() takes the skinny kernel"
        assert panel_calls == [(limits.skinny + 1, 96), (limits.panel, 96)], "past the skinny limit: the panel kernel"
        for got, x in ((mid, middle), (top, most)):
            assert rel_err(got, F.linear(x.double(), model[0].weight.double())) < 1e-5
        assert torch.equal(outside, F.linear(few, model[0].weight))
        assert inside.shape == (1, 3, 96) and rel_err(inside, want) < 1e-5
        assert torch.equal(big, F.linear(many, model[0].weight)), "past the panel limit: torch's linear"
        assert torch.equal(nested_off, outside)
    assert not skinny_linear.active.on, "active() restores the previous state"


def test_install_keeps_tied_weights_and_copies_stay_plain(kernel, tiny_model, monkeypatch):
    model = copy.deepcopy(tiny_model.model)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    skinny_linear.install(model)            # (an earlier engine may have installed it on tiny_model already)
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, skinny_linear.SkinnyLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    calls = _counting(monkeypatch)
    reference = copy.deepcopy(model)        # as the test references are made: a deep copy, outside active()
    reference.config._attn_implementation = "sdpa"
    with torch.inference_mode():
        reference(input_ids=torch.tensor([[5, 6, 7]]))
    assert not calls


def test_engine_uses_the_kernel_unless_switched_off(kernel, tiny_model, monkeypatch):
    model = copy.deepcopy(tiny_model)
    assert LLMEngine(model, EngineConfig(num_kv_blocks=8)).runner.skinny
    monkeypatch.setenv(skinny_linear.ENV_VAR, "torch")
    assert not skinny_linear.enabled()
    assert not LLMEngine(copy.deepcopy(tiny_model), EngineConfig(num_kv_blocks=8)).runner.skinny
