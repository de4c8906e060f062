"""Greedy sampling's argmax + finiteness check (engine.greedy_argmax): the C++ kernel gives
torch.argmax's index (the first of tied maxima) on every finite row and clears the flag whenever a
logit is NaN or ±inf, for any vocabulary size (whole vectors, a tail, less than one vector), batch
and row stride; inputs the kernel does not take go to torch's ops with the same contract. Kernel
cases skip only where the kernels cannot be built (never under CI)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import cpu_kernels, greedy_argmax
from tests.conftest import require_kernel

VOCABS = (1, 5, 8, 15, 16, 17, 31, 33, 100, 1000, 32000, 49152)


@pytest.fixture(scope="module")
def kernel():
    require_kernel(cpu_kernels.available(), f"CPU kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    return cpu_kernels.module()


def kernel_answer(module, logits: torch.Tensor) -> tuple[list[int], bool]:
    out = torch.empty(logits.shape[0] + 1, dtype=torch.long)
    module.greedy_argmax(out, logits)
    *tokens, flag = out.tolist()
    return tokens, bool(flag)


def torch_answer(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_kernel_equals_torch_argmax_with_ties(kernel, batch, vocab):
    g = torch.Generator().manual_seed(batch * 100_003 + vocab)
    tied = torch.randint(-2, 3, (batch, vocab), generator=g).float()   # many equal maxima a row
    normal = torch.randn(batch, vocab, generator=g)
    for logits in (tied, normal, -tied.abs() - 1):
        assert kernel_answer(kernel, logits) == (torch_answer(logits), True)


def test_signed_zeros_tie_as_torch_says(kernel):
    """-0.0 and +0.0 are equal maxima: the first of either wins, as in torch.argmax."""
    row = torch.full((1, 40), -1.0)
    row[0, 21], row[0, 7], row[0, 30] = 0.0, -0.0, 0.0
    assert kernel_answer(kernel, row) == (torch_answer(row), True) == ([7], True)


def test_rows_with_a_stride(kernel):
    """Rows of a wider tensor (a view, row stride > V) read only their own logits."""
    wide = torch.randn(8, 600, generator=torch.Generator().manual_seed(3))
    wide[:, 500:] = 1e9   # outside the view: must never win
    view = wide[:, :500]
    assert kernel_answer(kernel, view) == (torch_answer(view), True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["first", "middle", "tail", "last_row_end"])
def test_any_non_finite_logit_clears_the_flag(kernel, bad, where):
    logits = torch.randn(4, 49_999, generator=torch.Generator().manual_seed(5))
    row, col = {"first": (0, 0), "middle": (2, 20_000), "tail": (1, 49_998), "last_row_end": (3, 49_998)}[where]
    logits[row, col] = bad
    assert kernel_answer(kernel, logits)[1] is False
    assert greedy_argmax.argmax_if_finite(logits)[1] is False


def test_huge_finite_logits_stay_finite(kernel):
    """Finite values whose sum overflows: the kernel's check is per value (torch's one-pass sum calls
    them non-finite, which only sends the batch down the sampler's careful path)."""
    logits = torch.full((2, 300), 3e38)
    logits[1, 17] = float(torch.finfo(torch.float32).max)
    assert kernel_answer(kernel, logits) == ([0, 17], True)


@settings(max_examples=150, deadline=None)
@given(batch=st.integers(1, 9), vocab=st.integers(1, 300), seed=st.integers(0, 2**31),
       levels=st.integers(1, 6))
def test_kernel_fuzzed_against_torch(batch, vocab, seed, levels):
    require_kernel(cpu_kernels.available(), f"CPU kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (batch, vocab), generator=g).float() * torch.randn(1, generator=g)
    assert greedy_argmax.argmax_if_finite(logits) == (torch_answer(logits), True)


@pytest.mark.parametrize("make", [
    lambda x: x.to(torch.bfloat16),            # another dtype
    lambda x: x.double(),
    lambda x: x.t().contiguous().t(),          # V not unit-stride
])
def test_inputs_the_kernel_does_not_take_use_torch(make):
    logits = make(torch.randn(5, 70, generator=torch.Generator().manual_seed(9)))
    assert greedy_argmax.argmax_if_finite(logits) == (torch_answer(logits), True)
    logits[2, 3] = float("nan")
    assert greedy_argmax.argmax_if_finite(logits)[1] is False


def test_switch_off_uses_torch(monkeypatch):
    calls = []
    monkeypatch.setenv(greedy_argmax.ENV_VAR, "off")
    monkeypatch.setattr(greedy_argmax, "_torch_argmax_if_finite",
                        lambda x: calls.append(x) or (torch_answer(x), True))
    logits = torch.randn(3, 50)
    assert greedy_argmax.argmax_if_finite(logits) == (torch_answer(logits), True)
    assert len(calls) == 1


def test_kernel_taken_on_cpu_float32(kernel, monkeypatch):
    """Where the kernels build, float32 CPU logits never go through torch's argmax."""
    monkeypatch.setattr(greedy_argmax, "_torch_argmax_if_finite",
                        lambda x: pytest.fail("torch path taken for float32 CPU logits"))
    logits = torch.randn(4, 49152)
    assert greedy_argmax.argmax_if_finite(logits)[0] == torch_answer(logits)
