// Decode attention scores of a bf16 cache with AVX512_BF16, for cpu_decode.cpp's AVX-512 path.
//
// scores_bf16: p[g·N + n] = (q_g · k_n)·scale for the G query heads of one KV head and the N
// context positions. q_g (fp32 holding bf16 values: the rotated q is rounded to bf16 as the
// torch path's) and k_n are multiplied as bf16 pairs by VDPBF16PS (exact products, fp32 sums),
// 16 positions at a time: 16 lane-partial vectors, then one transpose-and-add tree (unpack,
// 64-bit unpack, 128-bit shuffles) gives the 16 sums in one vector. A horizontal add per
// (position, head), which the AVX-512F loop pays, costs more than the dot product itself at
// D = 64. The order of every addition is fixed: a row's scores do not depend on the batch.
// pv64: the weighted sum of V at D = 64 (fp32 or bf16 cache) with its accumulators in registers.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cstdint>

#include "bf16.h"
#include "kv_pacer.h"

namespace baton {

// r[i] = Σ lanes of v[i], i < 16 (the tree described above).
__attribute__((target("avx512f"))) inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44),
                                  _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44),
                                  _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// rows[n] + hoff: position n's K head (D bf16); q: [G][D] fp32; D % 32 == 0, G <= 8.
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
inline void scores_bf16(const float* q, const bf16* const* rows, int64_t hoff, int64_t N, int64_t D,
                        int64_t G, float scale, float* p, KvPacer* pf = nullptr) {
  const int64_t C = D / 32;  // 32-element chunks: 16 bf16 pairs each
  __m512i qp[8][16];         // G <= 8, D <= 512
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c)
      qp[g][c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * D + 32 * c + 16),
                                             _mm512_loadu_ps(q + g * D + 32 * c));
  const __m512 sv = _mm512_set1_ps(scale);
  alignas(64) static const bf16 zeros[512] = {};  // past N: a zero K row, its score masked
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    const int64_t cnt = N - n0 < 16 ? N - n0 : 16;
    if (pf) pf->advance(cnt * pf->per_pos);
    const bf16* kr[16];
    for (int64_t j = 0; j < 16; ++j) kr[j] = j < cnt ? rows[n0 + j] + hoff : zeros;
    for (int64_t j = 0; j < 16 && n0 + 16 + j < N; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(rows[n0 + 16 + j] + hoff), _MM_HINT_T0);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];  // a constant trip count: the 16 accumulators stay in registers
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        const __m512bh qc = (__m512bh)qp[g][c];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], qc, (__m512bh)_mm512_loadu_si512(kr[j] + 32 * c));
      }
      const __m512 s = _mm512_mul_ps(hsum16(acc), sv);
      const __mmask16 m = cnt == 16 ? 0xFFFF : static_cast<__mmask16>((1u << cnt) - 1u);
      _mm512_mask_storeu_ps(p + g * N + n0, m, s);
    }
  }
}

// acc[g][c] += Σ_n p[g·N + n] · v_n[16c .. 16c + 15] for the G heads of one KV head, D = 64
// columns from rows[n] + voff (fp32 products and sums, positions in order): a template on G so
// the G·4 accumulators stay in registers (a runtime G kept them in memory, one store and one
// load per FMA).
template <int G, typename T>
__attribute__((target("avx512f"))) inline void pv64(const float* p, int64_t N, const T* const* rows,
                                                    int64_t voff, float* out /*[G][64]*/,
                                                    KvPacer* pf) {
  __m512 acc[G][4];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t n = 0; n < N; ++n) {
    if (n + 6 < N) _mm_prefetch(reinterpret_cast<const char*>(rows[n + 6] + voff), _MM_HINT_T0);
    if (pf) pf->advance(pf->per_pos);
    const T* v = rows[n] + voff;
    const __m512 v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 pn = _mm512_set1_ps(p[g * N + n]);
      acc[g][0] = _mm512_fmadd_ps(pn, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(pn, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(pn, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(pn, v3, acc[g][3]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * 64 + 16 * c, acc[g][c]);
}

// pv64 for a run-time G (1..8); false (nothing done) for another G.
template <typename T>
__attribute__((target("avx512f"))) inline bool pv64_any(int64_t G, const float* p, int64_t N,
                                                        const T* const* rows, int64_t voff,
                                                        float* out, KvPacer* pf = nullptr) {
  switch (G) {
    case 1: pv64<1>(p, N, rows, voff, out, pf); return true;
    case 2: pv64<2>(p, N, rows, voff, out, pf); return true;
    case 3: pv64<3>(p, N, rows, voff, out, pf); return true;
    case 4: pv64<4>(p, N, rows, voff, out, pf); return true;
    case 5: pv64<5>(p, N, rows, voff, out, pf); return true;
    case 6: pv64<6>(p, N, rows, voff, out, pf); return true;
    default: return false;
  }
}

}  // namespace baton
#endif
