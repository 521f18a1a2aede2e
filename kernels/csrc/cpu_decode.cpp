// Fused fp32 / bf16 CPU ops of a decode step (one new token per sequence), each replacing several torch
// ops per layer: after a layer's GEMVs have streamed megabytes of weights through the caches each
// small torch op costs 5-50 µs here, and the paged attention's gather copied every context twice.
//
// decode_attention_out: for each decode token t and KV head h (work items (t, h) split over threads):
//   1. rotary on the new k head and the `group` q heads sharing it, as transformers' LlamaRotary
//      (x·cos + rotate_half(x)·sin, written x·cos + roll(x, D/2)·sin_signed): two products and one
//      sum, each rounded (no FMA contraction: the file is built with -ffp-contract=off), so the
//      rotated values are bit-identical to the torch path's;
//   2. the new k (rotated) and v written into the cache slot slot_mapping[t] (skipped if < 0);
//   3. attention of the q heads over positions [0, context_lens[t]) read in place through the
//      block table (no gather): s_n = (q·k_n)·scale, p_n = exp(s_n − max s), out = Σ p_n v_n / Σ p_n
//      (the softmax of SDPA; summation orders differ from it, so outputs agree to rounding).
//
// bf16 (qkv, rope tables, KV cache and output all bf16): the cache is read in place, widened to
// fp32 in registers; rotary rounds each product and the sum to bf16 as torch's bf16 ops do
// (round_as, bf16.h), so the written K/V are bit-identical to the torch path's; scores, softmax
// and the weighted sum of V stay fp32 and the output is rounded to bf16 once.
// ISA: an AVX-512F variant (exp: Cephes expf polynomial + scalef, ~1 ulp) chosen at run time by
// __builtin_cpu_supports, and a portable scalar one (std::exp) everywhere else.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "isa.h"
#include "kv_pacer.h"
#include "release_gil.h"
#include "scores_bf16.h"
#include "simd_exp.h"

#ifdef BATON_X86
#include <immintrin.h>
#endif

namespace {

using baton::round_as;

template <typename T>  // float or bf16
struct Attn {
  const T* qkv; int64_t ldqkv;            // [T, (Hq + 2·Hkv)·D]
  const T* cos; const T* sin;             // [max_pos, D] tables; sin first half negated
  const int64_t* pos;                     // [T]
  T* cache;                               // [NB, L, 2, BS, Hkv, D]
  int64_t layer, L, BS, Hq, Hkv, D;
  const int64_t* slots;                   // [T]
  const int32_t* tables; int64_t ldtab;   // [T, max_blocks]
  const int32_t* lens;                    // [T]
  float scale;
  T* out;                                 // [T, Hq·D]
  bool dot = false;                       // bf16 scores by VDPBF16PS (scores_bf16.h)
};

// K row (all Hkv heads, Hkv·D floats) of each position n < lens[t] of token t's sequence, walked
// block by block (no division per row); the V row is K row + vstride.
template <typename T>
inline void k_rows(const Attn<T>& a, int64_t t, const T** rows) {
  const int64_t N = a.lens[t], row = a.Hkv * a.D;
  for (int64_t b = 0, n = 0; n < N; ++b) {
    const T* base = a.cache + ((a.tables[t * a.ldtab + b] * a.L + a.layer) * 2) * a.BS * row;
    for (int64_t off = 0; off < a.BS && n < N; ++off, ++n) rows[n] = base + off * row;
  }
}

// dst = rotate(src) for one head: dst[i] = src[i]·cos[i] + src[(i + D/2) % D]·sin[i], each
// product and the sum rounded to T (torch's bf16 ops); dst is fp32 (q scratch) or T (cache).
template <typename T, typename O>
inline void rotate(const T* src, const T* c, const T* s, O* dst, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float a = round_as<T>(static_cast<float>(src[i]) * static_cast<float>(c[i]));
    const float b = round_as<T>(static_cast<float>(src[(i + half) % D]) * static_cast<float>(s[i]));
    dst[i] = static_cast<O>(round_as<T>(a + b));
  }
}

// Steps 1-2 for (t, h): rotated q heads of the group into q[group·D], cache written.
template <typename T>
inline void rotate_and_write(const Attn<T>& a, int64_t t, int64_t h, float* q) {
  const int64_t G = a.Hq / a.Hkv, D = a.D;
  const T* row = a.qkv + t * a.ldqkv;
  const T* c = a.cos + a.pos[t] * D;
  const T* s = a.sin + a.pos[t] * D;
  for (int64_t g = 0; g < G; ++g) rotate(row + (h * G + g) * D, c, s, q + g * D, D);
  const int64_t slot = a.slots[t];
  if (slot >= 0) {
    const int64_t block = slot / a.BS, off = slot % a.BS;
    T* k = a.cache + ((((block * a.L + a.layer) * 2 + 0) * a.BS + off) * a.Hkv + h) * D;
    T* v = a.cache + ((((block * a.L + a.layer) * 2 + 1) * a.BS + off) * a.Hkv + h) * D;
    rotate(row + (a.Hq + h) * D, c, s, k, D);
    std::copy(row + (a.Hq + a.Hkv + h) * D, row + (a.Hq + a.Hkv + h + 1) * D, v);
  }
}

// Attention of token t's G rotated query heads of KV head h, q[G·D], over its K/V rows;
// p: [G·N] scratch.
template <typename T>
void attend_scalar(const Attn<T>& a, int64_t t, int64_t h, const float* q, const T** rows,
                   float* p) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, N = a.lens[t], vstride = a.BS * a.Hkv * D;
  for (int64_t g = 0; g < G; ++g) {
    float* pi = p + g * N;
    float m = -INFINITY;
    for (int64_t n = 0; n < N; ++n) {
      const T* k = rows[n] + h * D;
      float acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * static_cast<float>(k[d]);
      pi[n] = acc * a.scale;
      m = std::max(m, pi[n]);
    }
    float l = 0;
    for (int64_t n = 0; n < N; ++n) l += (pi[n] = std::exp(pi[n] - m));
    float o[512];  // D <= 512 (checked by the caller)
    std::fill(o, o + D, 0.0f);
    for (int64_t n = 0; n < N; ++n) {
      const T* v = rows[n] + vstride + h * D;
      for (int64_t d = 0; d < D; ++d) o[d] += pi[n] * static_cast<float>(v[d]);
    }
    T* out = a.out + (t * a.Hq + h * G + g) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(o[d] / l);
  }
}

#ifdef BATON_X86
constexpr int64_t PF = 6;  // positions ahead whose K / V rows are prefetched

// D % 16 == 0, group <= 8 (checked by the caller). Token t's G query heads of KV head h, q[G·D];
// p: [G·N] scratch. Every operation of a head is the same whichever other heads or tokens run
// beside it (in this call or another thread): the bits do not depend on how work is split.
template <typename T>
__attribute__((target("avx512f"))) void attend_avx512(const Attn<T>& a, int64_t t, int64_t h,
                                                      const float* q, const T** rows, float* p,
                                                      baton::KvPacer* pf) {
  using baton::load16;
  const int64_t G = a.Hq / a.Hkv, D = a.D, C = D / 16, N = a.lens[t];
  const int64_t vstride = a.BS * a.Hkv * D, head_bytes = D * int64_t(sizeof(T));
  if constexpr (std::is_same_v<T, baton::bf16>) {
    if (a.dot)  // the same scores, 16 positions per horizontal add
      baton::scores_bf16(q, rows, h * D, N, D, G, a.scale, p, pf);
  }
  for (int64_t n = 0; n < N && !a.dot; ++n) {  // scores s[g][n] = (q_g · k_n) · scale
    if (n + PF < N)
      for (int64_t b = 0; b < head_bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[n + PF] + h * D) + b, _MM_HINT_T0);
    if (pf) pf->advance(pf->per_pos);
    const T* k = rows[n] + h * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qi = q + g * D;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qi), load16(k));
      for (int64_t c = 1; c < C; ++c)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), load16(k + 16 * c), acc);
      p[g * N + n] = _mm512_reduce_add_ps(acc) * a.scale;
    }
  }
  float inv_l[8];
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators, 16 scores at a time
    float* pi = p + g * N;
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(pi + n));
    float mval = _mm512_reduce_max_ps(m);
    for (; n < N; ++n) mval = std::max(mval, pi[n]);
    const __m512 mv = _mm512_set1_ps(mval);
    __m512 l = _mm512_setzero_ps();
    for (n = 0; n < N; n += 16) {
      const __mmask16 mask = N - n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n)) - 1u);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, pi + n), mv));
      _mm512_mask_storeu_ps(pi + n, mask, e);
      l = _mm512_add_ps(l, _mm512_maskz_mov_ps(mask, e));
    }
    inv_l[g] = 1.0f / _mm512_reduce_add_ps(l);
  }
  T* const out = a.out + (t * a.Hq + h * G) * D;
  alignas(64) float o64[8 * 64];  // out_g = Σ p_n v_n, D in chunks of 64 in registers
  if (D == 64 && baton::pv64_any(G, p, N, rows, vstride + h * D, o64, pf)) {
    for (int64_t g = 0; g < G; ++g)  // the same products and order as the loop below
      for (int64_t c = 0; c < 4; ++c)
        baton::store16(out + g * D + 16 * c, _mm512_mul_ps(_mm512_load_ps(o64 + g * 64 + 16 * c),
                                                           _mm512_set1_ps(inv_l[g])));
    return;
  }
  for (int64_t c0 = 0; c0 < C; c0 += 4) {
    const int64_t cn = std::min<int64_t>(4, C - c0);
    __m512 acc[8][4];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t n = 0; n < N; ++n) {
      if (c0 == 0 && n + PF < N)
        for (int64_t b = 0; b < head_bytes; b += 64)
          _mm_prefetch(reinterpret_cast<const char*>(rows[n + PF] + vstride + h * D) + b,
                       _MM_HINT_T1);
      if (c0 == 0 && pf) pf->advance(pf->per_pos);
      const T* v = rows[n] + vstride + h * D + 16 * c0;
      for (int64_t g = 0; g < G; ++g) {
        const __m512 pn = _mm512_set1_ps(p[g * N + n]);
        for (int64_t c = 0; c < cn; ++c)
          acc[g][c] = _mm512_fmadd_ps(pn, load16(v + 16 * c), acc[g][c]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < cn; ++c)
        baton::store16(out + g * D + 16 * c0 + 16 * c,
                       _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_l[g])));
  }
}
#endif

bool use_avx512(int64_t isa) { return baton::use_avx512(isa, "cpu_decode"); }

// qkv, cos, sin, kv_cache and out: contiguous CPU tensors of one dtype, fp32 or bf16.
void check_float(const torch::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(),
              "cpu_decode: ", name, " must be a contiguous CPU tensor of kv_cache's dtype");
}

// A pacer (kv_pacer.h) over every cache line of KV heads [h0, h1)'s K and V of token t's
// context (positions < lens[t]) in this layer.
template <typename T>
baton::KvPacer pacer_for(const Attn<T>& a, int64_t t, int64_t h0, int64_t h1) {
  baton::KvPacer k;
  const int64_t row_bytes = a.Hkv * a.D * int64_t(sizeof(T));
  k.cache = reinterpret_cast<const char*>(a.cache);
  k.table = a.tables + t * a.ldtab;
  k.block_bytes = a.L * 2 * a.BS * row_bytes;
  k.layer_off = a.layer * 2 * a.BS * row_bytes;
  k.head_off = h0 * a.D * int64_t(sizeof(T));
  k.N = a.lens[t], k.BS = a.BS, k.row_bytes = row_bytes;
  k.span = (h1 - h0) * a.D * int64_t(sizeof(T));
  k.vstride = a.BS * row_bytes;
  return k;
}

// All of pacer_for's lines asked into L2 at once. A layer's K/V is cold (the GEMVs between two
// visits stream megabytes of weights), and the attention walks it block by block, a few lines at a
// time: with the whole context requested up front the reads overlap (measured with all heads: bf16,
// 8 rows of 250 positions, SmolLM2's heads, a 30-layer cache, one layer call, medians: one thread
// 318 -> 238-294 µs, two 208 -> 122-178; the same data cache-hot takes ~88). Called for a run's
// first item, and on the scalar path for the next item while this one computes; the AVX-512 path
// spreads the next item's requests over this one's positions instead (kv_pacer.h).
template <typename T>
inline void prefetch_context(const Attn<T>& a, int64_t t, int64_t h0, int64_t h1) {
  pacer_for(a, t, h0, h1).finish();
}

// Work units: a token t and one of its KV heads h. Unit (t, h) writes h's part of t's new slot,
// then reads only h's K/V of t's own sequence (one decode token per sequence), so units may run
// on any thread in any order, and each head's operations are the same whatever the split: the
// bits do not depend on it. Each thread takes a contiguous run of units, (t, h) in order, cut
// where the context positions (plus UNIT_COST for a unit's fixed work) reach its share: a
// decode batch's contexts differ (an agent's 4,000-token session beside a 300-token one), and
// runs of equal unit counts left one core reading most of the K/V while the other waited. A
// thread runs its units as items, each a token's heads within its run (whole K/V rows asked for
// when that is all of them); a lone decode row spreads its heads over the cores (its attention
// is bound by one core's memory reads). With `query` (decode_attend_out; a.qkv null) t's q is
// that row, already rotated (widened; the cache is already written): the same q values
// rotate_and_write would give, so the same bits.
constexpr int64_t UNIT_COST = 16;

// The first unit of thread k's run of nt: the unit boundary nearest its share k/nt of the
// weight; cum [units + 1]: the weight of the units before each one.
inline int64_t first_unit(const std::vector<int64_t>& cum, int64_t k, int64_t nt) {
  const int64_t target = cum.back() * k / nt;
  auto it = std::lower_bound(cum.begin(), cum.end(), target);
  if (it != cum.begin() && target - *(it - 1) < *it - target) --it;
  return it - cum.begin();
}

template <typename T>
void run(const Attn<T>& a, const T* query, int64_t T_, int64_t max_len, bool simd) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, H = a.Hkv, units = T_ * H;
  std::vector<int64_t> cum(units + 1, 0);
  for (int64_t u = 0; u < units; ++u) cum[u + 1] = cum[u] + a.lens[u / H] + UNIT_COST;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), units);
  at::parallel_for(0, nt, 1, [&](int64_t k0, int64_t k1) {
    std::vector<float> q(G * D), p(G * max_len);
    std::vector<const T*> rows(max_len);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t u0 = first_unit(cum, k, nt), u1 = first_unit(cum, k + 1, nt);
      auto item_end = [&](int64_t u) { return std::min(u1, (u / H + 1) * H); };
      auto prefetch = [&](int64_t u) {
        prefetch_context(a, u / H, u % H, item_end(u) - u / H * H);
      };
      if (u0 < u1) prefetch(u0);
      int64_t rows_of = -1;  // the token `rows` holds
      baton::KvPacer pacer;
      for (int64_t u = u0; u < u1; u = item_end(u)) {
        const int64_t t = u / H, nu = item_end(u);
        baton::KvPacer* pf = nullptr;  // the next item's lines, asked for as this one computes
        if (nu < u1 && simd) {
          pacer = pacer_for(a, nu / H, nu % H, item_end(nu) - nu / H * H);
          pacer.start((nu - u) * 2 * a.lens[t]);  // a call per position, scores and p·v
          pf = &pacer;
        } else if (nu < u1) {
          prefetch(nu);
        }
        if (rows_of != t) k_rows(a, t, rows.data()), rows_of = t;
        for (int64_t h = u % H; h < item_end(u) - t * H; ++h) {
          if (query != nullptr) {
            const T* src = query + (t * a.Hq + h * G) * D;
            for (int64_t j = 0; j < G * D; ++j) q[j] = static_cast<float>(src[j]);
          } else {
            rotate_and_write(a, t, h, q.data());
          }
#ifdef BATON_X86
          if (simd) { attend_avx512(a, t, h, q.data(), rows.data(), p.data(), pf); continue; }
#endif
          attend_scalar(a, t, h, q.data(), rows.data(), p.data());
        }
        if (pf) pf->finish();
      }
    }
  });
}

// qkv null: attend only, over the rotated `query` [T_, Hq·D] (decode_attend_out).
template <typename T>
void launch(const T* qkv, int64_t ldqkv, const T* query, int64_t T_, const T* cos, const T* sin,
            const int64_t* pos, torch::Tensor& kv_cache, int64_t layer, const int64_t* slots,
            const int32_t* tab, int64_t MB, const int32_t* lens, double scale, int64_t Hq,
            torch::Tensor& out, int64_t max_len, int64_t isa) {
  const int64_t D = kv_cache.size(5);
  Attn<T> a{qkv, ldqkv, cos, sin, pos, kv_cache.data_ptr<T>(), layer, kv_cache.size(1),
            kv_cache.size(3), Hq, kv_cache.size(4), D, slots, tab, MB, lens,
            static_cast<float>(scale), out.data_ptr<T>()};
  const bool simd = use_avx512(isa) && D % 16 == 0;  // group <= 8: checked by the callers
#ifdef BATON_X86
  static const bool has_dot = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
                              && __builtin_cpu_supports("avx512vl");
  // ISA_BEST only: a forced AVX-512F variant keeps its own score loop (tests compare the two)
  // scores_bf16 holds q of up to 8 heads of up to 512 elements in registers/stack
  a.dot = std::is_same_v<T, baton::bf16> && simd && isa == 0 && has_dot && D % 32 == 0 &&
          D <= 512 && Hq / a.Hkv <= 8;
#endif
  run(a, query, T_, max_len, simd);
}

// Every context length and block id the T tokens follow (RuntimeError on a bad one); returns
// the longest context.
int64_t check_tables(const int32_t* lens, const int32_t* tab, int64_t T, int64_t MB, int64_t BS,
                     int64_t NB) {
  int64_t max_len = 1;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(1 <= lens[t] && lens[t] <= MB * BS, "cpu_decode: context length out of range");
    for (int64_t b = 0; b < (lens[t] + BS - 1) / BS; ++b)
      TORCH_CHECK(0 <= tab[t * MB + b] && tab[t * MB + b] < NB, "cpu_decode: block id out of range");
    max_len = std::max<int64_t>(max_len, lens[t]);
  }
  return max_len;
}

}  // namespace

// Shapes in kernels/cpu_decode.py (decode_attention). isa: 0 best, 1 scalar, 3 AVX-512F.
void decode_attention_out(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& positions, torch::Tensor& kv_cache, int64_t layer,
                          const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                          const torch::Tensor& context_lens, double scale, int64_t num_heads,
                          torch::Tensor& out, int64_t isa) {
  const at::ScalarType dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "cpu_decode: fp32 or bf16 only");
  check_float(qkv, dtype, "qkv"); check_float(cos, dtype, "cos"); check_float(sin, dtype, "sin");
  check_float(out, dtype, "out"); check_float(kv_cache, dtype, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 6, "cpu_decode: kv_cache must be [NB, L, 2, BS, Hkv, D]");
  const int64_t T = qkv.size(0), Hkv = kv_cache.size(4), D = kv_cache.size(5), Hq = num_heads;
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= 8 && D % 2 == 0 && D <= 512,
              "cpu_decode: need Hq = g·Hkv, g <= 8, even D <= 512");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (Hq + 2 * Hkv) * D, "cpu_decode: qkv width");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == D, "cpu_decode: rope tables");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == Hq * D, "cpu_decode: out shape");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
              block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              positions.is_contiguous() && slot_mapping.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(),
              "cpu_decode: positions/slot_mapping int64, block_tables/context_lens int32, contiguous");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T && context_lens.numel() == T &&
              block_tables.dim() == 2 && block_tables.size(0) == T, "cpu_decode: one row per token");
  TORCH_CHECK(0 <= layer && layer < kv_cache.size(1), "cpu_decode: layer out of range");
  const int64_t NB = kv_cache.size(0), BS = kv_cache.size(3), MB = block_tables.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tab = block_tables.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {  // every index this call follows is checked here
    TORCH_CHECK(0 <= pos[t] && pos[t] < cos.size(0), "cpu_decode: position past the rope table");
    TORCH_CHECK(slots[t] < NB * BS, "cpu_decode: slot past the cache");
  }
  const int64_t max_len = check_tables(lens, tab, T, MB, BS, NB);
  if (dtype == at::kFloat)
    launch<float>(qkv.data_ptr<float>(), qkv.size(1), nullptr, T, cos.data_ptr<float>(),
                  sin.data_ptr<float>(), pos, kv_cache, layer, slots, tab, MB, lens, scale, Hq,
                  out, max_len, isa);
  else
    launch<baton::bf16>(qkv.data_ptr<baton::bf16>(), qkv.size(1), nullptr, T,
                        cos.data_ptr<baton::bf16>(), sin.data_ptr<baton::bf16>(), pos, kv_cache,
                        layer, slots, tab, MB, lens, scale, Hq, out, max_len, isa);
}

// Shapes in kernels/cpu_decode.py (decode_attend): decode_attention_out's attention alone, over
// query [T, Hq·D] already rotated, the cache already written.
void decode_attend_out(const torch::Tensor& query, torch::Tensor& kv_cache, int64_t layer,
                       const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                       double scale, torch::Tensor& out, int64_t isa) {
  const at::ScalarType dtype = kv_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "cpu_decode: fp32 or bf16 only");
  check_float(query, dtype, "query"); check_float(out, dtype, "out");
  check_float(kv_cache, dtype, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 6, "cpu_decode: kv_cache must be [NB, L, 2, BS, Hkv, D]");
  const int64_t T = query.size(0), Hkv = kv_cache.size(4), D = kv_cache.size(5);
  TORCH_CHECK(query.dim() == 2 && query.size(1) % D == 0, "cpu_decode: query must be [T, Hq·D]");
  const int64_t Hq = query.size(1) / D;
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= 8 && D % 2 == 0 && D <= 512,
              "cpu_decode: need Hq = g·Hkv, g <= 8, even D <= 512");
  TORCH_CHECK(out.sizes() == query.sizes(), "cpu_decode: out shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              block_tables.is_contiguous() && context_lens.is_contiguous() &&
              context_lens.numel() == T && block_tables.dim() == 2 && block_tables.size(0) == T,
              "cpu_decode: block_tables/context_lens int32, contiguous, one row per token");
  TORCH_CHECK(0 <= layer && layer < kv_cache.size(1), "cpu_decode: layer out of range");
  const int64_t NB = kv_cache.size(0), BS = kv_cache.size(3), MB = block_tables.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tab = block_tables.data_ptr<int32_t>();
  const int64_t max_len = check_tables(lens, tab, T, MB, BS, NB);
  if (dtype == at::kFloat)
    launch<float>(nullptr, 0, query.data_ptr<float>(), T, nullptr, nullptr, nullptr, kv_cache,
                  layer, nullptr, tab, MB, lens, scale, Hq, out, max_len, isa);
  else
    launch<baton::bf16>(nullptr, 0, query.data_ptr<baton::bf16>(), T, nullptr, nullptr, nullptr,
                        kv_cache, layer, nullptr, tab, MB, lens, scale, Hq, out, max_len, isa);
}

void register_cpu_decode(pybind11::module& m) {
  m.def("decode_attention_out", &decode_attention_out, BATON_RELEASE_GIL,
        "rotary + KV write + paged decode attention, fp32/bf16 CPU (kernels/cpu_decode.py)");
  m.def("decode_attend_out", &decode_attend_out, BATON_RELEASE_GIL,
        "paged decode attention of rotated queries, fp32/bf16 CPU (kernels/cpu_decode.py)");
}
