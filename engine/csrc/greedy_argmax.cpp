// Greedy sampling's argmax over each row of a step's logits, and whether every logit is finite, in
// one call (CPU, float32).
//
// Why: torch's CPU argmax carries an index through a scalar-ordered reduction and runs at ~1 float
// per nanosecond: 43 us per 49,152-token row, 2.6 ms for a decode step at batch 64, while a plain
// max over the same row takes 3.5 us. Here each row is read twice at SIMD width: its max (and a
// running sum of x * 0, NaN exactly when some x is NaN or +-inf), then the first position holding
// that max (the scan stops there). Same answer as torch.argmax on finite rows: the first index of
// the largest value (-0.0 and +0.0 compare equal in both). A row with a non-finite logit clears
// the flag; its index is then meaningless and the caller takes its careful path for the batch.
//
// Layout: logits [B, V] with unit stride along V (any row stride); out int64 [B + 1]: B indices,
// then 1 when every logit is finite, else 0. Rows are split over torch's threads. Bound to Python
// in module.cpp; engine/greedy_argmax.py keeps torch.argmax where this is unavailable.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t GRAIN = 4;  // rows per parallel chunk (~4 us each at a 49k vocabulary)

struct RowScan {
  float max;
  bool finite;
};

// The row's max over its finite values and whether all of them are finite.
static RowScan scan(const float* x, int64_t n) {
  int64_t j = 0;
  float m = -INFINITY, poison = 0.0f;
#ifdef PDSERVE_SIMD
  using namespace pdserve_simd;
  if (n >= W) {
    vec vm = vload(x), vp = vzero();
    const vec zero = vzero();
    for (; j + W <= n; j += W) {
      const vec v = vload(x + j);
      vm = vmax(vm, v);
      vp = vadd(vp, vmul(v, zero));
    }
    m = hmax(vm);
    poison = hsum(vp);
  }
#endif
  for (; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    poison += x[j] * 0.0f;
  }
  return {m, !std::isnan(poison)};
}

// The first index j with x[j] == m (m is in the row).
static int64_t first_equal(const float* x, int64_t n, float m) {
  int64_t j = 0;
#ifdef PDSERVE_SIMD
  using namespace pdserve_simd;
  const vec vm = vset1(m);
  for (; j + W <= n; j += W) {
    const uint32_t hits = eq_mask(vload(x + j), vm);
    if (hits) return j + __builtin_ctz(hits);
  }
#endif
  for (; j < n; ++j)
    if (x[j] == m) return j;
  return 0;   // unreachable for a row whose max came from scan(); a non-finite row's answer is unused
}

}  // namespace

void greedy_argmax(at::Tensor out, at::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2,
              "greedy_argmax: logits must be a float32 CPU tensor [B, V]");
  TORCH_CHECK(logits.size(1) > 0 && logits.stride(1) == 1, "greedy_argmax: V must be non-empty and unit-stride");
  const int64_t B = logits.size(0), V = logits.size(1), row_stride = logits.stride(0);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == B + 1 &&
                  out.is_contiguous(),
              "greedy_argmax: out must be a contiguous int64 CPU tensor [B + 1]");
  const float* base = logits.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  // One flag per row, folded after the parallel loop (no shared write inside it).
  std::vector<uint8_t> finite(static_cast<size_t>(B), 1);
  at::parallel_for(0, B, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = base + b * row_stride;
      const RowScan s = scan(row, V);
      finite[b] = s.finite;
      index[b] = s.finite ? first_equal(row, V, s.max) : 0;
    }
  });
  int64_t all_finite = 1;
  for (int64_t b = 0; b < B; ++b) all_finite &= finite[b];
  index[B] = all_finite;
}
