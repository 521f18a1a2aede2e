// bf16 <-> fp32 for the native CPU ops, shared by gemv_bf16.cpp, cpu_decode.cpp and cpu_norm.cpp.
//
// bf16 is the top half of an fp32: widening is exact (shift left 16), narrowing rounds to nearest
// even as torch does (c10::BFloat16(float): round_to_nearest_even, NaN -> 0x7FC0). A torch bf16
// op computes in fp32 and rounds its result once, so `round_as<T>(v)` (v rounded to T and back,
// the identity for float) replays each rounding of a bf16 torch expression in fp32 code.
// The AVX-512F helpers widen 16 bf16 lanes (vpmovzxwd + shift) and narrow with the same
// round-to-nearest-even in integer arithmetic (not VCVTNEPS2BF16, which flushes subnormals).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace baton {

using bf16 = c10::BFloat16;

template <typename T>
inline float round_as(float v) { return static_cast<float>(T(v)); }
template <>
inline float round_as<float>(float v) { return v; }

#if defined(__x86_64__) || defined(_M_X64)
// 16 lanes of p (fp32 or bf16) as fp32.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// bf16 bits (in the low 16 of each 32-bit lane) of v rounded to nearest even, NaN -> 0x7FC0.
__attribute__((target("avx512f"))) inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

template <typename T>
__attribute__((target("avx512f"))) inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}
template <>
__attribute__((target("avx512f"))) inline __m512 round16<float>(__m512 v) { return v; }

// 16 fp32 lanes stored as T (bf16: rounded to nearest even).
__attribute__((target("avx512f"))) inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
__attribute__((target("avx512f"))) inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
#endif

}  // namespace baton
