"""The C++ fused rotary embedding + KV-cache write (paged_kernel.rope_write_kv) against Hugging
Face's own apply_rotary_pos_emb and the attention's index_copy_ write: equal bit for bit (torch.equal,
signed zeros included), on views of a fused q/k/v projection output as the lean forward passes them;
bad inputs raise, slots outside the cache included. Skipped only where the kernels cannot be built
(never under CI)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine import paged_kernel
from tests.conftest import require_kernel


@pytest.fixture(scope="module")
def kernel():
    require_kernel(paged_kernel.available() and paged_kernel.rope_supports(64),
                   f"fused rotary kernel unavailable here: {paged_kernel.unavailable_reason() or 'no SIMD build'}")
    return paged_kernel


def make_case(tokens, heads, kv_heads, head_dim, seed=0, num_blocks=40, block_size=16, scale=1.0):
    """A fused [1, T, (heads + 2 kv_heads) d] projection output and its q/k/v column views, cos/sin
    of the model's own rotary embedding at scattered positions, caches and distinct free slots."""
    from transformers import LlamaConfig

    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(1, tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * scale
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096)
    positions = torch.randint(0, 4096, (1, tokens), generator=g)
    cos, sin = LlamaRotaryEmbedding(config)(fused, position_ids=positions)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    return q, k, v, cos, sin, cache, slots


def hugging_face(q, k, v, cos, sin, cache, slots, head_dim):
    """The model's ops: views, transposes, apply_rotary_pos_emb, then the attention's cache write."""
    tokens = q.shape[1]
    shape = (1, tokens, -1, head_dim)
    q_rot, k_rot = apply_rotary_pos_emb(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)
    cache = cache.clone()
    kv_heads = cache.shape[-2]
    cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k_rot[0].transpose(0, 1))
    cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v.view(shape)[0])
    return q_rot[0].transpose(0, 1), cache


def fused_kernel(kernel, q, k, v, cos, sin, cache, slots, head_dim):
    tokens = q.shape[1]
    cache = cache.clone()
    q_rot = kernel.rope_write_kv(q[0].view(tokens, -1, head_dim), k[0].view(tokens, -1, head_dim),
                                 v[0].view(tokens, -1, head_dim), cos[0], sin[0], cache[0], cache[1], slots)
    return q_rot, cache


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (2, 1, 32)])
def test_bit_identical_to_hugging_face(kernel, tokens, heads, kv_heads, head_dim):
    if not kernel.rope_supports(head_dim):
        pytest.skip(f"head_dim {head_dim} is not a multiple of twice this build's SIMD width")
    case = make_case(tokens, heads, kv_heads, head_dim, seed=tokens + head_dim)
    want_q, want_cache = hugging_face(*case, head_dim)
    got_q, got_cache = fused_kernel(kernel, *case, head_dim)
    assert same_bits(got_q, want_q)
    assert same_bits(got_cache, want_cache)


def test_extreme_values_and_signed_zeros(kernel):
    """Zeros of both signs, huge and tiny magnitudes: the same bits as the model's separate ops (an
    FMA, or 0 - x for the negation, would differ here)."""
    q, k, v, cos, sin, cache, slots = make_case(32, 4, 2, 64, seed=9)
    for t in (q, k):
        t[0, ::4] = 0.0
        t[0, 1::4] = -0.0
        t[0, 2::4] *= 1e30
        t[0, 3::4] *= 1e-30
    want_q, want_cache = hugging_face(q, k, v, cos, sin, cache, slots, 64)
    got_q, got_cache = fused_kernel(kernel, q, k, v, cos, sin, cache, slots, 64)
    assert same_bits(got_q, want_q) and same_bits(got_cache, want_cache)


def test_threads_agree(kernel):
    case = make_case(200, 9, 3, 64, seed=3)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(fused_kernel(kernel, *case, 64))
    finally:
        torch.set_num_threads(before)
    assert same_bits(results[0][0], results[1][0]) and same_bits(results[0][1], results[1][1])


def test_bad_inputs_raise(kernel):
    q, k, v, cos, sin, cache, slots = make_case(8, 4, 2, 64)
    args = lambda **o: {**dict(q=q[0].view(8, -1, 64), k=k[0].view(8, -1, 64), v=v[0].view(8, -1, 64), cos=cos[0],
                                sin=sin[0], k_cache=cache[0], v_cache=cache[1], slots=slots), **o}
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.rope_write_kv(**args(slots=torch.tensor([0, 1, 2, 3, 4, 5, 6, cache[0].shape[0] * 16])))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.rope_write_kv(**args(slots=torch.tensor([-1, 1, 2, 3, 4, 5, 6, 7])))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.rope_write_kv(**args(cos=cos[0].double()))
    with pytest.raises(RuntimeError, match=r"cos and sin"):
        kernel.rope_write_kv(**args(cos=cos[0, :, :32], sin=sin[0, :, :32]))
    with pytest.raises(RuntimeError, match="slots"):
        kernel.rope_write_kv(**args(slots=slots[:4]))
    with pytest.raises(RuntimeError, match="caches"):
        kernel.rope_write_kv(**args(k_cache=cache[0][..., :1, :]))
