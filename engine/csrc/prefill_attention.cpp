// Causal prefill attention for CPU, float32, over the paged KV cache: one prompt segment's
// queries attend to that request's keys read through its block table. The segment is the last
// q_len of ctx_len tokens (a whole prompt: q_len == ctx_len; a later chunk of it: the tokens
// before it are already in the cache), so query t sits at position ctx_len - q_len + t and
// attends to keys 0 .. that position.
//
// Why not SDPA's CPU flash kernel: on short prompts it runs its blocks as MKL calls too small to
// reach the GEMM rate (66 GFLOP/s at 512 tokens against ~185 for the model's GEMMs on a Zen 4 at
// 2 threads), a chunk after earlier tokens takes its masked path (~3x slower again), and both
// need the context's K/V gathered out of the pages first.
//
// Flash-style, in two passes:
//   1. the context's keys are transposed once, per KV head, into chunks of KB keys x head_dim
//      (kt[kv_head][chunk][d][KB], zero past ctx_len);
//   2. work item = one KV head x a block of query tokens; its rows are the query heads sharing
//      that KV head x those tokens (~ROWS rows), so each K/V chunk is read once for all of them.
//      Per chunk up to the item's last position: scores = q . kt[chunk] by a register-tiled
//      outer product (NR rows x SV key vectors), an online softmax per row (running max and sum,
//      the output rescaled once per chunk; keys past a row's position weigh 0), then
//      out += weights . V with the chunk's value rows read in place from their pages.
// Items run on torch's OpenMP pool through at::parallel_for (torch.set_num_threads is
// respected); threads pull them costliest-first from an atomic counter, because a causal item's
// cost grows with its position.
//
// SIMD only (AVX-512 or AVX2+FMA by -march=native, engine/cpu_kernels.py) and head_dim a
// multiple of the vector width: elsewhere `prefill_attention_supports` says no and Python keeps
// SDPA. Bound to Python in module.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "exp_neg.h"
#include "simd.h"

namespace {

#ifdef PDSERVE_SIMD
using namespace pdserve_simd;

constexpr int64_t KB = 64;    // keys per chunk: a multiple of every vector width
constexpr int64_t ROWS = 96;  // query rows (heads sharing a KV head x tokens) per work item
constexpr int NR = 6;         // rows per register tile
// Vectors per register tile row, for the scores (keys) and the output (head_dim): NR x V
// accumulators + V loads + 1 broadcast fit the registers (AVX-512 6 x 4, AVX2 6 x 2).
constexpr int VMAX = (REGS - 1) / (NR + 1);
constexpr int SV = VMAX;
static_assert(KB % (SV * W) == 0, "a key chunk is whole score tiles");

struct Segment {
  const float* q;  // q of head h, token t at q + h * q_sh + t * q_st
  int64_t q_sh, q_st;
  float* out;  // out of token t, head h at out + t * o_st + h * o_sh
  int64_t o_st, o_sh;
  const float* k;
  const float* v;
  const int64_t* blocks;  // block ids covering ctx_len tokens
  int64_t q_len, ctx_len, block_size, kv_heads, groups, head_dim;
  float scale;
  int64_t chunks;  // ceil(ctx_len / KB)

  int64_t first_pos() const { return ctx_len - q_len; }  // position of query token 0
  const float* row(const float* cache, int64_t key, int64_t kh) const {
    return cache + ((blocks[key / block_size] * block_size + key % block_size) * kv_heads + kh) * head_dim;
  }
};

struct Item {
  int64_t kh, t0, t1;  // KV head, query tokens [t0, t1)
};

// One item's scratch, rows padded to whole register tiles.
struct Scratch {
  std::vector<float> qs, acc, sc, mx, sum, alpha;
  std::vector<const float*> vrows;
  Scratch(int64_t rows, int64_t hd)
      : qs(rows * hd), acc(rows * hd), sc(rows * KB), mx(rows), sum(rows), alpha(rows), vrows(KB) {}
};

// Pass 1: kt[kh][c][d][j] = key c * KB + j of KV head kh, component d (0 past ctx_len).
void transpose_keys(const Segment& s, float* kt) {
  const int64_t hd = s.head_dim;
  at::parallel_for(0, s.kv_heads * s.chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kh = i / s.chunks, c = i % s.chunks;
      float* dst = kt + i * hd * KB;
      for (int64_t j = 0; j < KB; ++j) {
        const int64_t key = c * KB + j;
        if (key < s.ctx_len) {
          const float* src = s.row(s.k, key, kh);
          for (int64_t d = 0; d < hd; ++d) dst[d * KB + j] = src[d];
        } else {
          for (int64_t d = 0; d < hd; ++d) dst[d * KB + j] = 0.0f;
        }
      }
    }
  });
}

// sc[r][0 .. SV * W) = sum over d of qs[r][d] * kt[d][0 .. SV * W), for NR rows.
void score_tile(const float* qs, const float* kt, int64_t hd, float* sc) {
  vec a[NR][SV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < SV; ++v) a[r][v] = vzero();
  for (int64_t d = 0; d < hd; ++d) {
    vec x[SV];
    for (int v = 0; v < SV; ++v) x[v] = vload(kt + d * KB + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const vec b = vbcast(qs + r * hd + d);
      for (int v = 0; v < SV; ++v) a[r][v] = vfma(b, x[v], a[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < SV; ++v) vstore(sc + r * KB + v * W, a[r][v]);
}

// acc[r][d0 ..) = acc[r][d0 ..) * alpha[r] + sum over j < nk of p[r][j] * vrows[j][d0 ..), for
// NR rows and V vectors of head_dim from d0.
template <int V>
void value_tile(const float* p, const float* const* vrows, int64_t nk, const float* alpha, int64_t d0,
                int64_t hd, float* acc) {
  static_assert(V <= VMAX, "the register tile must fit the vector registers");
  vec o[NR][V];
  for (int r = 0; r < NR; ++r) {
    const vec a = vset1(alpha[r]);
    for (int v = 0; v < V; ++v) o[r][v] = vmul(vload(acc + r * hd + d0 + v * W), a);
  }
  for (int64_t j = 0; j < nk; ++j) {
    vec x[V];
    for (int v = 0; v < V; ++v) x[v] = vload(vrows[j] + d0 + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const vec b = vbcast(p + r * KB + j);
      for (int v = 0; v < V; ++v) o[r][v] = vfma(b, x[v], o[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) vstore(acc + r * hd + d0 + v * W, o[r][v]);
}

// One row's scores of a chunk -> its weights: keys [0, n) count (n may be 0: the chunk is past the
// row's position), the rest weigh 0. Updates the row's running max and sum; alpha rescales its
// output for the new max.
void softmax_row(float* sc, int64_t n, float& mx, float& sum, float& alpha) {
  if (n == 0) {
    std::fill(sc, sc + KB, 0.0f);
    alpha = 1.0f;
    return;
  }
  float m = mx;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = std::max(m, sc[j]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = exp_neg(sc[j] - m);
    total += sc[j];
  }
  std::fill(sc + n, sc + KB, 0.0f);
  alpha = exp_neg(mx - m);  // the first chunk: mx = -inf, and acc and sum are 0 whatever alpha is
  sum = sum * alpha + total;
  mx = m;
}

template <int V>
void attend(const Segment& s, const float* kt, const Item& it, Scratch& buf) {
  const int64_t G = s.groups, hd = s.head_dim;
  const int64_t rows = (it.t1 - it.t0) * G, padded = (rows + NR - 1) / NR * NR;
  float *qs = buf.qs.data(), *acc = buf.acc.data(), *sc = buf.sc.data();
  // Row r: token it.t0 + r / G, query head it.kh * G + r % G (the heads of a token adjacent).
  for (int64_t r = 0; r < padded; ++r) {
    const float* src = s.q + (it.kh * G + r % G) * s.q_sh + (it.t0 + r / G) * s.q_st;
    for (int64_t d = 0; d < hd; ++d) {
      qs[r * hd + d] = r < rows ? src[d] * s.scale : 0.0f;
      acc[r * hd + d] = 0.0f;
    }
    buf.mx[r] = -std::numeric_limits<float>::infinity();
    buf.sum[r] = 0.0f;
  }
  const int64_t first = s.first_pos() + it.t0;  // position of the item's first token
  const int64_t last = s.first_pos() + it.t1 - 1;
  for (int64_t c = 0; c * KB <= last; ++c) {
    const float* ktc = kt + (it.kh * s.chunks + c) * hd * KB;
    for (int64_t r0 = 0; r0 < padded; r0 += NR)
      for (int64_t j0 = 0; j0 < KB; j0 += SV * W) score_tile(qs + r0 * hd, ktc + j0, hd, sc + r0 * KB + j0);
    int64_t nk = 0;  // keys of this chunk any row attends to
    for (int64_t r = 0; r < padded; ++r) {
      const int64_t n = r < rows ? std::clamp<int64_t>(first + r / G - c * KB + 1, 0, KB) : 0;
      nk = std::max(nk, n);
      softmax_row(sc + r * KB, n, buf.mx[r], buf.sum[r], buf.alpha[r]);
    }
    for (int64_t j = 0; j < nk; ++j) buf.vrows[j] = s.row(s.v, c * KB + j, it.kh);
    for (int64_t r0 = 0; r0 < padded; r0 += NR)
      for (int64_t d0 = 0; d0 < hd; d0 += V * W)
        value_tile<V>(sc + r0 * KB, buf.vrows.data(), nk, buf.alpha.data() + r0, d0, hd, acc + r0 * hd);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = s.out + (it.t0 + r / G) * s.o_st + (it.kh * G + r % G) * s.o_sh;
    const float inv = 1.0f / buf.sum[r];
    for (int64_t d = 0; d < hd; ++d) dst[d] = acc[r * hd + d] * inv;
  }
}

// Pass 2: the items, costliest first, pulled from a shared counter by torch's threads.
template <int V>
void run(const Segment& s, const float* kt) {
  const int64_t tokens = std::max<int64_t>(1, ROWS / s.groups);  // query tokens per item
  std::vector<Item> items;
  for (int64_t kh = 0; kh < s.kv_heads; ++kh)
    for (int64_t t0 = 0; t0 < s.q_len; t0 += tokens) items.push_back({kh, t0, std::min(s.q_len, t0 + tokens)});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.t1 > b.t1; });
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t max_rows = (tokens * s.groups + NR - 1) / NR * NR;
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Scratch buf(max_rows, s.head_dim);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) attend<V>(s, kt, items[i], buf);
  };
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), n);
  if (workers <= 1) return worker();
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) worker();
  });
}

// Vectors of head_dim per output tile: the most that fit and divide head_dim (0: unsupported).
int value_vectors(int64_t head_dim) {
  for (int v = VMAX; v >= 1; v /= 2)
    if (head_dim % (v * W) == 0) return v;
  return 0;
}
#endif

}  // namespace

bool prefill_attention_supports(int64_t head_dim) {
#ifdef PDSERVE_SIMD
  return head_dim > 0 && value_vectors(head_dim) > 0;
#else
  return false;
#endif
}

// out[t, heads, d] = softmax(scale * q k^T) v over keys 0 .. ctx_len - q_len + t, for the
// segment's query tokens t < q_len; q [heads, q_len, d] (any strides, unit-stride d).
void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                             at::Tensor block_ids, int64_t ctx_len, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  out.device().is_cpu() && block_ids.device().is_cpu(),
              "paged_prefill_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged_prefill_attention: float32 only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "paged_prefill_attention: caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.size(0) == q.size(1) && out.size(1) == q.size(0) &&
                  out.size(2) == q.size(2),
              "paged_prefill_attention: q must be [heads, q_len, head_dim] and out [q_len, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_prefill_attention: head_dim must be the unit-stride axis");
  const int64_t heads = q.size(0), q_len = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "paged_prefill_attention: head_dim of q and cache differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_prefill_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(q_len <= ctx_len, "paged_prefill_attention: ", q_len, " queries but a context of ", ctx_len);
  TORCH_CHECK(prefill_attention_supports(head_dim), "paged_prefill_attention: head_dim ", head_dim,
              " is not a multiple of the SIMD width (or the build has no SIMD)");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong && block_ids.is_contiguous(),
              "paged_prefill_attention: block_ids must be a contiguous int64 vector");
  const int64_t needed = (ctx_len + block_size - 1) / block_size;
  TORCH_CHECK(block_ids.size(0) >= needed, "paged_prefill_attention: a context of ", ctx_len, " needs ", needed,
              " blocks, got ", block_ids.size(0));
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < needed; ++j)
    TORCH_CHECK(blocks[j] >= 0 && blocks[j] < num_blocks, "paged_prefill_attention: block id ", blocks[j],
                " out of range");
  if (q_len == 0) return;
#ifdef PDSERVE_SIMD
  const Segment s{q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(), out.stride(0),
                  out.stride(1), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), blocks,
                  q_len, ctx_len, block_size, kv_heads, heads / kv_heads, head_dim, static_cast<float>(scale),
                  (ctx_len + KB - 1) / KB};
  std::vector<float> kt(static_cast<size_t>(kv_heads * s.chunks * head_dim * KB));
  transpose_keys(s, kt.data());
  const int vectors = value_vectors(head_dim);
  if constexpr (VMAX >= 4)
    if (vectors == 4) return run<4>(s, kt.data());
  if (vectors == 2) return run<2>(s, kt.data());
  run<1>(s, kt.data());
#endif
}
