// Linear layer for few input rows on CPU, float32: out[M, N] = x[M, K] . w[N, K]^T, M small
// (a decode step: one row per running request).
//
// Why not MKL's sgemm: for 2-32 rows it packs the weight matrix on every call, so a decode step
// reads and writes each weight ~2-3 times, and at these sizes the step is memory-bound on the
// weights (a 135M model is 536 MB of float32 per step). This kernel streams each weight row from
// memory exactly once: a tile of NR consecutive weight rows is multiplied with MR input rows
// at a time (NR x MR accumulators + NR weight vectors fit in the 32 AVX-512 registers); further
// input rows reuse the tile from L1. The next tile is prefetched while the current one computes.
// Threads split the weight rows through at::parallel_for (torch.set_num_threads is respected).
// AVX-512 only: elsewhere `skinny_linear_simd_width()` is 0 and Python keeps torch's linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int NR = 4;   // weight rows per tile (tile() names them w0..w3)
constexpr int MR = 6;   // input rows per tile: 4 x 6 accumulators + 4 weight vectors <= 32 registers
constexpr int64_t GRAIN = 16;  // tiles per parallel chunk

// One masked K step of a tile (the tail of K when it is not a multiple of 16).
template <int MT>
inline void fma_step(const float* x, int64_t K, const float* const* w, int64_t k, __mmask16 mask,
                     __m512 (&acc)[NR][MT]) {
  __m512 wv[NR];
  for (int r = 0; r < NR; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w[r] + k);
  for (int m = 0; m < MT; ++m) {
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    for (int r = 0; r < NR; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
  }
}

// rows x MT outputs of one tile: y[m * ldy + r] = dot(x[m], w[r]); `prefetch` is the next tile.
// The full-vector loop uses plain loads (the masked form kept GCC from holding the accumulators
// in registers: measured 2x slower at 12 rows).
template <int MT>
void tile(const float* x, int64_t K, const float* const* w, int rows, float* y, int64_t ldy,
          const float* prefetch) {
  __m512 acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const float* w0 = w[0];
  const float* w1 = w[1];
  const float* w2 = w[2];
  const float* w3 = w[3];
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 a0 = _mm512_loadu_ps(w0 + k), a1 = _mm512_loadu_ps(w1 + k);
    const __m512 a2 = _mm512_loadu_ps(w2 + k), a3 = _mm512_loadu_ps(w3 + k);
    if (prefetch != nullptr)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(prefetch + r * K + k), _MM_HINT_T0);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      acc[0][m] = _mm512_fmadd_ps(a0, xv, acc[0][m]);
      acc[1][m] = _mm512_fmadd_ps(a1, xv, acc[1][m]);
      acc[2][m] = _mm512_fmadd_ps(a2, xv, acc[2][m]);
      acc[3][m] = _mm512_fmadd_ps(a3, xv, acc[3][m]);
    }
  }
  if (k < K) fma_step<MT>(x, K, w, k, static_cast<__mmask16>((1u << (K - k)) - 1), acc);
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < rows; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);
}

void tile_rows(int mt, const float* x, int64_t K, const float* const* w, int rows, float* y, int64_t ldy,
               const float* prefetch) {
  switch (mt) {
    case 1: return tile<1>(x, K, w, rows, y, ldy, prefetch);
    case 2: return tile<2>(x, K, w, rows, y, ldy, prefetch);
    case 3: return tile<3>(x, K, w, rows, y, ldy, prefetch);
    case 4: return tile<4>(x, K, w, rows, y, ldy, prefetch);
    case 5: return tile<5>(x, K, w, rows, y, ldy, prefetch);
    default: return tile<MR>(x, K, w, rows, y, ldy, prefetch);
  }
}

void run(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NR;
      const int rows = static_cast<int>(std::min<int64_t>(NR, N - n0));
      const float* w_rows[NR];  // a short last tile repeats its last row (computed, not stored)
      for (int r = 0; r < NR; ++r) w_rows[r] = w + std::min<int64_t>(n0 + r, N - 1) * K;
      const float* next = (t + 1 < t1 && n0 + 2 * NR <= N) ? w + (n0 + NR) * K : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {  // later row groups find the tile in L1
        const int mt = static_cast<int>(std::min<int64_t>(MR, M - m0));
        tile_rows(mt, x + m0 * K, K, w_rows, rows, y + m0 * N + n0, N, m0 == 0 ? next : nullptr);
      }
    }
  });
}
#endif

}  // namespace

void skinny_linear(at::Tensor out, at::Tensor x, at::Tensor weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(), "skinny_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "skinny_linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, "skinny_linear: x [M, K], weight [N, K], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), "skinny_linear: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N, "skinny_linear: shapes do not match");
#if defined(__AVX512F__)
  if (M > 0 && N > 0) run(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), M, K, N);
#else
  TORCH_CHECK(false, "skinny_linear: built without AVX-512");
#endif
}

int skinny_linear_simd_width() {
#if defined(__AVX512F__)
  return 16;
#else
  return 0;
#endif
}
