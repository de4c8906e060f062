// Linear layer for few input rows on CPU, float32: out[M, N] = x[M, K] . w[N, K]^T, M small
// (a decode step: one row per running request).
//
// Why not MKL's sgemm: for 2-32 rows it packs the weight matrix on every call, so a decode step
// reads and writes each weight ~2-3 times, and at these sizes the step is memory-bound on the
// weights (a 135M model is 536 MB of float32 per step). This kernel streams each weight row from
// memory exactly once: a tile of NR consecutive weight rows is multiplied with MR input rows
// at a time (NR x MR accumulators + NR weight vectors + one input vector fit in the vector
// registers); further input rows reuse the tile from L1. The next tile is prefetched while the
// current one computes, one cache line per weight row per step, into L2 (_MM_HINT_T1): the
// hardware brings it on to L1. Prefetching into L1 itself (T0) kept the kernel at about half the
// read roofline on a Zen 4 (1 thread, every SmolLM2 linear at 1-4 rows: 41-47 ms vs 24-27 ms
// with T1 and a 22-23 ms sum() over the same weights; 1.2-1.9x across 1-24 rows, 1 and 2
// threads, both SIMD builds: benchmarks/results/linear.txt).
// Threads split the weight rows through at::parallel_for (torch.set_num_threads is respected).
//
// Two SIMD paths, chosen at build time by -march=native (engine/cpu_kernels.py): AVX-512 (32 ZMM
// registers: NR=4, MR=6) and AVX2+FMA (16 YMM registers: NR=3, MR=4). Both exist because the
// machines pdserve runs on differ (a CI or serving host may have either; AMD EPYC before Zen 4
// has no AVX-512) and the kernel pays off on both (benchmarks/results/linear.txt). Each output is
// one FMA chain per SIMD lane over K, then a horizontal sum, so results differ from torch's only
// by float32 rounding. Elsewhere `skinny_linear_simd_width()` is 0 and Python keeps torch's linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "linear_args.h"
#include "simd.h"

namespace {

#ifdef PDSERVE_SIMD
using namespace pdserve_simd;

#if defined(__AVX512F__)
constexpr int NR = 4;   // weight rows per tile
constexpr int MR = 6;   // input rows per tile: 4 x 6 accumulators + 4 weight vectors <= 32 registers
#else
// 3 x 4 accumulators + 3 weight vectors + 1 input vector = the 16 YMM registers. Measured against
// 2x6, 4x3, 2x4 and 1x8 (every SmolLM2-135M linear, CPU time): best or within 5% at 1-32 rows.
constexpr int NR = 3;
constexpr int MR = 4;
#endif
constexpr int GRAIN = 16;        // tiles per parallel chunk

// One K step of a tile: acc[r][m] += w[r][k..k+W) * x[m][k..k+W). `Tail` loads n < W floats.
template <int MT, bool Tail>
inline void fma_step(const float* x, int64_t K, const float* const* w, int64_t k, int64_t n,
                     vec (&acc)[NR][MT]) {
  vec wv[NR];
  for (int r = 0; r < NR; ++r) wv[r] = Tail ? vload_tail(w[r] + k, n) : vload(w[r] + k);
  for (int m = 0; m < MT; ++m) {
    const vec xv = Tail ? vload_tail(x + m * K + k, n) : vload(x + m * K + k);
    for (int r = 0; r < NR; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
  }
}

// rows x MT outputs of one tile: y[m * ldy + r] = dot(x[m], w[r]); `prefetch` is the next tile.
// The full-vector loop uses plain loads (a masked load in it kept GCC from holding the
// accumulators in registers: measured 2x slower at 12 rows).
template <int MT>
void tile(const float* x, int64_t K, const float* const* w, int rows, float* y, int64_t ldy,
          const float* prefetch) {
  vec acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = vzero();
  int64_t k = 0;
  for (; k + LINE <= K; k += LINE) {
    if (prefetch != nullptr)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(prefetch + r * K + k), _MM_HINT_T1);
#pragma GCC unroll 2
    for (int v = 0; v < LINE; v += W) fma_step<MT, false>(x, K, w, k + v, W, acc);
  }
  for (; k + W <= K; k += W) fma_step<MT, false>(x, K, w, k, W, acc);
  if (k < K) fma_step<MT, true>(x, K, w, k, K - k, acc);
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < rows; ++r) y[m * ldy + r] = hsum(acc[r][m]);
}

// tile<mt> for 1 <= mt <= MT.
template <int MT>
void tile_rows(int mt, const float* x, int64_t K, const float* const* w, int rows, float* y, int64_t ldy,
               const float* prefetch) {
  if constexpr (MT > 1) {
    if (mt < MT) return tile_rows<MT - 1>(mt, x, K, w, rows, y, ldy, prefetch);
  }
  tile<MT>(x, K, w, rows, y, ldy, prefetch);
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
        tile_rows<MR>(mt, x + m0 * K, K, w_rows, rows, y + m0 * N + n0, N, m0 == 0 ? next : nullptr);
      }
    }
  });
}
#endif

}  // namespace

void skinny_linear(at::Tensor out, at::Tensor x, at::Tensor weight) {
  [[maybe_unused]] const auto [M, K, N] = check_linear_args("skinny_linear", out, x, weight);
#ifdef PDSERVE_SIMD
  if (M > 0 && N > 0) run(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), M, K, N);
#else
  TORCH_CHECK(false, "skinny_linear: built without AVX-512 or AVX2+FMA");
#endif
}

int skinny_linear_simd_width() {
#ifdef PDSERVE_SIMD
  return W;
#else
  return 0;
#endif
}
