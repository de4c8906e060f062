// The vector wrappers every pdserve CPU kernel is written in, one definition for all of them
// (paged_attention.cpp, skinny_linear.cpp, panel_linear.cpp): `vec` is W floats, AVX-512 where
// the build machine has it, else AVX2+FMA (-march=native, engine/cpu_kernels.py). Where neither
// exists PDSERVE_SIMD is left undefined, PDSERVE_SIMD_WIDTH is 0, and each kernel keeps its
// portable path or reports itself unavailable.
// engine/cpu_kernels.py hashes this header with the sources, so editing it rebuilds the extension.

#pragma once

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PDSERVE_SIMD 1
#endif
#if defined(__AVX512F__)
#define PDSERVE_SIMD_WIDTH 16
#elif defined(PDSERVE_SIMD)
#define PDSERVE_SIMD_WIDTH 8
#else
#define PDSERVE_SIMD_WIDTH 0
#endif

#ifdef PDSERVE_SIMD
namespace pdserve_simd {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int W = 16;  // floats per vector
constexpr int REGS = 32;  // vector registers, the budget of a kernel's register tile
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vload_tail(const float* p, int64_t n) {  // p[0..n), zeros after; n < W
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vbcast(const float* p) { return _mm512_set1_ps(*p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline uint32_t eq_mask(vec a, vec b) {  // bit i set where lane i of a equals lane i of b
  return static_cast<uint32_t>(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ));
}
static inline __m128 to128(vec v) {  // 16 lanes -> 4 partial sums, halves added
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s = _mm256_add_ps(lo, hi);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#else
using vec = __m256;
constexpr int W = 8;
constexpr int REGS = 16;
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vload_tail(const float* p, int64_t n) {  // p[0..n), zeros after; n < W
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vbcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline uint32_t eq_mask(vec a, vec b) {  // bit i set where lane i of a equals lane i of b
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)));
}
static inline __m128 to128(vec v) {  // 8 lanes -> 4 partial sums
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}
#endif

constexpr int LINE = 16;  // floats per 64-byte cache line: the step of every kernel's software prefetch
static_assert(LINE % W == 0, "a cache line holds whole vectors");

// Sum of the lanes, halves added at every level (as _mm512_reduce_add_ps does; cheaper than
// _mm_hadd_ps, which is 3 uops on AMD Zen).
static inline float hsum(vec v) {
  __m128 s = to128(v);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Largest lane (of finite lanes: max_ps does not order NaN).
static inline float hmax(vec v) {
  float lanes[W];
  vstore(lanes, v);
  float m = lanes[0];
  for (int i = 1; i < W; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}

}  // namespace pdserve_simd
#endif  // PDSERVE_SIMD
