"""The device functions both paged-attention Triton kernels call (engine/triton_attention.py for
decode, engine/triton_prefill.py for prompts): reading a tile of a request's keys and values in
place through its block table, and folding that tile into an online softmax. Written once; Triton
inlines them into each kernel.

They are module globals, not defined in a kernel builder as the kernels are: Triton's CPU
interpreter (the tests' ``TRITON_INTERPRET=1``) resolves a kernel's names in its module's globals
only, not in a closure. Defined only where Triton imports; without it this module is empty and no
kernel is ever built.
"""

from __future__ import annotations

from engine import triton_support

if (_found := triton_support.modules()) is not None:
    triton, tl = _found

    @triton.jit
    def load_kv_tile(K, V, table, pos, valid, kv_off, d, stride_kb, stride_kt, BLOCK: tl.constexpr):
        """The keys and values at context positions ``pos`` of one KV head, read in place through
        the block ``table`` (a pointer to the request's row); positions not ``valid`` read zeros."""
        block = tl.load(table + pos // BLOCK, mask=valid, other=0)
        offs = block.to(tl.int64) * stride_kb + (pos % BLOCK) * stride_kt + kv_off
        k = tl.load(K + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + offs[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        return k, v

    @triton.jit
    def attend_tile(q, k, v, seen, scale, m, denom, acc, IEEE: tl.constexpr):
        """One tile of keys into the online softmax of queries ``q``: scores where ``seen`` (a mask
        that broadcasts to [queries, keys]); the running max ``m``, sum ``denom`` and unnormalized
        output ``acc`` updated and returned. Scores and sums are float32 whatever the inputs."""
        if IEEE:   # float32 exact to rounding (no TF32): greedy output must equal HF's
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:      # half types on tensor cores, float32 accumulation
            s = tl.dot(q, tl.trans(k))
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, denom, acc
