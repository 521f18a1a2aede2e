// The AMX variant of cpu_prefill.cpp's work item (included by it after Args, Scratch and the
// online-softmax bookkeeping new_maxes / rescale_rows; kernels/cpu_prefill.py says when it runs).
// FlashAttention's online softmax as in the AVX512_BF16 item, with q·k and p·v on Intel AMX
// (TDPBF16PS, Intel SDM vol. 2, "TDPBF16PS"; Intel Optimization Reference Manual, "Intel AMX"),
// over blocks of TB = 4 key tiles (256 keys, aligned at position 0) instead of one:
//   scores  S[16 rows, 256 keys] = Q[16 rows, D] · Kᵀ        per 64-key tile, TDPBF16PS: A = 16
//                                                             rows × 16 d pairs of q, B = 16 d
//                                                             pairs × 16 keys of the packed K
//                                                             tile, fp32 C
//   softmax_block on S, 4 rows at a time: m, l, α once a block, bf16 p pairs
//   PV[16 rows, D]               = P[16 rows, 256 keys] · V  A = 16 rows × 16 key pairs of p,
//                                                             B = 16 key pairs × 16 d of V, the
//                                                             C tiles summing the whole block
//   o = fma(o, α, PV)            out = bf16(o / l)
// p = 2^(x − m) by a degree-3 polynomial (exp2_p, relative error < 7.8e-5: p is rounded to
// bf16 next, a relative step of 2^-8). Against one 64-key tile a step (the first version): a
// 1,000-token layer (9 heads, 3 KV heads, D = 64) on two cores of an AMX Xeon 2.18-2.32 ->
// 1.84-1.92 ms, one core 4.25-4.37 -> 3.45-3.94 (BENCHMARKS.md, sixteenth pass).
// The packed K ([d pair][64 keys] words) and V ([key pair][D] words, kv_pack.h) are already the
// B operands' VNNI layout, and a head's tiles are contiguous: no repacking. A row's result
// depends only on its own q and the K/V up to its position, in one fixed order (blocks from
// position 0; each C row is its own A row's dot products; the order of the d pairs and key
// pairs inside TDPBF16PS is fixed by the hardware; keys past a row's position add p = 0), so
// chunking, thread count and the other rows change no bit, as for the AVX512_BF16 item. The
// bits differ from that item's (another summation order and exp): one machine runs one variant
// in every process, chosen from its CPU flags (isa 0), so a prefill worker and a decode worker
// still write the same KV.
// Needs D % 32 == 0 (a tile row is 32 bf16); the caller takes the AVX512_BF16 item otherwise.
#pragma once
#ifdef BATON_X86
#include "amx.h"

namespace {

using baton_amx::TileScope;
constexpr int64_t AR = 16;  // rows per AMX tile

// C tiles 0..nc−1 (16 columns each) = Σ over ks 32-element steps of A(a + step·16 words, row
// stride lda bytes) · B(b + step·16 rows·ldb, row stride ldb bytes, columns 16c words on).
BATON_AMX_TARGET inline void tile_gemm(const uint32_t* a, int64_t lda, const uint32_t* b,
                                       int64_t ldb, int64_t ks, int64_t nc) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t k = 0; k < ks; ++k) {
    _tile_loadd(4, a + k * 16, lda);
    const uint32_t* bk = b + k * 16 * (ldb / 4);
    _tile_loadd(5, bk, ldb); _tile_dpbf16ps(0, 4, 5);
    if (nc > 1) { _tile_loadd(5, bk + 16, ldb); _tile_dpbf16ps(1, 4, 5); }
    if (nc > 2) { _tile_loadd(5, bk + 32, ldb); _tile_dpbf16ps(2, 4, 5); }
    if (nc > 3) { _tile_loadd(5, bk + 48, ldb); _tile_dpbf16ps(3, 4, 5); }
  }
}

BATON_AMX_TARGET inline void tile_store(float* c, int64_t ldc, int64_t nc) {
  _tile_stored(0, c, ldc);
  if (nc > 1) _tile_stored(1, c + 16, ldc);
  if (nc > 2) _tile_stored(2, c + 32, ldc);
  if (nc > 3) _tile_stored(3, c + 48, ldc);
}

constexpr int64_t TB = 4;         // key tiles per softmax block
constexpr int64_t BK = TB * KT;   // keys per block (256)
constexpr int64_t BW = BK / 2;    // p words (bf16 pairs) of one row per block

// 2^x for the softmax's p, which is rounded to bf16 (relative step 2^-8) before p·v: x = n + r,
// |r| <= 1/2, 2^r by a degree-3 polynomial fitted for relative error (< 7.8e-5 over the
// range, against simd_exp.h's degree 6 at < 2e-7), times 2^n by scalef. Not for NaN or ±inf.
BATON_AMX_TARGET inline __m512 exp2_p(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(5.5088767033e-2f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.4260465591e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.9327628333e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.9992890482e-1f));
  return _mm512_scalef_ps(y, n);
}

// The lanes of key vector c (keys 16c + lane of the block) at or before lim (a row's last
// visible key, every lane).
BATON_AMX_TARGET inline __mmask16 seen(__m512i lim, int64_t c) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_cmple_epi32_mask(
      _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(16 * c))), lim);
}

// The online-softmax step of rows r0..r0+3 over one block of keys from n0: scores sc (row u at
// sc + u·BK, keys n0 + 16c + lane for vectors c < nv; later vectors and keys past a row's last
// position count as −inf). Updates s.m and s.l, writes each row's α to alpha[u] and its bf16 p
// pairs to p_out[u·BW ..] (word m = keys 2m, 2m + 1; words up to 16·ceil(nv / 2), 0 past nv).
BATON_AMX_TARGET inline void softmax_block(Scratch& s, int64_t r0, int64_t n0, const float* sc,
                                           int64_t nv, __m512 sl2, uint32_t* p_out,
                                           float* alpha) {
  int64_t vis[4];
  __m512i lim[4];
  __m512 mx[4];
  for (int u = 0; u < 4; ++u) {
    vis[u] = s.last[r0 + u] - n0;  // the row's last visible key of the block (may be < 0)
    lim[u] = _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(vis[u], -1, BK)));
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < nv; ++c) {
      const __m512 v = _mm512_loadu_ps(sc + u * BK + 16 * c);
      m = 16 * c + 15 <= vis[u] ? _mm512_max_ps(m, v)
                                : _mm512_mask_max_ps(m, seen(lim[u], c), m, v);
    }
    mx[u] = m;
  }
  float mn[4];
  new_maxes(s, r0, mx, sl2, mn);
  __m512 ps[4];
  for (int u = 0; u < 4; ++u) {
    const __m512 mv = _mm512_set1_ps(mn[u]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < nv; c += 2) {
      __m512 p[2];
      for (int j = 0; j < 2; ++j) {
        const int64_t cj = c + j;
        if (cj >= nv || 16 * cj > vis[u]) { p[j] = _mm512_setzero_ps(); continue; }
        p[j] = exp2_p(_mm512_fmsub_ps(_mm512_loadu_ps(sc + u * BK + 16 * cj), sl2, mv));
        if (16 * cj + 15 > vis[u]) p[j] = _mm512_maskz_mov_ps(seen(lim[u], cj), p[j]);
      }
      sum = _mm512_add_ps(sum, _mm512_add_ps(p[0], p[1]));
      _mm512_storeu_si512(&p_out[u * BW + 8 * c], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    }
    ps[u] = sum;
  }
  rescale_rows(s, r0, mn, ps, alpha);
}

// One item (KV head h, query tokens [qt·a.qt, +a.qt)) in groups of 16 rows; the caller holds a
// TileScope on this thread. Set-up and output as cpu_prefill.cpp's item(); the softmax runs
// over blocks of TB key tiles (one max, one o update a block; p·v summed in the C tiles over
// the whole block).
BATON_AMX_TARGET void item_amx(const Args& a, int64_t h, int64_t qt, Scratch& s) {
  const int64_t D = a.D, DP = D / 2;
  const ItemRows it = begin_item(a, h, qt, AR, s);
  const int64_t RA = it.RP;
  s.p.resize(AR * BW);
  s.alpha.resize(AR);
  s.scores.resize(AR * BK);
  s.pv.resize(AR * D);
  const __m512 sl2 = _mm512_set1_ps(a.scale * 1.4426950408889634f);  // scale·log2(e)
  for (int64_t t0 = 0; t0 < it.tiles; t0 += TB) {
    const uint32_t* kb = it.kp + t0 * KT * DP;
    const uint32_t* vb = it.vp + t0 * KT * DP;
    const int64_t n0 = t0 * KT;
    for (int64_t r0 = 0; r0 < RA; r0 += AR) {
      const int64_t vis = s.last[r0 + AR - 1] - n0;  // the group's last visible key
      if (vis < 0) continue;  // no row of the group sees this block
      // key vectors past it are masked for every row: not computed
      const int64_t nv = std::min<int64_t>(4 * TB, vis / 16 + 1);
      for (int64_t j = 0; 4 * j < nv; ++j) {
        const int64_t nk = std::min<int64_t>(4, nv - 4 * j);
        tile_gemm(&s.q[r0 * DP], DP * 4, kb + j * KT * DP, KT * 4, DP / 16, nk);
        tile_store(s.scores.data() + j * KT, BK * 4, nk);
      }
      for (int64_t u0 = 0; u0 < AR; u0 += 4)
        softmax_block(s, r0 + u0, n0, &s.scores[u0 * BK], nv, sl2, &s.p[u0 * BW], &s.alpha[u0]);
      const int64_t ks = (nv + 1) / 2;  // 32 keys a step: the words softmax_block wrote
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t nc = std::min<int64_t>(4, (D - d0) / 16);
        tile_gemm(s.p.data(), BW * 4, vb + d0, D * 4, ks, nc);
        tile_store(s.pv.data() + d0, D * 4, nc);
      }
      for (int64_t u = 0; u < AR; ++u) {
        const __m512 av = _mm512_set1_ps(s.alpha[u]);
        float* o = &s.o[(r0 + u) * D];
        const float* pv = &s.pv[u * D];
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), av,
                                                  _mm512_loadu_ps(pv + d)));
      }
    }
  }
  finish_item(a, h, it, s);
}

}  // namespace
#endif
