// e^x and 2^x on 16 fp32 lanes, and the max / sum of each of 4 vectors (AVX-512F), shared by
// cpu_decode.cpp, cpu_norm.cpp and cpu_prefill.cpp.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace {

// Cephes expf: x = n·ln2 + r, |r| <= ln2/2, degree-6 polynomial, times 2^n by scalef (~1 ulp);
// x clamped to [-104, 88] (e^-104 is below the smallest denormal, e^88 near FLT_MAX).
__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// 2^x: x = n + r, |r| <= 1/2, 2^r by its degree-6 Taylor polynomial (relative error < 2e-7 over
// the range), times 2^n by scalef (0 once x is below about −150). Not for NaN or ±inf.
__attribute__((target("avx512f"))) inline __m512 exp2_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^k / k!, k = 6 .. 0
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3333558146428443e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.618129107628477e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.550410866482158e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.402265069591007e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.931471805599453e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

template <bool kMax>
__attribute__((target("avx512f"))) inline __m512 max_or_add(__m512 a, __m512 b) {
  return kMax ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
}

// (f(v[0]), f(v[1]), f(v[2]), f(v[3])) for f the max (kMax) or the sum of a vector's 16 lanes, in
// one fixed order: one transpose-and-reduce tree for the four instead of four horizontal ones.
template <bool kMax>
__attribute__((target("avx512f"))) inline __m128 reduce4(const __m512* v) {
  const __m512 t0 = max_or_add<kMax>(_mm512_unpacklo_ps(v[0], v[1]),
                                     _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 t1 = max_or_add<kMax>(_mm512_unpacklo_ps(v[2], v[3]),
                                     _mm512_unpackhi_ps(v[2], v[3]));
  // per 128-bit block, partials (v0, v1, v0, v1) and (v2, v3, v2, v3) -> (v0, v1, v2, v3)
  __m512 t = max_or_add<kMax>(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  t = max_or_add<kMax>(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));  // blocks 0+2, 1+3
  t = max_or_add<kMax>(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));  // all four
  return _mm512_castps512_ps128(t);
}

}  // namespace
#endif
