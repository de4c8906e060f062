// exp(x) for x <= 0 in plain float arithmetic, shared by the attention kernels
// (paged_attention.cpp, prefill_attention.cpp): their softmax weights are exp(score - running max).
// engine/cpu_kernels.py hashes this header with the sources, so editing it rebuilds the extension.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) for x <= 0, written with plain arithmetic so `omp simd` loops vectorize it
// (glibc's expf only vectorizes under -ffast-math). Cody-Waite range reduction and a degree-6
// polynomial on [-ln2/2, ln2/2]: relative error ~1e-7, below float32 rounding of the sums.
static inline float exp_neg(float x) {
  x = std::max(x, -87.0f);  // exp(-87) ~ 1.6e-38: still a normal float, so 2^n below is exact
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693145751953125f, x);      // ln2 split: hi part exact in float
  r = std::fma(n, -1.428606765330187045e-06f, r);     // lo part
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, sizeof(two_n));
  return p * two_n;
}
