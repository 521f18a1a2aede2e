// Small-batch bf16 GEMV for CPU decode: y[b, o] = bf16(sum_k x[b, k] * w[o, k]), fp32 sums.
//
// Semantics of torch's bf16 linear on CPU (oneDNN / at::cpublas: fp32 accumulation of exact
// bf16 x bf16 products, one round-to-nearest-even to bf16 at the end), with ONE summation order
// in every variant, the order of AVX512_BF16's VDPBF16PS: k is cut into chunks of 32; fp32 lane
// j (of 16) adds, per chunk c, the product of element 32c + 2j + 1 and then that of 32c + 2j
// (each sum rounded once; a bf16 product is exact in fp32); missing tail elements count as 0.
// The 16 lanes are then added as a tree (j + 8, j + 4, j + 2, j + 1). Hence:
//   - a row's result is one fixed computation over its x row and w row: it does not depend on
//     the batch size, the other rows, the tile a weight row falls in, or the thread count;
//   - the variants agree bit for bit, except where VDPBF16PS flushes subnormal inputs or sums
//     to zero (|values| < 2^-126).
// Variants (chosen at run time, like gemv.cpp's): AVX512_BF16 (_mm512_dpbf16_ps on bf16 pairs
// of w and x as stored); AVX2+FMA, which widens w in registers (even elements: dword << 16, odd
// elements: dword & 0xFFFF0000) against x widened once per call into fp32 even/odd planes, the
// same two fused adds per lane and chunk; a scalar loop elsewhere. Tiling, 4 distant row streams,
// prefetch of the next tile (AVX512_BF16: 4 tiles ahead into L2, PF_TILES) and threading are
// gemv.cpp's (see there), at half the bytes per row.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "release_gil.h"

#if defined(__x86_64__) || defined(_M_X64)
#define BATON_X86 1
#endif

namespace {

constexpr int64_t CH = 32;  // k elements per chunk: 16 fp32 lanes x one bf16 pair
constexpr int R = 4;        // weight rows per tile
// AVX512_BF16: tiles ahead whose weight rows a tile prefetches, into L2 (T1). With 4 x rows
// and more the tile computes long enough that L1-bound prefetches one tile ahead (T0, as
// gemv.cpp) did not overlap the reads with the products: all of SmolLM2-135M's matrices, 8 x
// rows, cold, 2 threads: T0 one tile ahead 12.8-13.1 ms, T1 four ahead 10.4 (T1 one, two,
// eight and sixteen ahead 10.4-10.9); 1 x row unchanged (memory bound either way).
constexpr int64_t PF_TILES = 4;

struct ArgsB {
  const uint16_t* x; int64_t ldx;  // [B, K] bf16 bits, row stride ldx
  const uint16_t* w; int64_t K;    // [O, K] contiguous
  const float* xs;                 // AVX2: per x row Kp floats, per chunk [16 even | 16 odd]
  int64_t Kp;                      // K rounded up to CH
  baton::bf16* y; int64_t ldy;     // [B, O]
  int64_t B, O;
};

struct Tile { int64_t o, step, pf; };  // rows o + r·step; pf: prefetch rows pf further on

inline float widen(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float tree16(float* l) {
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) l[j] += l[j + w];
  return l[0];
}

// ---- scalar ---------------------------------------------------------------------------------
float dot_scalar(const uint16_t* w, const uint16_t* x, int64_t K) {
  float l[16] = {0};
  for (int64_t c = 0; c < K; c += CH)
    for (int j = 0; j < 16; ++j) {
      const int64_t e = c + 2 * j;
      if (e + 1 < K) l[j] += widen(w[e + 1]) * widen(x[e + 1]);
      if (e < K) l[j] += widen(w[e]) * widen(x[e]);
    }
  return tree16(l);
}

void rows_scalar(const ArgsB& a, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t b = 0; b < a.B; ++b)
      a.y[b * a.ldy + o] = baton::bf16(dot_scalar(a.w + o * a.K, a.x + b * a.ldx, a.K));
}

#ifdef BATON_X86
// ---- AVX2 + FMA -----------------------------------------------------------------------------
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One chunk of 16 pairs at p (32 bf16) against x planes xe (chunk start) into lanes lo / hi.
__attribute__((target("avx2,fma"))) inline void chunk_avx2(const uint16_t* p, const float* const* xc,
                                                         int bt, __m256* lo, __m256* hi) {
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
  const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, top));
  const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
  const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, top));
  for (int t = 0; t < bt; ++t) {  // xc[t]: [even 0-7 | even 8-15 | odd 0-7 | odd 8-15]
    lo[t] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xc[t] + 16), lo[t]);
    lo[t] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xc[t]), lo[t]);
    hi[t] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(xc[t] + 24), hi[t]);
    hi[t] = _mm256_fmadd_ps(e1, _mm256_loadu_ps(xc[t] + 8), hi[t]);
  }
}

template <int NR, int BT>
__attribute__((target("avx2,fma"))) void tile_avx2(const ArgsB& a, Tile tl, int64_t b) {
  __m256 lo[NR][BT], hi[NR][BT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t) lo[r][t] = hi[r][t] = _mm256_setzero_ps();
  const uint16_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = a.w + (tl.o + r * tl.step) * a.K;
  const float* xc[BT];
  const int64_t pf = tl.pf * a.K;
  int64_t k = 0;
  for (; k + CH <= a.K; k += CH) {
    for (int t = 0; t < BT; ++t) xc[t] = a.xs + (b + t) * a.Kp + k;
    for (int r = 0; r < NR; ++r) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(w[r] + pf + k), _MM_HINT_T0);
      chunk_avx2(w[r] + k, xc, BT, lo[r], hi[r]);
    }
  }
  if (k < a.K) {  // tail: w copied into zeros (x planes are zero-padded)
    for (int t = 0; t < BT; ++t) xc[t] = a.xs + (b + t) * a.Kp + k;
    alignas(32) uint16_t buf[CH];
    for (int r = 0; r < NR; ++r) {
      std::memset(buf, 0, sizeof(buf));
      std::memcpy(buf, w[r] + k, (a.K - k) * 2);
      chunk_avx2(buf, xc, BT, lo[r], hi[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t)
      a.y[(b + t) * a.ldy + tl.o + r * tl.step] =
          baton::bf16(hsum8(_mm256_add_ps(lo[r][t], hi[r][t])));
}

// A tile of NR rows against every x row: one pass for B = 1, else two x rows at a time (12
// of the 16 ymm registers), the 4-row tile as two 2-row halves.
template <int NR>
__attribute__((target("avx2,fma"))) void batch_avx2(const ArgsB& a, Tile tl) {
  if (a.B == 1) { tile_avx2<NR, 1>(a, tl, 0); return; }
  constexpr int H = NR >= 2 ? 2 : 1;
  for (int half = 0; half < NR / H; ++half) {
    Tile h{tl.o + half * H * tl.step, tl.step, tl.pf};
    int64_t b = 0;
    for (; b + 2 <= a.B; b += 2, h.pf = 0) tile_avx2<H, 2>(a, h, b);
    if (b < a.B) tile_avx2<H, 1>(a, h, b);
  }
}

__attribute__((target("avx2,fma"))) void rows_avx2(const ArgsB& a, int64_t o0, int64_t o1) {
  const int64_t q = (o1 - o0) / R;
  for (int64_t i = 0; i < q; ++i) batch_avx2<R>(a, Tile{o0 + i, q, i + 1 < q ? 1 : 0});
  for (int64_t o = o0 + q * R; o < o1; ++o) batch_avx2<1>(a, Tile{o, 1, 0});
}

// ---- AVX512_BF16 ----------------------------------------------------------------------------
#define BATON_BF16_TARGET "avx512f,avx512bw,avx512bf16,avx2,fma"

// The lane sums of 16 vectors v = acc[r][t] (v[4t + r]) by the tree of tree16 (lanes j + 8,
// then j + 4, j + 2, j + 1: the same additions, so the same bits as hsum8 per vector), computed
// for all 16 at once by shuffles: lane 4r + t of the result holds acc[r][t]'s sum.
__attribute__((target(BATON_BF16_TARGET))) inline __m512 tree16x16(const __m512 (&acc)[4][4]) {
  __m512 v[16], s8[8], s4[4], s2[2];
  for (int t = 0; t < 4; ++t)
    for (int r = 0; r < 4; ++r) v[4 * t + r] = acc[r][t];
  for (int k = 0; k < 8; ++k)  // [v2k: j + (j+8), j < 8 | v2k+1: same]
    s8[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // quarters: v4m, v4m+1, v4m+2, v4m+3, each j + (j+4), j < 4
    s4[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * m], s8[2 * m + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * m], s8[2 * m + 1], 0xDD));
  for (int n = 0; n < 2; ++n) {  // quarter q: [v8n+q: j + (j+2), j < 2 | v8n+4+q: same]
    const __m512d x = _mm512_castps_pd(s4[2 * n]), y = _mm512_castps_pd(s4[2 * n + 1]);
    s2[n] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // quarter q: [vq, v4+q, v8+q, v12+q], lane 0 + lane 1 of each: lane 4q + s holds v[4s + q]
  return _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int NR, int BT>
__attribute__((target(BATON_BF16_TARGET))) void tile_dp(const ArgsB& a, Tile tl, int64_t b) {
  __m512 acc[NR][BT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t) acc[r][t] = _mm512_setzero_ps();
  const uint16_t* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = a.w + (tl.o + r * tl.step) * a.K;
  const uint16_t* x = a.x + b * a.ldx;
  const int64_t pf = tl.pf * a.K;
  int64_t k = 0;
  for (; k + CH <= a.K; k += CH) {
    __m512bh wv[NR];  // the NR weight chunks, then each x chunk once against all of them
    for (int r = 0; r < NR; ++r) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(w[r] + pf + k), _MM_HINT_T1);
      wv[r] = (__m512bh)_mm512_loadu_si512(w[r] + k);
    }
    for (int t = 0; t < BT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * a.ldx + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  if (k < a.K) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t(1) << (a.K - k)) - 1);
    for (int r = 0; r < NR; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w[r] + k);
      for (int t = 0; t < BT; ++t)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv,
                                     (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * a.ldx + k));
    }
  }
  if constexpr (NR == 4 && BT == 4) {  // 16 sums in one transposing tree (same adds, fewer ops)
    alignas(64) float s[16];
    _mm512_store_ps(s, tree16x16(acc));
    for (int r = 0; r < 4; ++r)
      for (int t = 0; t < 4; ++t)
        a.y[(b + t) * a.ldy + tl.o + r * tl.step] = baton::bf16(s[4 * r + t]);
    return;
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t) {
      const __m512 v = acc[r][t];
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
      a.y[(b + t) * a.ldy + tl.o + r * tl.step] =
          baton::bf16(hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi)));
    }
}

// The rest of a tile's x rows after whole groups of MAXBT: n < MAXBT rows from b, one
// tile_dp<NR, n> (n fixed at compile time, so its accumulators stay in registers).
template <int NR, int N>
__attribute__((target(BATON_BF16_TARGET))) void rest_dp(const ArgsB& a, Tile tl, int64_t b,
                                                        int64_t n) {
  if constexpr (N > 0) {
    if (n == N) return tile_dp<NR, N>(a, tl, b);
    rest_dp<NR, N - 1>(a, tl, b, n);
  }
}

// Every x row against a tile, MAXBT rows a pass; only the first pass prefetches.
//   MAXBT 4 (1 to 4 rows of x): 4 x 4 tiles, 16 accumulators of 32 zmm.
//   MAXBT 8 (5 and more): 3 x 8 tiles in one pass (24 accumulators, each x chunk loaded once
//   against the 3 weight chunks), as gemv.cpp's fp32 batch8, instead of 4 x 4 tiles walked
//   twice: the weight reads overlap the products better. Every SmolLM2 matrix, cold, 2
//   threads, variants alternated: 8 rows 11.6-13.0 -> 10.0 ms, 6 rows 10.1-10.6 -> 8.0; one
//   thread, 8 rows 20.5-21.5 -> 17.8. Each output's sum runs in the same order either way:
//   bit-identical.
template <int NR, int MAXBT>
__attribute__((target(BATON_BF16_TARGET))) void batch_dp(const ArgsB& a, Tile tl) {
  int64_t b = 0;
  for (; b + MAXBT <= a.B; b += MAXBT, tl.pf = 0) tile_dp<NR, MAXBT>(a, tl, b);
  rest_dp<NR, MAXBT - 1>(a, tl, b, a.B - b);
}

// Rows [o0, o1) in NR distant streams (gemv.cpp's rows_generic), each tile prefetching the
// rows PF_TILES tiles on; the rows left over go one at a time.
template <int NR, int MAXBT>
__attribute__((target(BATON_BF16_TARGET))) void walk_dp(const ArgsB& a, int64_t o0, int64_t o1) {
  const int64_t q = (o1 - o0) / NR;
  for (int64_t i = 0; i < q; ++i)
    batch_dp<NR, MAXBT>(a, Tile{o0 + i, q, i + PF_TILES < q ? PF_TILES : 0});
  for (int64_t o = o0 + q * NR; o < o1; ++o) batch_dp<1, MAXBT>(a, Tile{o, 1, 0});
}

__attribute__((target(BATON_BF16_TARGET))) void rows_dp(const ArgsB& a, int64_t o0, int64_t o1) {
  if (a.B >= 5)
    walk_dp<3, 8>(a, o0, o1);
  else
    walk_dp<R, 4>(a, o0, o1);
}
#endif  // BATON_X86

using RowsFn = void (*)(const ArgsB&, int64_t, int64_t);
constexpr int64_t ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3, ISA_AVX512_BF16 = 4;

bool cpu_has_dp() {
#ifdef BATON_X86
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

// isa: 0 = best the CPU supports, 1 = scalar, 2 = AVX2+FMA, 4 = AVX512_BF16 (tests force each).
RowsFn pick(int64_t isa) {
  TORCH_CHECK(isa != ISA_AVX512, "gemv_bf16: no plain AVX-512F variant (2 = AVX2, 4 = AVX512_BF16)");
#ifdef BATON_X86
  static const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == ISA_AVX512_BF16) TORCH_CHECK(cpu_has_dp(), "gemv_bf16: this CPU has no AVX512_BF16");
  if (isa == ISA_AVX2) TORCH_CHECK(has2, "gemv_bf16: this CPU has no AVX2+FMA");
  if (isa == ISA_AVX512_BF16 || (isa == 0 && cpu_has_dp())) return rows_dp;
  if (isa == ISA_AVX2 || (isa == 0 && has2)) return rows_avx2;
#else
  TORCH_CHECK(isa <= ISA_SCALAR, "gemv_bf16: SIMD variants exist only on x86-64");
#endif
  return rows_scalar;
}

// x row b → fp32 planes: per chunk c, [x[32c + 2j], j < 16 | x[32c + 2j + 1], j < 16], 0-padded.
std::vector<float> planes(const ArgsB& a) {
  std::vector<float> xs(a.B * a.Kp, 0.0f);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t k = 0; k < a.K; ++k)
      xs[b * a.Kp + (k / CH) * CH + (k % 2) * 16 + (k % CH) / 2] = widen(a.x[b * a.ldx + k]);
  return xs;
}

}  // namespace

// x [B, K] bf16 (unit stride in K), w [O, K] bf16 contiguous, out [B, O] bf16 (unit inner stride).
void gemv_bf16_out(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "gemv_bf16: 2-D tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
              out.scalar_type() == at::kBFloat16, "gemv_bf16: bf16 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "gemv_bf16: CPU only");
  TORCH_CHECK(w.is_contiguous(), "gemv_bf16: w must be contiguous (out, in)");
  TORCH_CHECK(x.size(1) == w.size(1), "gemv_bf16: x and w disagree on in_features");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "gemv_bf16: out has the wrong shape");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "gemv_bf16: x and out need unit inner stride");
  const int64_t K = w.size(1);
  ArgsB a{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0),
          reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), K, nullptr,
          (K + CH - 1) / CH * CH, out.data_ptr<at::BFloat16>(), out.stride(0), x.size(0), w.size(0)};
  if (a.B == 0 || a.O == 0) return;
  RowsFn rows = pick(isa);
  std::vector<float> xs;
#ifdef BATON_X86
  if (rows == rows_avx2) { xs = planes(a); a.xs = xs.data(); }
#endif
  const int64_t tiles = (a.O + R - 1) / R;
  // >= ~256 KiB of weights per thread: below that a fork/join costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 17) / (R * std::max<int64_t>(K, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    rows(a, t0 * R, std::min(a.O, t1 * R));
  });
}

void register_gemv_bf16(pybind11::module& m) {
  m.def("gemv_bf16_out", &gemv_bf16_out, BATON_RELEASE_GIL,
        "out[B, O] = x[B, K] @ w[O, K].T (bf16, fp32 sums, CPU)");
  m.def("has_avx512_bf16", [] { return cpu_has_dp(); }, "whether the AVX512_BF16 GEMV runs here");
}
