// The argument rule of the decode-linear kernels (skinny_linear.cpp, panel_linear.cpp), written
// once: out[M, N] = x[M, K] @ weight[N, K]^T, float32, contiguous, on the CPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

struct LinearShape {
  int64_t M, K, N;
};

// Checks the tensors of `name`'s call (a clear error naming the kernel) and returns the shape.
inline LinearShape check_linear_args(const char* name, const at::Tensor& out, const at::Tensor& x,
                                     const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              name, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2, name, ": x [M, K], weight [N, K], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), name, ": contiguous tensors only");
  const LinearShape s{x.size(0), x.size(1), weight.size(0)};
  TORCH_CHECK(weight.size(1) == s.K && out.size(0) == s.M && out.size(1) == s.N, name, ": shapes do not match");
  return s;
}
