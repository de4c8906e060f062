// Paged decode attention for CPU, float32: each request's single query token attends to its
// own keys/values read in place through its block table, once (no gathered copy).
//
// Cache layout (one layer): k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim],
// contiguous. Token t of block b, KV head h starts at ((b * block_size + t) * kv_heads + h) * head_dim.
//
// Work item = one request (or, with few requests per thread, one of its KV heads): per block,
// the `groups` query heads sharing each KV head are scored against the block's key rows, an
// online softmax (running max / running sum, rescaled once per block) turns the scores into
// weights, and the weighted value rows are accumulated. Each K/V row is fetched from memory
// once; the next block is prefetched while the current one is computed.
// Items run on torch's OpenMP pool through at::parallel_for (so torch.set_num_threads is
// respected, on any calling thread); threads pull items longest-context-first from an atomic
// counter, because decode groups arrive sorted by context length and a static split would
// hand one thread all the long ones.

// Light headers on purpose (not torch/extension.h): the first build takes ~15 s instead of ~60 s.
// Bound to Python in module.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "exp_neg.h"
#include "simd.h"

#ifndef PDSERVE_PREFETCH_LOCALITY
#define PDSERVE_PREFETCH_LOCALITY 2  // into L2: a block's K and V plus the next block's would crowd L1
#endif

namespace {

struct Params {
  const float* q;       // q[i, head, :] at q + i * q_s0 + head * q_s1
  int64_t q_s0, q_s1;
  float* out;           // out[i, head, :] at out + i * o_s0 + head * o_s1
  int64_t o_s0, o_s1;
  const float* k;
  const float* v;
  const int64_t* tables;  // tables[i * table_stride + j]: j-th block of request i
  int64_t table_stride;
  const int64_t* ctx;     // context length of request i (keys to attend, >= 1)
  int64_t block_size, kv_heads, groups, head_dim;
  float scale;
};

// One work item's scratch (H query heads of head_dim hd, blocks of bs tokens), carved from the
// buffer `run` gives each thread.
struct Scratch {
  float* qs;     // [H, hd] scaled queries (local head hh * groups + g)
  float* acc;    // [H, hd] unnormalized output
  float* sc;     // [H, bs] scores, then weights, of the current block
  float* mx;     // [H] running max
  float* sum;    // [H] running sum of exp(score - max)
  float* alpha;  // [H] rescale of acc for the current block
  Scratch(float* s, int64_t H, int64_t hd, int64_t bs)
      : qs(s), acc(qs + H * hd), sc(acc + H * hd), mx(sc + H * bs), sum(mx + H), alpha(sum + H) {}
  static int64_t floats(int64_t H, int64_t hd, int64_t bs) { return 2 * H * hd + H * bs + 3 * H; }
};

// Block j of request i: where KV heads [h0, ..) of its first token start in the K (and V) cache.
static inline int64_t block_offset(const Params& p, int64_t i, int64_t j, int64_t h0, int64_t hd) {
  return (p.tables[i * p.table_stride + j] * p.block_size * p.kv_heads + h0) * hd;
}

// Tokens of request i held in its block j (the last block may be partly filled).
static inline int64_t block_tokens(const Params& p, int64_t i, int64_t j) {
  return std::min(p.block_size, p.ctx[i] - j * p.block_size);
}

// One work item: request i, KV heads [h0, h1). Their rows of one token are adjacent in the
// cache (row = (h1 - h0) * head_dim floats), so a block is read as block_size contiguous runs,
// K then V. This is the portable version (no AVX2, or a head_dim that is not 1-16 vectors),
// plain loops for the compiler to vectorize; attend_simd below is the fast one.
// D > 0: head_dim known at compile time (the common sizes); D == 0: runtime head_dim.
template <int D>
void attend_generic(const Params& p, int64_t i, int64_t h0, int64_t h1, float* scratch) {
  const int64_t hd = D > 0 ? D : p.head_dim;
  const int64_t G = p.groups, bs = p.block_size;
  const int64_t nh = h1 - h0, H = nh * G;      // KV heads, query heads of this item
  const int64_t tok_stride = p.kv_heads * hd;  // floats between consecutive tokens' rows
  const Scratch buf(scratch, H, hd, bs);
  float *qs = buf.qs, *acc = buf.acc, *sc = buf.sc, *mx = buf.mx, *sum = buf.sum;

  for (int64_t qh = 0; qh < H; ++qh) {
    const float* src = p.q + i * p.q_s0 + (h0 * G + qh) * p.q_s1;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) {
      qs[qh * hd + d] = src[d] * p.scale;
      acc[qh * hd + d] = 0.0f;
    }
    mx[qh] = -std::numeric_limits<float>::infinity();
    sum[qh] = 0.0f;
  }

  const int64_t num_blocks = (p.ctx[i] + bs - 1) / bs;
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t nt = block_tokens(p, i, j);
    const int64_t base = block_offset(p, i, j, h0, hd);
    const float* kb = p.k + base;
    const float* vb = p.v + base;

    for (int64_t t = 0; t < nt; ++t) {
      const float* kr = kb + t * tok_stride;
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float* krh = kr + hh * hd;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t qh = hh * G + g;
          const float* qg = qs + qh * hd;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < hd; ++d) s += qg[d] * krh[d];
          sc[qh * bs + t] = s;
        }
      }
    }

    for (int64_t qh = 0; qh < H; ++qh) {
      float* sg = sc + qh * bs;
      float bmax = sg[0];
      for (int64_t t = 1; t < nt; ++t) bmax = std::max(bmax, sg[t]);
      if (bmax > mx[qh]) {
        // First block: mx = -inf, sum = acc = 0, so skipping the rescale is exact.
        if (j > 0) {
          const float alpha = exp_neg(mx[qh] - bmax);
          sum[qh] *= alpha;
          float* a = acc + qh * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) a[d] *= alpha;
        }
        mx[qh] = bmax;
      }
      const float m = mx[qh];
      float bsum = 0.0f;
#pragma omp simd reduction(+ : bsum)
      for (int64_t t = 0; t < nt; ++t) {
        const float w = exp_neg(sg[t] - m);
        sg[t] = w;
        bsum += w;
      }
      sum[qh] += bsum;
    }

    for (int64_t t = 0; t < nt; ++t) {
      const float* vr = vb + t * tok_stride;
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float* vrh = vr + hh * hd;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t qh = hh * G + g;
          const float w = sc[qh * bs + t];
          float* a = acc + qh * hd;
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) a[d] += w * vrh[d];
        }
      }
    }
  }

  for (int64_t qh = 0; qh < H; ++qh) {
    float* dst = p.out + i * p.o_s0 + (h0 * G + qh) * p.o_s1;
    const float inv = 1.0f / sum[qh];
    const float* a = acc + qh * hd;
#pragma omp simd
    for (int64_t d = 0; d < hd; ++d) dst[d] = a[d] * inv;
  }
}

#ifdef PDSERVE_SIMD
// Explicit SIMD (AVX-512 where the build machine has it, else AVX2+FMA): the compiler's own
// vectorization of `s += q[d] * k[d]` ends in a serial lane-by-lane sum per score, and of
// `acc[d] += w * v[d]` reloads and stores the accumulator for every key.
using namespace pdserve_simd;

// Scores of one query (NV vectors, scaled) against 4 key rows, stored to s[0..3]: four
// independent FMA chains, then one combined horizontal reduction.
template <int NV>
static inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, float* s) {
  vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const vec qv = vload(q + v * W);
    a0 = vfma(qv, vload(k0 + v * W), a0);
    a1 = vfma(qv, vload(k1 + v * W), a1);
    a2 = vfma(qv, vload(k2 + v * W), a2);
    a3 = vfma(qv, vload(k3 + v * W), a3);
  }
  const __m128 r = _mm_hadd_ps(_mm_hadd_ps(to128(a0), to128(a1)), _mm_hadd_ps(to128(a2), to128(a3)));
  _mm_storeu_ps(s, r);
}

template <int NV>
static inline float dot1(const float* q, const float* k) {
  vec a = vzero();
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) a = vfma(vload(q + v * W), vload(k + v * W), a);
  return hsum(a);
}

// Walks the 64-byte lines of `nt` rows (`row` floats each, `stride` apart), prefetching a few
// per step; the first block of a request is left to the hardware prefetcher.
struct Prefetcher {
  const float* base;
  int64_t stride, row, nt;
  int64_t t = 0, off = 0;
  inline void step(int64_t lines) {
    for (; lines > 0 && t < nt; --lines) {
      __builtin_prefetch(base + t * stride + off, 0, PDSERVE_PREFETCH_LOCALITY);
      off += LINE;
      if (off >= row) {
        off = 0;
        ++t;
      }
    }
  }
};

// Same contract as attend_generic, head_dim = NV * W.
template <int NV>
void attend_simd(const Params& p, int64_t i, int64_t h0, int64_t h1, float* scratch) {
  constexpr int64_t hd = NV * W;
  const int64_t G = p.groups, bs = p.block_size;
  const int64_t nh = h1 - h0, H = nh * G;
  const int64_t tok_stride = p.kv_heads * hd;
  const int64_t row = nh * hd;
  const int64_t lines_per_row = (row + LINE - 1) / LINE;
  // Accumulator registers per chunk: 2 x 8 of AVX-512's 32, 2 x 4 of AVX2's 16.
  constexpr int CHMAX = W == 16 ? 8 : 4;
  constexpr int CH = NV < CHMAX ? NV : CHMAX;
  constexpr int NCH = NV / CH;       // accumulator chunks per query head
  const Scratch buf(scratch, H, hd, bs);
  float *qs = buf.qs, *acc = buf.acc, *sc = buf.sc, *mx = buf.mx, *sum = buf.sum, *alpha = buf.alpha;

  const vec scale = vset1(p.scale);
  for (int64_t qh = 0; qh < H; ++qh) {
    const float* src = p.q + i * p.q_s0 + (h0 * G + qh) * p.q_s1;
    for (int v = 0; v < NV; ++v) {
      vstore(qs + qh * hd + v * W, vmul(vload(src + v * W), scale));
      vstore(acc + qh * hd + v * W, vzero());
    }
    mx[qh] = -std::numeric_limits<float>::infinity();
    sum[qh] = 0.0f;
  }

  const int64_t num_blocks = (p.ctx[i] + bs - 1) / bs;
  for (int64_t j = 0; j < num_blocks; ++j) {
    const int64_t nt = block_tokens(p, i, j);
    const int64_t base = block_offset(p, i, j, h0, hd);
    const float* kb = p.k + base;
    const float* vb = p.v + base;
    // Blocks are scattered, so the hardware prefetcher restarts at each one and the loads of a
    // block would wait on memory between bursts of compute. Instead the next block's K rows
    // are requested while this block is scored and its V rows while this block is
    // accumulated, a few lines per step, so memory traffic overlaps the arithmetic.
    const bool more = j + 1 < num_blocks;
    const int64_t next_base = more ? block_offset(p, i, j + 1, h0, hd) : 0;
    const int64_t next_nt = more ? block_tokens(p, i, j + 1) : 0;
    const int64_t next_lines = next_nt * lines_per_row;
    Prefetcher pk{p.k + next_base, tok_stride, row, next_nt};
    Prefetcher pv{p.v + next_base, tok_stride, row, next_nt};
    const int64_t k_rate = (next_lines + H * ((nt + 3) / 4) - 1) / (H * ((nt + 3) / 4));
    const int64_t v_steps = H * ((nt + 1) / 2) * NCH;
    const int64_t v_rate = (next_lines + v_steps - 1) / v_steps;

    for (int64_t hh = 0; hh < nh; ++hh) {
      const float* kh = kb + hh * hd;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qh = hh * G + g;
        const float* qg = qs + qh * hd;
        float* s = sc + qh * bs;
        int64_t t = 0;
        for (; t + 4 <= nt; t += 4) {
          const float* k0 = kh + t * tok_stride;
          dot4<NV>(qg, k0, k0 + tok_stride, k0 + 2 * tok_stride, k0 + 3 * tok_stride, s + t);
          pk.step(k_rate);
        }
        for (; t < nt; ++t) {
          s[t] = dot1<NV>(qg, kh + t * tok_stride);
          pk.step(k_rate);
        }
      }
    }

    for (int64_t qh = 0; qh < H; ++qh) {
      float* sg = sc + qh * bs;
      float bmax = sg[0];
#pragma omp simd reduction(max : bmax)
      for (int64_t t = 1; t < nt; ++t) bmax = std::max(bmax, sg[t]);
      alpha[qh] = 1.0f;
      if (bmax > mx[qh]) {
        // First block: mx = -inf, sum = acc = 0, so skipping the rescale is exact.
        if (j > 0) alpha[qh] = exp_neg(mx[qh] - bmax);
        mx[qh] = bmax;
      }
      const float m = mx[qh];
      float bsum = 0.0f;
#pragma omp simd reduction(+ : bsum)
      for (int64_t t = 0; t < nt; ++t) {
        const float w = exp_neg(sg[t] - m);
        sg[t] = w;
        bsum += w;
      }
      sum[qh] = sum[qh] * alpha[qh] + bsum;
    }

    for (int64_t hh = 0; hh < nh; ++hh) {
      const float* vh = vb + hh * hd;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qh = hh * G + g;
        const float* w = sc + qh * bs;
        float* a = acc + qh * hd;
        // The accumulator lives in registers for the block (CH vectors at a time), in two
        // copies, even and odd keys, so consecutive FMAs do not wait on each other.
        for (int c = 0; c < NV; c += CH) {
          vec r0[CH], r1[CH];
          const vec al = vset1(alpha[qh]);
#pragma GCC unroll 8
          for (int v = 0; v < CH; ++v) {
            r0[v] = vmul(vload(a + (c + v) * W), al);
            r1[v] = vzero();
          }
          int64_t t = 0;
          for (; t + 2 <= nt; t += 2) {
            pv.step(v_rate);
            const vec w0 = vset1(w[t]), w1 = vset1(w[t + 1]);
            const float* vr = vh + t * tok_stride + c * W;
#pragma GCC unroll 8
            for (int v = 0; v < CH; ++v) {
              r0[v] = vfma(w0, vload(vr + v * W), r0[v]);
              r1[v] = vfma(w1, vload(vr + tok_stride + v * W), r1[v]);
            }
          }
          if (t < nt) {
            const vec w0 = vset1(w[t]);
            const float* vr = vh + t * tok_stride + c * W;
#pragma GCC unroll 8
            for (int v = 0; v < CH; ++v) r0[v] = vfma(w0, vload(vr + v * W), r0[v]);
          }
#pragma GCC unroll 8
          for (int v = 0; v < CH; ++v) vstore(a + (c + v) * W, vadd(r0[v], r1[v]));
        }
      }
    }
  }

  for (int64_t qh = 0; qh < H; ++qh) {
    float* dst = p.out + i * p.o_s0 + (h0 * G + qh) * p.o_s1;
    const vec inv = vset1(1.0f / sum[qh]);
    for (int v = 0; v < NV; ++v) vstore(dst + v * W, vmul(vload(acc + qh * hd + v * W), inv));
  }
}
#endif  // PDSERVE_SIMD

template <void (*Attend)(const Params&, int64_t, int64_t, int64_t, float*)>
void run(const Params& p, int64_t n) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // A whole request per item reads its blocks as contiguous runs; with few requests per
  // thread, split them by KV head so every thread has work.
  const int64_t heads_per_item = n >= 4 * threads ? p.kv_heads : 1;
  const int64_t splits = p.kv_heads / heads_per_item;
  // Longest contexts first, pulled dynamically: balances threads whatever the length order.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p.ctx[a] > p.ctx[b]; });
  const int64_t items = n * splits;
  const int64_t H = heads_per_item * p.groups;
  const int64_t scratch_floats = Scratch::floats(H, p.head_dim, p.block_size);
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    std::vector<float> scratch(scratch_floats);
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t h0 = (it % splits) * heads_per_item;
      Attend(p, order[it / splits], h0, h0 + heads_per_item, scratch.data());
    }
  };
  const int64_t workers = std::min(threads, items);
  if (workers <= 1) {
    worker();
    return;
  }
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) worker();
  });
}

}  // namespace

// out[n, heads, d] = softmax(scale * q k^T) v per request over its first context_lens[i] keys.
// SIMD path when head_dim is 1, 2, 4, 8 or 16 vectors; the portable loops otherwise.
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                            at::Tensor v_cache, at::Tensor block_tables,
                            at::Tensor context_lens, double scale, bool portable) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  out.device().is_cpu() && block_tables.device().is_cpu() &&
                  context_lens.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: caches must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: caches must be contiguous");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "paged_decode_attention: q and out must be [n, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_decode_attention: head_dim must be the unit-stride axis");
  const int64_t n = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "paged_decode_attention: head_dim of q and cache differ");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "paged_decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n && block_tables.stride(1) == 1,
              "paged_decode_attention: block_tables must be [n, max_blocks] with unit inner stride");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == n && context_lens.is_contiguous(),
              "paged_decode_attention: context_lens must be [n]");
  if (n == 0) return;

  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t table_stride = block_tables.stride(0);
  for (int64_t i = 0; i < n; ++i) {  // every block the kernel will touch must be in the cache
    TORCH_CHECK(ctx[i] >= 1, "paged_decode_attention: context length must be >= 1, got ", ctx[i]);
    const int64_t nb = (ctx[i] + block_size - 1) / block_size;
    TORCH_CHECK(nb <= block_tables.size(1), "paged_decode_attention: request ", i, " needs ", nb,
                " blocks, its table has ", block_tables.size(1));
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t b = tables[i * table_stride + j];
      TORCH_CHECK(b >= 0 && b < num_blocks, "paged_decode_attention: block id ", b, " out of range");
    }
  }

  Params p{q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(), out.stride(0), out.stride(1),
           k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables, table_stride, ctx,
           block_size, kv_heads, heads / kv_heads, head_dim, static_cast<float>(scale)};
  (void)portable;
#ifdef PDSERVE_SIMD
  if (!portable) {
    if (head_dim == W) return run<attend_simd<1>>(p, n);
    if (head_dim == 2 * W) return run<attend_simd<2>>(p, n);
    if (head_dim == 4 * W) return run<attend_simd<4>>(p, n);
    if (head_dim == 8 * W) return run<attend_simd<8>>(p, n);
    if (head_dim == 16 * W) return run<attend_simd<16>>(p, n);
  }
#endif
  if (head_dim == 64) return run<attend_generic<64>>(p, n);
  if (head_dim == 128) return run<attend_generic<128>>(p, n);
  run<attend_generic<0>>(p, n);
}

int paged_attention_simd_width() { return PDSERVE_SIMD_WIDTH; }
