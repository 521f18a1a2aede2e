// One 64-position tile of one KV head packed into the operand layout of VDPBF16PS, for the
// bf16 prefill attention (cpu_prefill.cpp):
//   K words kp[dp·64 + j] = (k_j[2dp], k_j[2dp+1])       d pairs × 64 keys
//   V words vp[m·D + d]  = (v_{2m}[d], v_{2m+1}[d])       32 key pairs × D
// k[j], v[j]: the K and V rows (D bf16 values each) of the tile's key j, nullptr past the
// sequence's end (its words are zero). pack_tile: word by word, any even D. pack_tile_avx512
// (D % 32 == 0, AVX-512F/BW): the same words by 16×16 word transposes (K) and 16-bit
// interleaves (V): at 4,000 positions the scalar pack was ~0.6 ms a layer on 2 threads, most
// of a short suffix's attention (an agent's next turn), the vector one ~0.2 (BENCHMARKS.md,
// stop 37).
#pragma once
#include <cstdint>
#include <cstring>

#include "isa.h"

#ifdef BATON_X86
#include <immintrin.h>
#endif

namespace baton {

constexpr int64_t PACK_KEYS = 64;  // positions per tile

inline void pack_tile(const uint16_t* const* k, const uint16_t* const* v, int64_t D,
                      uint32_t* kp, uint32_t* vp) {
  for (int64_t j = 0; j < PACK_KEYS; ++j) {
    uint16_t* vh = reinterpret_cast<uint16_t*>(vp + (j / 2) * D) + j % 2;
    if (k[j] == nullptr) {
      for (int64_t dp = 0; dp < D / 2; ++dp) kp[dp * PACK_KEYS + j] = 0;
      for (int64_t d = 0; d < D; ++d) vh[2 * d] = 0;
      continue;
    }
    for (int64_t dp = 0; dp < D / 2; ++dp) std::memcpy(&kp[dp * PACK_KEYS + j], k[j] + 2 * dp, 4);
    for (int64_t d = 0; d < D; ++d) vh[2 * d] = v[j][d];
  }
}

#ifdef BATON_X86
#define BATON_PACK_TARGET __attribute__((target("avx512f,avx512bw")))
// 16×16 32-bit transpose in registers: lane j of r[i] -> lane i of r[j].
BATON_PACK_TARGET inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g+3
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 4; ++k) t[4 * i + k] = r[4 * k + i];  // t[4c + g] = r[4g + c]
  for (int i = 0; i < 16; i += 4) {  // column c = i / 4: lane L of groups 0..3 -> row 4L + c
    const __m512i a = _mm512_shuffle_i32x4(t[i], t[i + 1], 0x88);      // lanes 0,2 | 0,2
    const __m512i b = _mm512_shuffle_i32x4(t[i], t[i + 1], 0xDD);      // lanes 1,3 | 1,3
    const __m512i c = _mm512_shuffle_i32x4(t[i + 2], t[i + 3], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(t[i + 2], t[i + 3], 0xDD);
    r[i / 4] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[i / 4 + 8] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[i / 4 + 4] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[i / 4 + 12] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

BATON_PACK_TARGET inline void pack_tile_avx512(const uint16_t* const* k,
                                               const uint16_t* const* v, int64_t D,
                                               uint32_t* kp, uint32_t* vp) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j0 = 0; j0 < PACK_KEYS; j0 += 16) {
    for (int64_t w0 = 0; w0 < D / 2; w0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = k[j0 + i] ? _mm512_loadu_si512(k[j0 + i] + 2 * w0) : zero;
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kp + (w0 + i) * PACK_KEYS + j0, r[i]);
    }
  }
  // unpack{lo,hi}_epi16 interleave within 128-bit lanes: lo holds d 0-3, 8-11, ... and hi
  // d 4-7, 12-15, ... of each 32; the permutes put the 64-bit pieces back in d order
  const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i hi_idx = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int64_t m = 0; m < PACK_KEYS / 2; ++m) {
    const uint16_t* v0 = v[2 * m];
    const uint16_t* v1 = v[2 * m + 1];
    uint32_t* dst = vp + m * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i x = v0 ? _mm512_loadu_si512(v0 + d) : zero;
      const __m512i y = v1 ? _mm512_loadu_si512(v1 + d) : zero;
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi64(lo, lo_idx, hi));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi64(lo, hi_idx, hi));
    }
  }
}
#endif

}  // namespace baton
