// Fused fp32 CPU op of a decode step whose rows may carry several query tokens (speculative
// decoding's verify rows: a sequence's known token and its drafted ones), kernels/cpu_verify.py.
//
// verify_attention_out: for each work item (row b, KV head h), split over threads:
//   1. for each of row b's q_len tokens t: rotary on its new k head and the `group` q heads that
//      share h (x·cos + roll(x, D/2)·sin_signed, two products and one sum each, no FMA: the file
//      is built with -ffp-contract=off), bit-identical to the torch path's; k and v written into
//      slot_mapping[t] (skipped if < 0);
//   2. attention, causal within the row: token i (position ctx − q_len + i) sees positions
//      [0, ctx − q_len + i]. Each K row and each V row of the context is read once for all of
//      the row's tokens and heads (a one-token kernel per token would read the context q_len
//      times: at a 20k-token context that is most of a step's memory traffic):
//        s[i][g][n] = (q_ig · k_n)·scale        q·k summed in 8 lanes (lane j: d ≡ j mod 8),
//        p = exp(s − max), out = Σ p·v / Σ p    lanes added as a fixed tree
// Items (b, h) touch disjoint memory: h's slots of b's new tokens, h's K/V of b's context.
//
// ISA: one C++ body compiled three times (target attributes: AVX-512F, AVX2, baseline x86-64 /
// other architectures), so every variant runs the same operations in the same order; only exp
// differs (AVX-512: exp512 of simd_exp.h, ~1 ulp; else std::exp). Requires D % 8 == 0.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "release_gil.h"
#include "simd_exp.h"

namespace {

struct Rows {
  const float* qkv; int64_t ldqkv;        // [T, (Hq + 2·Hkv)·D]
  const float* cos; const float* sin;     // [max_pos, D]; sin's first half negated
  const int64_t* pos; const int64_t* slots;  // [T]
  float* cache;                           // [NB, L, 2, BS, Hkv, D]
  int64_t layer, L, BS, Hq, Hkv, D;
  const int32_t* tables; int64_t ldtab;   // [B, max_blocks]
  const int32_t* lens;                    // [B] context incl. the row's tokens
  const int32_t* qsl;                     // [B + 1] row b owns tokens [qsl[b], qsl[b+1])
  float scale;
  float* out;                             // [T, Hq·D]
};

using ExpSum = float (*)(float* x, int64_t n, float m);  // x = exp(x − m) in place; Σ x

float exp_sum_scalar(float* x, int64_t n, float m) {
  float l = 0;
  for (int64_t i = 0; i < n; ++i) l += (x[i] = std::exp(x[i] - m));
  return l;
}

#ifdef BATON_X86
__attribute__((target("avx512f"))) float exp_sum_avx512(float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 l = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv));
    _mm512_mask_storeu_ps(x + i, k, e);
    l = _mm512_add_ps(l, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(l);
}
#endif

__attribute__((always_inline)) inline float dot8(const float* a, const float* b, int64_t D) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < D; d += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

__attribute__((always_inline)) inline void rotate(const float* src, const float* c,
                                                  const float* s, float* dst, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float x = src[i] * c[i];
    const float y = src[(i + half) % D] * s[i];
    dst[i] = x + y;
  }
}

inline const float* k_row(const Rows& a, int64_t b, int64_t h, int64_t n) {
  const int64_t block = a.tables[b * a.ldtab + n / a.BS];
  return a.cache + ((((block * a.L + a.layer) * 2) * a.BS + n % a.BS) * a.Hkv + h) * a.D;
}

// Step 1 for (b, h): q[(i·G + g)·D] rotated, K/V of h written for each of b's tokens.
__attribute__((always_inline)) inline void rotate_and_write(const Rows& a, int64_t b, int64_t h,
                                                            float* q) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, vstride = a.BS * a.Hkv * D;
  for (int64_t t = a.qsl[b]; t < a.qsl[b + 1]; ++t) {
    const float* row = a.qkv + t * a.ldqkv;
    const float* c = a.cos + a.pos[t] * D;
    const float* s = a.sin + a.pos[t] * D;
    float* qt = q + (t - a.qsl[b]) * G * D;
    for (int64_t g = 0; g < G; ++g) rotate(row + (h * G + g) * D, c, s, qt + g * D, D);
    const int64_t slot = a.slots[t];
    if (slot >= 0) {
      const int64_t block = slot / a.BS, off = slot % a.BS;
      float* k = a.cache + ((((block * a.L + a.layer) * 2) * a.BS + off) * a.Hkv + h) * D;
      rotate(row + (a.Hq + h) * D, c, s, k, D);
      std::copy(row + (a.Hq + a.Hkv + h) * D, row + (a.Hq + a.Hkv + h + 1) * D, k + vstride);
    }
  }
}

struct Scratch {
  std::vector<float> q, p, o;
};

// Steps 1-2 for item (b, h). p: scores then weights, [ql·G rows][N]; o: [ql·G][D].
__attribute__((always_inline)) inline void item(const Rows& a, int64_t b, int64_t h, Scratch& s,
                                                ExpSum exp_sum) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, N = a.lens[b];
  const int64_t ql = a.qsl[b + 1] - a.qsl[b], base = N - ql, R = ql * G;
  const int64_t vstride = a.BS * a.Hkv * D;
  s.q.resize(R * D);
  s.p.resize(R * N);
  s.o.assign(R * D, 0.0f);
  rotate_and_write(a, b, h, s.q.data());
  float* p = s.p.data();
  for (int64_t n = 0; n < N; ++n) {  // token i sees n when n <= base + i
    const float* k = k_row(a, b, h, n);
    for (int64_t r = std::max<int64_t>(0, n - base) * G; r < R; ++r)
      p[r * N + n] = dot8(s.q.data() + r * D, k, D) * a.scale;
  }
  std::vector<float> inv(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t cnt = base + r / G + 1;
    float* pr = p + r * N;
    const float m = *std::max_element(pr, pr + cnt);
    inv[r] = 1.0f / exp_sum(pr, cnt, m);
  }
  for (int64_t n = 0; n < N; ++n) {
    const float* v = k_row(a, b, h, n) + vstride;
    for (int64_t r = std::max<int64_t>(0, n - base) * G; r < R; ++r) {
      const float w = p[r * N + n];
      float* o = s.o.data() + r * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = a.qsl[b] + r / G, head = h * G + r % G;
    float* dst = a.out + (t * a.Hq + head) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = s.o[r * D + d] * inv[r];
  }
}

void items_scalar(const Rows& a, int64_t i0, int64_t i1, ExpSum e) {
  Scratch s;
  for (int64_t i = i0; i < i1; ++i) item(a, i / a.Hkv, i % a.Hkv, s, e);
}

#ifdef BATON_X86
__attribute__((target("avx2"))) void items_avx2(const Rows& a, int64_t i0, int64_t i1, ExpSum e) {
  Scratch s;
  for (int64_t i = i0; i < i1; ++i) item(a, i / a.Hkv, i % a.Hkv, s, e);
}

__attribute__((target("avx512f"))) void items_avx512(const Rows& a, int64_t i0, int64_t i1,
                                                     ExpSum e) {
  Scratch s;
  for (int64_t i = i0; i < i1; ++i) item(a, i / a.Hkv, i % a.Hkv, s, e);
}
#endif

using Items = void (*)(const Rows&, int64_t, int64_t, ExpSum);

// isa: 0 best, 1 scalar, 2 AVX2, 3 AVX-512F; raises when the CPU lacks the one asked for.
std::pair<Items, ExpSum> variant(int64_t isa) {
#ifdef BATON_X86
  if (baton::use_avx512(isa, "cpu_verify")) return {items_avx512, exp_sum_avx512};
  static const bool has2 = __builtin_cpu_supports("avx2");
  TORCH_CHECK(isa != 2 || has2, "cpu_verify: this CPU has no AVX2");
  if (isa == 2 || (isa == 0 && has2)) return {items_avx2, exp_sum_scalar};
#else
  TORCH_CHECK(isa <= 1, "cpu_verify: SIMD variants exist only on x86-64");
#endif
  return {items_scalar, exp_sum_scalar};
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "cpu_verify: ", name, " must be a contiguous fp32 CPU tensor");
}

void check_i(const torch::Tensor& t, at::ScalarType type, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == n && t.device().is_cpu(),
              "cpu_verify: ", name, " must be a contiguous ", n, "-element ",
              type == at::kLong ? "int64" : "int32", " CPU tensor");
}

// Every index the op follows, checked before anything is written.
void check_indices(const Rows& a, int64_t B, int64_t T, int64_t NB, int64_t MB, int64_t P) {
  TORCH_CHECK(a.qsl[0] == 0 && a.qsl[B] == T, "cpu_verify: query_start_loc must run 0..T");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ql = a.qsl[b + 1] - a.qsl[b], n = a.lens[b];
    TORCH_CHECK(ql >= 1, "cpu_verify: every row needs a query token");
    TORCH_CHECK(ql <= n && n <= MB * a.BS, "cpu_verify: context length out of range");
    for (int64_t k = 0; k < (n + a.BS - 1) / a.BS; ++k) {
      const int32_t id = a.tables[b * a.ldtab + k];
      TORCH_CHECK(0 <= id && id < NB, "cpu_verify: block id out of range");
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(0 <= a.pos[t] && a.pos[t] < P, "cpu_verify: position past the rope table");
    TORCH_CHECK(a.slots[t] < NB * a.BS, "cpu_verify: slot past the cache");
  }
}

}  // namespace

// Shapes in kernels/cpu_verify.py (verify_attention).
void verify_attention_out(const torch::Tensor& qkv, const torch::Tensor& cos,
                          const torch::Tensor& sin, const torch::Tensor& positions,
                          torch::Tensor& kv_cache, int64_t layer, const torch::Tensor& slot_mapping,
                          const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                          const torch::Tensor& query_start_loc, double scale, int64_t num_heads,
                          torch::Tensor& out, int64_t isa) {
  check_f32(qkv, "qkv"); check_f32(cos, "cos"); check_f32(sin, "sin"); check_f32(out, "out");
  check_f32(kv_cache, "kv_cache");
  TORCH_CHECK(kv_cache.dim() == 6, "cpu_verify: kv_cache must be [NB, L, 2, BS, Hkv, D]");
  const int64_t T = qkv.size(0), Hkv = kv_cache.size(4), D = kv_cache.size(5), Hq = num_heads;
  const int64_t B = context_lens.numel();
  TORCH_CHECK(Hq % Hkv == 0 && D % 8 == 0, "cpu_verify: need Hq = g·Hkv and D % 8 == 0");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (Hq + 2 * Hkv) * D, "cpu_verify: qkv width");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == D,
              "cpu_verify: rope tables");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == Hq * D, "cpu_verify: out shape");
  TORCH_CHECK(0 <= layer && layer < kv_cache.size(1), "cpu_verify: layer out of range");
  check_i(positions, at::kLong, T, "positions");
  check_i(slot_mapping, at::kLong, T, "slot_mapping");
  check_i(context_lens, at::kInt, B, "context_lens");
  check_i(query_start_loc, at::kInt, B + 1, "query_start_loc");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              block_tables.dim() == 2 && block_tables.size(0) == B,
              "cpu_verify: block_tables must be [B, max_blocks] int32, contiguous");
  Rows a{qkv.data_ptr<float>(), qkv.size(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
         positions.data_ptr<int64_t>(), slot_mapping.data_ptr<int64_t>(),
         kv_cache.data_ptr<float>(), layer, kv_cache.size(1), kv_cache.size(3), Hq, Hkv, D,
         block_tables.data_ptr<int32_t>(), block_tables.size(1), context_lens.data_ptr<int32_t>(),
         query_start_loc.data_ptr<int32_t>(), static_cast<float>(scale), out.data_ptr<float>()};
  check_indices(a, B, T, kv_cache.size(0), block_tables.size(1), cos.size(0));
  const std::pair<Items, ExpSum> v = variant(isa);
  const Items items = v.first;
  const ExpSum exp_sum = v.second;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) { items(a, i0, i1, exp_sum); });
}

void register_cpu_verify(pybind11::module& m) {
  m.def("verify_attention_out", &verify_attention_out, BATON_RELEASE_GIL,
        "rotary + KV write + paged attention of multi-token decode rows, fp32 CPU "
        "(kernels/cpu_verify.py)");
}
