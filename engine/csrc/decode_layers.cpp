// A decode-only step's decoder layers (Llama family, float32, CPU) in one call from
// Python: the lean forward's straight-line layers (engine/lean_cpu.py) with no Python between ops.
//
// Why: at batch 1 the Python around a SmolLM2 decode step's ~15 calls a layer costs a few ms of a
// ~36 ms step; here the same calls run from C++ (ATen's dispatcher directly, pdserve's kernels as
// plain functions) and the GIL is released for the whole stack, so a worker's event loop runs
// beside it instead of taking turns with it.
//
// The same ops on the same values in the same order as lean_cpu.CpuLayers' Python loop, so the
// same bits: at::rms_norm (what F.rms_norm calls), the linear kernel Python chose for the step's
// row count (0 torch's linear, 1 skinny, 2 panel: skinny_linear.kernel_for; torch's linear with its
// bias for a projection that has one, e.g. Qwen2's q/k/v, as skinny_linear.linear takes it), the fused rotary + KV
// write, the paged decode attention (the decode-only group: queries in step order), at::silu then
// at::mul, at::add for the residuals.
//
// Layout: hidden [T, H] contiguous; per layer l: norms[2l], norms[2l + 1] (input, post-attention)
// with eps[2l], eps[2l + 1]; qkv[l] [(heads + 2 kv_heads) d, H]; o[l] [H, heads d]; gate_up[l]
// [2 I, H]; down[l] [H, I], each with its bias or None (qkv_bias[l], ...); scales[l]; kv_cache [layers, 2, blocks, block_size, kv_heads, d] (layer l's
// K and V at [l][0], [l][1]); cos, sin [T, d]; slots [T]; the decode group's block_tables [T, max_blocks]
// and context_lens [T]. Bound to Python in module.cpp.
//
// The kernels are plain functions the profiler cannot see; each call is a RECORD_FUNCTION range
// (named as benchmarks/profile_decode.py reads them; a no-op unless a profiler is on).

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <optional>
#include <vector>

void skinny_linear(at::Tensor out, at::Tensor x, at::Tensor weight);
void panel_linear(at::Tensor out, at::Tensor x, at::Tensor weight);
void rope_write_kv(at::Tensor q_out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                   at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale, bool portable);

namespace {

constexpr int64_t TORCH_LINEAR = 0, SKINNY = 1, PANEL = 2;

using Bias = std::optional<at::Tensor>;

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const Bias& bias, int64_t kernel) {
  if (kernel == TORCH_LINEAR || bias.has_value()) return at::linear(x, weight, bias);
  RECORD_FUNCTION(kernel == SKINNY ? "pdserve::skinny_linear" : "pdserve::panel_linear", c10::ArrayRef<const c10::IValue>{});
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (kernel == SKINNY)
    skinny_linear(out, x, weight);
  else
    panel_linear(out, x, weight);
  return out;
}

}  // namespace

at::Tensor decode_layers(at::Tensor hidden, std::vector<at::Tensor> norms, std::vector<double> eps,
                         std::vector<at::Tensor> qkv, std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up,
                         std::vector<at::Tensor> down, std::vector<Bias> qkv_bias, std::vector<Bias> o_bias,
                         std::vector<Bias> gate_up_bias, std::vector<Bias> down_bias, at::Tensor kv_cache, std::vector<double> scales, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                         at::Tensor block_tables, at::Tensor context_lens, int64_t kernel) {
  const size_t L = qkv.size();
  TORCH_CHECK(norms.size() == 2 * L && eps.size() == 2 * L && o.size() == L && gate_up.size() == L &&
                  down.size() == L && scales.size() == L && qkv_bias.size() == L && o_bias.size() == L &&
                  gate_up_bias.size() == L && down_bias.size() == L && kv_cache.dim() == 6 && kv_cache.size(0) >= int64_t(L),
              "decode_layers: per-layer lists must have one entry per layer (norms and eps two)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.scalar_type() == at::kFloat,
              "decode_layers: hidden must be a contiguous float32 [T, H]");
  TORCH_CHECK(kernel >= TORCH_LINEAR && kernel <= PANEL, "decode_layers: kernel must be 0, 1 or 2");
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  for (size_t l = 0; l < L; ++l) {
    at::Tensor x = at::rms_norm(hidden, {H}, norms[2 * l], eps[2 * l]);
    at::Tensor projected = linear(x, qkv[l], qkv_bias[l], kernel);
    TORCH_CHECK(projected.size(1) == q_width + 2 * kv_width, "decode_layers: q/k/v weight of layer ", l,
                " does not match the heads");
    at::Tensor q = projected.narrow(1, 0, q_width).view({T, heads, head_dim});
    at::Tensor k = projected.narrow(1, q_width, kv_width).view({T, kv_heads, head_dim});
    at::Tensor v = projected.narrow(1, q_width + kv_width, kv_width).view({T, kv_heads, head_dim});
    const at::Tensor k_cache = kv_cache.select(0, l).select(0, 0), v_cache = kv_cache.select(0, l).select(0, 1);
    at::Tensor rotated = at::empty({T, heads, head_dim}, hidden.options());
    at::Tensor attended = at::empty({T, heads, head_dim}, hidden.options());
    {
      RECORD_FUNCTION("pdserve::paged_attention", c10::ArrayRef<const c10::IValue>{});
      rope_write_kv(rotated, q, k, v, cos, sin, k_cache, v_cache, slots);
      paged_decode_attention(attended, rotated, k_cache, v_cache, block_tables, context_lens, scales[l], false);
    }
    hidden = at::add(hidden, linear(attended.view({T, q_width}), o[l], o_bias[l], kernel));
    x = at::rms_norm(hidden, {H}, norms[2 * l + 1], eps[2 * l + 1]);
    at::Tensor gu = linear(x, gate_up[l], gate_up_bias[l], kernel);
    const int64_t inter = gu.size(1) / 2;
    at::Tensor act = at::mul(at::silu(gu.narrow(1, 0, inter)), gu.narrow(1, inter, inter));
    hidden = at::add(hidden, linear(act, down[l], down_bias[l], kernel));
  }
  return hidden;
}
