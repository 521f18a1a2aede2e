// The AMX variant of cpu_prefill.cpp's work item (included by it after Args, Scratch and
// softmax4; kernels/cpu_prefill.py says when it runs). Same algorithm, tiles and rounding points
// as the AVX512_BF16 item (FlashAttention's online softmax over 64-key tiles from position 0),
// with q·k and p·v on Intel AMX (TDPBF16PS, Intel SDM vol. 2, "TDPBF16PS"; Intel Optimization
// Reference Manual, "Intel AMX"):
//   scores  S[16 rows, 64 keys]  = Q[16 rows, D] · Kᵀ        TDPBF16PS: A = 16 rows × 16 d pairs
//                                                             of q, B = 16 d pairs × 16 keys of
//                                                             the packed K tile, fp32 C
//   softmax4 on S, 4 rows at a time (cpu_prefill.cpp): m, l, α, bf16 p pairs
//   PV[16 rows, D]               = P[16 rows, 64 keys] · V    A = 16 rows × 16 key pairs of p,
//                                                             B = 16 key pairs × 16 d of V
//   o = fma(o, α, PV)            out = bf16(o / l)
// The packed K ([d pair][64 keys] words) and V ([key pair][D] words, kv_pack.h) are already the
// B operands' VNNI layout: no repacking. A row's result depends only on its own q and the K/V up
// to its position, in one fixed order (each C row is its own A row's dot products; the order of
// the d pairs and key pairs inside TDPBF16PS is fixed by the hardware), so chunking, thread
// count and the other rows change no bit, as for the AVX512_BF16 item. The bits differ from
// that item's (another summation order): one machine runs one variant in every process, chosen
// from its CPU flags (isa 0), so a prefill worker and a decode worker still write the same KV.
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

// One item (KV head h, query tokens [qt·a.qt, +a.qt)) in groups of 16 rows; the caller holds a
// TileScope on this thread. Set-up, order and output as cpu_prefill.cpp's item().
BATON_AMX_TARGET void item_amx(const Args& a, int64_t h, int64_t qt, Scratch& s) {
  const int64_t D = a.D, DP = D / 2;
  const ItemRows it = begin_item(a, h, qt, AR, s);
  const int64_t RA = it.RP;
  s.p.resize(AR * KW);
  s.alpha.resize(AR);
  s.scores.resize(AR * KT);
  s.pv.resize(AR * D);
  const __m512 sl2 = _mm512_set1_ps(a.scale * 1.4426950408889634f);  // scale·log2(e)
  for (int64_t t = 0; t < it.tiles; ++t) {
    const uint32_t* kt = it.kp + t * KT * DP;
    const uint32_t* vt = it.vp + t * KT * DP;
    const int64_t n0 = t * KT;
    for (int64_t r0 = 0; r0 < RA; r0 += AR) {
      const int64_t vis = s.last[r0 + AR - 1] - n0;  // the group's last visible key
      if (vis < 0) continue;  // no row of the group sees this tile
      // key vectors past it are masked for every row (softmax4): not computed
      const int64_t nk = std::min<int64_t>(4, vis / 16 + 1);
      tile_gemm(&s.q[r0 * DP], DP * 4, kt, KT * 4, DP / 16, nk);
      tile_store(s.scores.data(), KT * 4, nk);
      for (int64_t u0 = 0; u0 < AR; u0 += 4) {
        __m512 acc[4][4];
        for (int u = 0; u < 4; ++u)
          for (int c = 0; c < 4; ++c)
            acc[u][c] = c < nk ? _mm512_loadu_ps(&s.scores[(u0 + u) * KT + 16 * c])
                               : _mm512_setzero_ps();
        softmax4(s, r0 + u0, n0, acc, sl2, &s.p[u0 * KW], &s.alpha[u0]);
      }
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t nc = std::min<int64_t>(4, (D - d0) / 16);
        tile_gemm(s.p.data(), KW * 4, vt + d0, D * 4, KW / 16, nc);
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
