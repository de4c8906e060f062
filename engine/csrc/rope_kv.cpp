// Rotary position embedding of a step's queries and keys, and the keys and values written into
// the paged KV cache, in one pass over the fused q/k/v projection output (CPU, float32).
//
// Why: Hugging Face's apply_rotary_pos_emb is ~10 ops per layer (two products, a negation and a
// concatenation for rotate_half, a sum; for q and for k), each a pass with its own temporary, and
// the cache write two more (index_copy_ of k and v): at a decode step of SmolLM2 that is ~400
// dispatches of a few microseconds each, at a prefill a few passes over MB-sized tensors.
//
// Bit-identical to Hugging Face: per element the same float32 operations in the same order,
// each rounded on its own:  out[j] = (x[j] * cos[j]) + (r[j] * sin[j]), r = cat(-x2, x1), where
// -x2 is (-1) * x2 (exact, signed zeros included). An empty asm statement pins each product in a
// register, so the compiler cannot contract product and sum into an FMA (which rounds once).
//
// Layout: q [T, heads, d], k and v [T, kv_heads, d] (any token and head strides, unit-stride d:
// views of the fused projection output); cos, sin [T, d] contiguous; q_out [T, heads, d]
// contiguous; caches [num_blocks, block_size, kv_heads, d] contiguous; slots [T] the flat slot
// (block * block_size + offset) of each token. Tokens are split over torch's threads.
//
// SIMD only, with d / 2 a multiple of the vector width; `rope_kv_supports` says so, and Python
// keeps Hugging Face's ops elsewhere. Bound to Python in module.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

#ifdef PDSERVE_SIMD
using namespace pdserve_simd;

constexpr int64_t GRAIN = 8;  // tokens per parallel chunk

// The value as it is, but opaque to the optimizer: a product passed through it is never fused
// with the sum that follows.
static inline vec pinned(vec x) {
  asm("" : "+v"(x));
  return x;
}

// out[0, d) = x * cos + rotate_half(x) * sin for one head's row.
static inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  const vec minus_one = vset1(-1.0f);
  for (int64_t i = 0; i < half; i += W) {
    const vec x1 = vload(x + i), x2 = vload(x + half + i);
    vstore(out + i, vadd(pinned(vmul(x1, vload(cos + i))), pinned(vmul(vmul(minus_one, x2), vload(sin + i)))));
    vstore(out + half + i,
           vadd(pinned(vmul(x2, vload(cos + half + i))), pinned(vmul(x1, vload(sin + half + i)))));
  }
}
#endif

}  // namespace

bool rope_kv_supports(int64_t head_dim) {
#ifdef PDSERVE_SIMD
  return head_dim > 0 && head_dim % (2 * W) == 0;
#else
  return false;
#endif
}

void rope_write_kv(at::Tensor q_out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                   at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  for (const at::Tensor* t : {&q_out, &q, &k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "rope_write_kv: float32 CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q_out.sizes() == q.sizes(),
              "rope_write_kv: q and q_out must be [T, heads, d], k and v [T, kv_heads, d]");
  const int64_t T = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.size(0) == T && k.size(2) == d, "rope_write_kv: q, k and v must share T and d");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q_out.is_contiguous(),
              "rope_write_kv: d must be the unit-stride axis and q_out contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == d &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rope_write_kv: cos and sin must be contiguous [T, d]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(2) == kv_heads && k_cache.size(3) == d,
              "rope_write_kv: caches must be contiguous [num_blocks, block_size, kv_heads, d]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "rope_write_kv: slots must be a contiguous int64 [T]");
  TORCH_CHECK(rope_kv_supports(d), "rope_write_kv: head_dim ", d, " is not a multiple of twice the SIMD width");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rope_write_kv: slot ", slot[t], " out of range");
#ifdef PDSERVE_SIMD
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *op = q_out.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t q_t = q.stride(0), q_h = q.stride(1), k_t = k.stride(0), k_h = k.stride(1);
  const int64_t v_t = v.stride(0), v_h = v.stride(1);
  at::parallel_for(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + t * d, *s = sp + t * d;
      for (int64_t h = 0; h < heads; ++h) rotate(qp + t * q_t + h * q_h, c, s, d, op + (t * heads + h) * d);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t row = (slot[t] * kv_heads + h) * d;
        rotate(kp + t * k_t + h * k_h, c, s, d, kc + row);
        std::memcpy(vc + row, vp + t * v_t + h * v_h, d * sizeof(float));
      }
    }
  });
#endif
}
