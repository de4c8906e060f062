// Linear layer for a decode batch of a few dozen to a few hundred rows on CPU, float32:
// out[M, N] = x[M, K] . w[N, K]^T with M of ~24-256 (one row per running request).
//
// Why not MKL's sgemm: at these M it runs well below its large-M rate (it packs the weight
// on every call, and the packing is not amortized over enough rows; on an AVX-512 Zen 4 at
// 2 threads 82-126 GFLOP/s at 32-128 rows against this kernel's 160-176: benchmarks/results/
// linear.txt), and why not the skinny kernel (skinny_linear.cpp): its dot-product tiles re-read
// every input row from L2 for each tile of 3-4 weight rows, which at 64 rows costs as much as
// the arithmetic.
//
// Here the input is transposed once per call into xt[K][Mp] (Mp = M rounded up to a panel of
// MP = V vectors, padded with zeros; 147 KB at M = 64, K = 576: it stays in L2), and the output
// is computed transposed, as out^T = w . x^T, by an outer-product micro-kernel: NR weight rows
// x MP input rows of accumulators (NR x V vector registers); per k it broadcasts one float of
// each of the NR weight rows and loads V vectors of xt[k]. The weight is read in place (no
// packed copy: NR sequential streams, and while the first panel passes over a tile the next
// tile's rows are prefetched into L2, a cache line per row every 16 k: 6-14% faster at 25-128
// rows on the Zen 4, 1 and 2 threads); a tile of NR weight rows stays in L1 while every input
// panel passes over it, so each weight byte comes from memory once. Each output is one FMA
// chain over k in order, so results differ from torch's only by float32 rounding.
// Tile shapes fill the vector registers (NR x V accumulators + V loads + 1 broadcast <= REGS):
// AVX2+FMA (16 registers) 6 x 2; AVX-512 (32 registers) 14 x 2 and 9 x 3 (panels of 32 and 48
// rows). A call takes the shape whose panels pad M the least (48 rows: one panel of 48, not two
// of 32), the first listed on a tie: the padded rows are multiplied like real ones.
// Threads split the weight rows (at::parallel_for, torch.set_num_threads is respected).
//
// SIMD: AVX-512 or AVX2+FMA, chosen by -march=native at build time (engine/cpu_kernels.py);
// elsewhere `panel_linear_simd_width()` is 0 and Python keeps torch.

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

constexpr int GRAIN = 4;     // tiles per parallel chunk
// Longest K block: a tile's NR weight rows x 768 floats (18 KB at NR = 6, 43 KB at 14) stay in
// L1 or L2 while the panels pass; 384 read the same on the AVX-512 machine (noise either way).
constexpr int64_t KC = 768;

// acc[r][v] += sum over k in [k0, k1) of w[r][k] * xt[k][v * W .. v * W + W) for one tile and
// one panel; acc (NR x MP floats) carries the sums between K blocks, so each output is still
// one chain over k in order. `next` (or nullptr): the next tile's weight rows, prefetched into L2.
template <int NR, int V>
void tile(const float* const* w, const float* xt, int64_t k0, int64_t k1, int64_t ldx, bool first, float* acc,
          const float* const* next) {
  constexpr int MP = V * W;
  vec a[NR][V];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) a[r][v] = first ? vzero() : vload(acc + r * MP + v * W);
  for (int64_t k = k0; k < k1; ++k) {
    if (next != nullptr && k % LINE == 0)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(next[r] + k), _MM_HINT_T1);
    vec x[V];
    for (int v = 0; v < V; ++v) x[v] = vload(xt + k * ldx + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const vec b = vbcast(w[r] + k);
      for (int v = 0; v < V; ++v) a[r][v] = vfma(b, x[v], a[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) vstore(acc + r * MP + v * W, a[r][v]);
}

template <int NR, int V>
void run(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  static_assert(NR * V + V + 1 <= REGS, "the register tile must fit the vector registers");
  constexpr int MP = V * W;  // input rows per panel
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
      const float* next_rows[NR];  // the next tile of this thread's chunk (rows past N clamped)
      for (int r = 0; r < NR; ++r) next_rows[r] = w + std::min<int64_t>(n0 + NR + r, N - 1) * K;
      const float* const* next = t + 1 < t1 ? next_rows : nullptr;
      // K in equal blocks of at most KC, so the tile's weight rows stay in L1 while every
      // input panel passes over them (at K = 1536 they would not).
      const int64_t nkb = std::max<int64_t>(1, (K + KC - 1) / KC), kc = std::max<int64_t>(1, (K + nkb - 1) / nkb);
      for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kc) {  // K = 0: one pass, zeros
        const int64_t k1 = std::min(K, k0 + kc);
        for (int64_t p = 0; p < panels; ++p)
          tile<NR, V>(w_rows, xt.data() + p * MP, k0, k1, ldx, k0 == 0, acc.data() + p * NR * MP,
                      p == 0 ? next : nullptr);
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

// Rows M padded to whole panels of V vectors.
constexpr int64_t padded(int64_t M, int V) { return (M + V * W - 1) / (V * W) * (V * W); }

void dispatch(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
#if defined(__AVX512F__)
  if (padded(M, 3) < padded(M, 2)) return run<9, 3>(x, w, y, M, K, N);
  return run<14, 2>(x, w, y, M, K, N);
#else
  return run<6, 2>(x, w, y, M, K, N);
#endif
}
#endif

}  // namespace

void panel_linear(at::Tensor out, at::Tensor x, at::Tensor weight) {
  [[maybe_unused]] const auto [M, K, N] = check_linear_args("panel_linear", out, x, weight);
#ifdef PDSERVE_SIMD
  if (M > 0 && N > 0) dispatch(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), M, K, N);
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
