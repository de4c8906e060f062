// Python bindings of pdserve's CPU kernels (one extension, built by engine/cpu_kernels.py).
// Every entry releases the GIL, like torch's own ops: other Python threads (gRPC, Ray,
// asyncio) run while a kernel computes.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale, bool portable);
int paged_attention_simd_width();
void skinny_linear(at::Tensor out, at::Tensor x, at::Tensor weight);
int skinny_linear_simd_width();
void panel_linear(at::Tensor out, at::Tensor x, at::Tensor weight);
int panel_linear_simd_width();
void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                             at::Tensor block_ids, int64_t ctx_len, double scale);
bool prefill_attention_supports(int64_t head_dim);
void rope_write_kv(at::Tensor q_out, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                   at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
bool rope_kv_supports(int64_t head_dim);
void greedy_argmax(at::Tensor out, at::Tensor logits);
at::Tensor decode_layers(at::Tensor hidden, std::vector<at::Tensor> norms, std::vector<double> eps,
                         std::vector<at::Tensor> qkv, std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up,
                         std::vector<at::Tensor> down, std::vector<std::optional<at::Tensor>> qkv_bias,
                         std::vector<std::optional<at::Tensor>> o_bias, std::vector<std::optional<at::Tensor>> gate_up_bias,
                         std::vector<std::optional<at::Tensor>> down_bias, at::Tensor kv_cache, std::vector<double> scales, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                         at::Tensor block_tables, at::Tensor context_lens, int64_t kernel);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention (float32, CPU): out[n, heads, d] from q[n, heads, d] and paged K/V; "
        "portable=True skips the SIMD path (tests)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("portable") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal prefill attention (float32, CPU): out[t, heads, d] for q[heads, q_len, d], the last q_len "
        "of ctx_len tokens, over paged K/V",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_ids"),
        py::arg("ctx_len"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_supports", &prefill_attention_supports,
        "Whether this build's prefill kernel takes this head_dim (a multiple of the SIMD width)");
  m.def("rope_write_kv", &rope_write_kv,
        "Rotary embedding of q [T, heads, d] into q_out and of k, k and v written to the paged caches at "
        "slots (float32, CPU; bit-identical to Hugging Face's apply_rotary_pos_emb)",
        py::arg("q_out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_kv_supports", &rope_kv_supports,
        "Whether this build's rope_write_kv takes this head_dim (a multiple of twice the SIMD width)");
  m.def("skinny_linear", &skinny_linear,
        "out[M, N] = x[M, K] . weight[N, K]^T (float32, CPU, contiguous), for small M",
        py::arg("out"), py::arg("x"), py::arg("weight"), py::call_guard<py::gil_scoped_release>());
  m.def("panel_linear", &panel_linear,
        "out[M, N] = x[M, K] . weight[N, K]^T (float32, CPU, contiguous), for a decode batch of a few dozen rows",
        py::arg("out"), py::arg("x"), py::arg("weight"), py::call_guard<py::gil_scoped_release>());
  m.def("greedy_argmax", &greedy_argmax,
        "out[:B] = the first index of each row's max, out[B] = whether every logit is finite (float32 "
        "logits [B, V], unit-stride V, CPU; out int64 [B + 1])",
        py::arg("out"), py::arg("logits"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_layers", &decode_layers,
        "A decode-only step's decoder layers (Llama family, float32, CPU): the residual stream "
        "[T, H] after the last layer (engine/lean_cpu.py)",
        py::arg("hidden"), py::arg("norms"), py::arg("eps"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
        py::arg("down"), py::arg("qkv_bias"), py::arg("o_bias"), py::arg("gate_up_bias"), py::arg("down_bias"),
        py::arg("kv_cache"), py::arg("scales"), py::arg("heads"), py::arg("kv_heads"),
        py::arg("head_dim"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("kernel"), py::call_guard<py::gil_scoped_release>());
  m.attr("simd_width") = paged_attention_simd_width();
  m.attr("skinny_linear_simd_width") = skinny_linear_simd_width();
  m.attr("panel_linear_simd_width") = panel_linear_simd_width();
}
