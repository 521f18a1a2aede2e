// Small-batch fp32 GEMV for CPU decode: y[b, o] = sum_k x[b, k] * w[o, k].
//
// Layout: w is (out, in) row-major and contiguous, so each output is one contiguous dot product
// (the layout ggml's CPU backend streams for f32: ggml_vec_dot_f32 over a row of src0).
// Vectorisation (after ggml_vec_dot_f32, GGML_F32_STEP/GGML_F32_EPR): a tile of R = 4 weight
// rows is walked once along k; every weight vector loaded is multiplied into BT rows of x, giving
// R*BT independent FMA accumulators (BT <= 3 on AVX2's 16 ymm registers, two vectors per step;
// BT <= 4 on AVX-512's 32 zmm; for 5+ rows of x AVX-512 takes tiles of 3 weight rows x 8 x-rows
// instead, see batch8_avx512), reduced horizontally at the end. The k tail (in % lanes) uses
// masked loads. A tile's 4 rows come from 4 distant quarters of the thread's row range (4
// sequential memory streams), and each tile prefetches the next one's lines while it computes.
// Batch reuse: all B rows of x are applied to a weight tile (BT at a time) before the next tile,
// so the tile (R*in*4 bytes, <= 24 KiB here) is read from memory once and re-read from L1.
// Threading: at::parallel_for over row ranges; each thread gets one contiguous range of rows.
// ISA: one build; AVX-512 / AVX2+FMA variants are compiled with target attributes and chosen at
// run time by __builtin_cpu_supports; a scalar loop covers every other CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "release_gil.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BATON_X86 1
#endif

namespace {

constexpr int R = 4;  // weight rows per tile

struct Args {
  const float* x; int64_t ldx;   // [B, K], row stride ldx
  const float* w; int64_t K;     // [O, K] contiguous
  float* y; int64_t ldy;         // [B, O], row stride ldy
  int64_t B, O;
};

// ---- scalar fallback ------------------------------------------------------------------------
void rows_scalar(const Args& a, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* w = a.w + o * a.K;
    for (int64_t b = 0; b < a.B; ++b) {
      const float* x = a.x + b * a.ldx;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= a.K; k += 8)
        for (int j = 0; j < 8; ++j) acc[j] += w[k + j] * x[k + j];
      for (; k < a.K; ++k) acc[k & 7] += w[k] * x[k];
      float s = 0;
      for (int j = 0; j < 8; ++j) s += acc[j];
      a.y[b * a.ldy + o] = s;
    }
  }
}

#ifdef BATON_X86
// ---- AVX2 + FMA -----------------------------------------------------------------------------
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A tile is NR weight rows o, o + step, ..., o + (NR-1)*step times BT rows of x starting at b.
// pf != 0: also prefetch the rows pf rows further on (the next tile), one cache line per row
// per 64 bytes of k, so the next tile's memory reads overlap this tile's FMAs.
struct Tile { int64_t o, step, pf; };

template <int NR, int BT>
__attribute__((target("avx2,fma"))) void tile_avx2(const Args& a, Tile tl, int64_t b) {
  __m256 acc[NR][BT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t) acc[r][t] = _mm256_setzero_ps();
  const float* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = a.w + (tl.o + r * tl.step) * a.K;
  const float* x = a.x + b * a.ldx;
  const int64_t pf = tl.pf * a.K;
  int64_t k = 0;
  for (; k + 16 <= a.K; k += 16) {
    for (int r = 0; r < NR; ++r) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(w[r] + pf + k), _MM_HINT_T0);
      __m256 w0 = _mm256_loadu_ps(w[r] + k), w1 = _mm256_loadu_ps(w[r] + k + 8);
      for (int t = 0; t < BT; ++t) {
        acc[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * a.ldx + k), acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * a.ldx + k + 8), acc[r][t]);
      }
    }
  }
  for (; k < a.K; k += 8) {
    alignas(32) int32_t m[8];
    for (int j = 0; j < 8; ++j) m[j] = (k + j < a.K) ? -1 : 0;
    __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
    for (int r = 0; r < NR; ++r) {
      __m256 wv = _mm256_maskload_ps(w[r] + k, mask);
      for (int t = 0; t < BT; ++t)
        acc[r][t] = _mm256_fmadd_ps(wv, _mm256_maskload_ps(x + t * a.ldx + k, mask), acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t) a.y[(b + t) * a.ldy + tl.o + r * tl.step] = hsum256(acc[r][t]);
}

// ---- AVX-512F -------------------------------------------------------------------------------
template <int NR, int BT>
__attribute__((target("avx512f"))) void tile_avx512(const Args& a, Tile tl, int64_t b) {
  __m512 acc[NR][BT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t) acc[r][t] = _mm512_setzero_ps();
  const float* w[NR];
  for (int r = 0; r < NR; ++r) w[r] = a.w + (tl.o + r * tl.step) * a.K;
  const float* x = a.x + b * a.ldx;
  const int64_t pf = tl.pf * a.K;
  int64_t k = 0;
  for (; k + 16 <= a.K; k += 16) {
    for (int r = 0; r < NR; ++r) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(w[r] + pf + k), _MM_HINT_T0);
      __m512 wv = _mm512_loadu_ps(w[r] + k);
      for (int t = 0; t < BT; ++t)
        acc[r][t] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + t * a.ldx + k), acc[r][t]);
    }
  }
  if (k < a.K) {
    __mmask16 mask = static_cast<__mmask16>((1u << (a.K - k)) - 1u);
    for (int r = 0; r < NR; ++r) {
      __m512 wv = _mm512_maskz_loadu_ps(mask, w[r] + k);
      for (int t = 0; t < BT; ++t)
        acc[r][t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + t * a.ldx + k), acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < BT; ++t)
      a.y[(b + t) * a.ldy + tl.o + r * tl.step] = _mm512_reduce_add_ps(acc[r][t]);
}

// All B rows of x against one tile: BT rows at a time (MAXBT = what the registers hold); only
// the first pass prefetches, later passes find the tile in L1.
template <int NR, int MAXBT, void (*T1)(const Args&, Tile, int64_t),
          void (*T2)(const Args&, Tile, int64_t), void (*T3)(const Args&, Tile, int64_t),
          void (*T4)(const Args&, Tile, int64_t)>
inline void batch(const Args& a, Tile tl) {
  int64_t b = 0;
  for (; b + MAXBT <= a.B; b += MAXBT, tl.pf = 0) (MAXBT == 4 ? T4 : T3)(a, tl, b);
  switch (a.B - b) {
    case 3: T3(a, tl, b); break;
    case 2: T2(a, tl, b); break;
    case 1: T1(a, tl, b); break;
    default: break;
  }
}

// Rows [o0, o1) of one thread, cut into NR parts walked side by side: tile i holds rows
// o0 + i + j*q (j < NR), so the thread reads NR distant sequential streams (measured here: more
// bandwidth than NR adjacent rows, which the prefetchers see as one stream); each tile
// prefetches the next (the same rows + 1). The rows left over (n % NR) go one at a time.
template <int NR, void (*BATCH_R)(const Args&, Tile), void (*BATCH_1)(const Args&, Tile)>
inline void rows_generic(const Args& a, int64_t o0, int64_t o1) {
  const int64_t q = (o1 - o0) / NR;
  for (int64_t i = 0; i < q; ++i) BATCH_R(a, Tile{o0 + i, q, i + 1 < q ? 1 : 0});
  for (int64_t o = o0 + q * NR; o < o1; ++o) BATCH_1(a, Tile{o, 1, 0});
}

template <int NR>
__attribute__((target("avx2,fma"))) void batch_avx2(const Args& a, Tile tl) {
  batch<NR, 3, tile_avx2<NR, 1>, tile_avx2<NR, 2>, tile_avx2<NR, 3>, tile_avx2<NR, 3>>(a, tl);
}
__attribute__((target("avx2,fma"))) void rows_avx2(const Args& a, int64_t o0, int64_t o1) {
  rows_generic<R, batch_avx2<R>, batch_avx2<1>>(a, o0, o1);
}

template <int NR>
__attribute__((target("avx512f"))) void batch_avx512(const Args& a, Tile tl) {
  batch<NR, 4, tile_avx512<NR, 1>, tile_avx512<NR, 2>, tile_avx512<NR, 3>, tile_avx512<NR, 4>>(a, tl);
}
// 5..16 rows of x: tiles of 3 weight rows x up to 8 rows of x (24 zmm accumulators, x read
// as the FMAs' memory operand) in one pass, so each tile is walked once for 8 rows instead of
// twice for 2 x 4: the weight reads then overlap the FMAs better (DRAM, one thread, B = 8:
// 14.1-15.6 GB/s against 12.1-14.1 for 4 x 4 in two passes; BENCHMARKS.md). Each output's
// sum runs in the same order either way, so the results are bit-identical.
template <int NR>
__attribute__((target("avx512f"))) void batch8_avx512(const Args& a, Tile tl) {
  int64_t b = 0;
  for (; b + 8 <= a.B; b += 8, tl.pf = 0) tile_avx512<NR, 8>(a, tl, b);
  switch (a.B - b) {
    case 7: tile_avx512<NR, 7>(a, tl, b); break;
    case 6: tile_avx512<NR, 6>(a, tl, b); break;
    case 5: tile_avx512<NR, 5>(a, tl, b); break;
    case 4: tile_avx512<NR, 4>(a, tl, b); break;
    case 3: tile_avx512<NR, 3>(a, tl, b); break;
    case 2: tile_avx512<NR, 2>(a, tl, b); break;
    case 1: tile_avx512<NR, 1>(a, tl, b); break;
    default: break;
  }
}
__attribute__((target("avx512f"))) void rows_avx512(const Args& a, int64_t o0, int64_t o1) {
  if (a.B >= 5)
    rows_generic<3, batch8_avx512<3>, batch8_avx512<1>>(a, o0, o1);
  else
    rows_generic<R, batch_avx512<R>, batch_avx512<1>>(a, o0, o1);
}
#endif  // BATON_X86

using RowsFn = void (*)(const Args&, int64_t, int64_t);

// isa: 0 = best the CPU supports, 1 = scalar, 2 = AVX2+FMA, 3 = AVX-512F (tests force each).
RowsFn pick(int64_t isa) {
#ifdef BATON_X86
  static const bool has512 = __builtin_cpu_supports("avx512f");
  static const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 3) TORCH_CHECK(has512, "gemv: this CPU has no AVX-512F");
  if (isa == 2) TORCH_CHECK(has2, "gemv: this CPU has no AVX2+FMA");
  if (isa == 3 || (isa == 0 && has512)) return rows_avx512;
  if (isa == 2 || (isa == 0 && has2)) return rows_avx2;
#else
  TORCH_CHECK(isa <= 1, "gemv: SIMD variants exist only on x86-64");
#endif
  return rows_scalar;
}

}  // namespace

// x [B, K] fp32 (unit stride in K), w [O, K] fp32 contiguous, out [B, O] fp32 (unit stride in O).
void gemv_out(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "gemv: 2-D tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
              out.scalar_type() == at::kFloat, "gemv: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "gemv: CPU only");
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous (out, in)");
  TORCH_CHECK(x.size(1) == w.size(1), "gemv: x and w disagree on in_features");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "gemv: out has the wrong shape");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "gemv: x and out need unit inner stride");
  Args a{x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.size(1),
         out.data_ptr<float>(), out.stride(0), x.size(0), w.size(0)};
  if (a.B == 0 || a.O == 0) return;
  RowsFn rows = pick(isa);
  const int64_t tiles = (a.O + R - 1) / R;
  // >= ~256 KiB of weights per thread: below that a fork/join costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (R * std::max<int64_t>(a.K, 1)));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    rows(a, t0 * R, std::min(a.O, t1 * R));
  });
}

void register_gemv_bf16(pybind11::module& m);   // gemv_bf16.cpp
void register_gemv_amx(pybind11::module& m);    // gemv_amx.cpp
void register_gemm_amx(pybind11::module& m);    // gemm_amx.cpp
void register_cpu_decode(pybind11::module& m);  // cpu_decode.cpp
void register_cpu_norm(pybind11::module& m);    // cpu_norm.cpp
void register_cpu_verify(pybind11::module& m);  // cpu_verify.cpp
void register_cpu_prefill(pybind11::module& m); // cpu_prefill.cpp
void register_cpu_sample(pybind11::module& m);  // cpu_sample.cpp
void register_cpu_rope(pybind11::module& m);    // cpu_rope.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_out", &gemv_out, BATON_RELEASE_GIL, "out[B, O] = x[B, K] @ w[O, K].T (fp32, CPU)");
  register_gemv_bf16(m);
  register_gemv_amx(m);
  register_gemm_amx(m);
  register_cpu_decode(m);
  register_cpu_norm(m);
  register_cpu_verify(m);
  register_cpu_sample(m);
  register_cpu_prefill(m);
  register_cpu_rope(m);
}
