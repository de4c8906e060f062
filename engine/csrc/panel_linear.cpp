// Linear layer for a decode batch of a few dozen rows on CPU, float32:
// out[M, N] = x[M, K] . w[N, K]^T with M of ~32-128 (one row per running request).
//
// Why not MKL's sgemm: at these M it runs at ~75-80% of its large-M rate (it packs the weight
// on every call, and the packing is not amortized over enough rows), and why not the skinny
// kernel (skinny_linear.cpp): its dot-product tiles re-read every input row from L2 for each
// tile of 3-4 weight rows, which at 64 rows costs as much as the arithmetic.
//
// Here the input is transposed once per call into xt[K][Mp] (Mp = M rounded up to a panel of
// MP = 2 vectors, padded with zeros; 147 KB at M = 64, K = 576: it stays in L2), and the output
// is computed transposed, as out^T = w . x^T, by an outer-product micro-kernel: NR = 6 weight
// rows x MP input rows of accumulators (12 vector registers); per k it broadcasts one float of
// each of the 6 weight rows and loads 2 vectors of xt[k], 12 FMAs for 8 loads. The weight is
// read in place (no packed copy: 6 sequential streams the hardware prefetcher follows); a
// tile of 6 weight rows (14 KB at K = 576) stays in L1 while every input panel passes over it,
// so each weight byte comes from memory once. Each output is one FMA chain over k in order,
// so results differ from torch's only by float32 rounding.
// Threads split the weight rows (at::parallel_for, torch.set_num_threads is respected).
//
// SIMD: AVX-512 (MP = 32) or AVX2+FMA (MP = 16), chosen by -march=native at build time
// (engine/cpu_kernels.py); elsewhere `panel_linear_simd_width()` is 0 and Python keeps torch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "linear_args.h"
#include "simd.h"

namespace {

#ifdef PDSERVE_SIMD
using namespace pdserve_simd;

constexpr int NR = 6;        // weight rows per tile: 6 x 2 accumulators + 2 loads + 1 broadcast <= 16 YMM
constexpr int MP = 2 * W;    // input rows per panel
constexpr int GRAIN = 4;     // tiles per parallel chunk
constexpr int64_t KC = 768;  // longest K block: 6 weight rows x 768 floats = 18 KB of L1

// acc[r][v] += sum over k in [k0, k1) of w[r][k] * xt[k][v * W .. v * W + W) for one tile and
// one panel; acc (NR x MP floats) carries the sums between K blocks, so each output is still
// one chain over k in order.
void tile(const float* const* w, const float* xt, int64_t k0, int64_t k1, int64_t ldx, bool first, float* acc) {
  vec a0[NR], a1[NR];
  for (int r = 0; r < NR; ++r) {
    a0[r] = first ? vzero() : vload(acc + r * MP);
    a1[r] = first ? vzero() : vload(acc + r * MP + W);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const vec x0 = vload(xt + k * ldx), x1 = vload(xt + k * ldx + W);
#pragma GCC unroll 6
    for (int r = 0; r < NR; ++r) {
      const vec b = vbcast(w[r] + k);
      a0[r] = vfma(b, x0, a0[r]);
      a1[r] = vfma(b, x1, a1[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    vstore(acc + r * MP, a0[r]);
    vstore(acc + r * MP + W, a1[r]);
  }
}

void run(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t panels = (M + MP - 1) / MP, ldx = panels * MP;
  std::vector<float> xt(static_cast<size_t>(K * ldx), 0.0f);  // x^T, zero-padded to whole panels
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * ldx + m] = x[m * K + k];
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, GRAIN, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(static_cast<size_t>(panels * NR * MP));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NR;
      const int rows = static_cast<int>(std::min<int64_t>(NR, N - n0));
      const float* w_rows[NR];  // a short last tile repeats its last row (computed, not stored)
      for (int r = 0; r < NR; ++r) w_rows[r] = w + std::min<int64_t>(n0 + r, N - 1) * K;
      // K in equal blocks of at most KC, so the tile's weight rows stay in L1 while every
      // input panel passes over them (at K = 1536 they would not: 37 KB).
      const int64_t nkb = std::max<int64_t>(1, (K + KC - 1) / KC), kc = std::max<int64_t>(1, (K + nkb - 1) / nkb);
      for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kc) {  // K = 0: one pass, zeros
        const int64_t k1 = std::min(K, k0 + kc);
        for (int64_t p = 0; p < panels; ++p)
          tile(w_rows, xt.data() + p * MP, k0, k1, ldx, k0 == 0, acc.data() + p * NR * MP);
      }
      for (int64_t p = 0; p < panels; ++p) {
        const int mt = static_cast<int>(std::min<int64_t>(MP, M - p * MP));
        const float* a = acc.data() + p * NR * MP;
        float* out = y + p * MP * N + n0;
        for (int m = 0; m < mt; ++m)
          for (int r = 0; r < rows; ++r) out[m * N + r] = a[r * MP + m];
      }
    }
  });
}
#endif

}  // namespace

void panel_linear(at::Tensor out, at::Tensor x, at::Tensor weight) {
  [[maybe_unused]] const auto [M, K, N] = check_linear_args("panel_linear", out, x, weight);
#ifdef PDSERVE_SIMD
  if (M > 0 && N > 0) run(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), M, K, N);
#else
  TORCH_CHECK(false, "panel_linear: built without AVX-512 or AVX2+FMA");
#endif
}

int panel_linear_simd_width() {
#ifdef PDSERVE_SIMD
  return W;
#else
  return 0;
#endif
}
