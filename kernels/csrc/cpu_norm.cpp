// Fused fp32 CPU element-wise ops of a decode layer (kernels/cpu_decode.py), each one native call
// where the torch path runs several ops (torch's CPU rms_norm alone is ~6 kernels):
//
// add_rms_norm_out: h += r in place (skipped when r is empty), then
//   y = (h · rsqrt(mean(h²) + eps)) · w, transformers' LlamaRMSNorm in fp32 (weight applied last);
//   mean(h²) is summed in 16 lanes (lane j: elements j, j+16, ...), lanes added in a fixed tree.
// silu_mul_out: y = silu(g) · u over gu [T, 2I] = [gate | up] columns, silu(g) = g / (1 + e^−g).
//
// bf16 (every tensor bf16): transformers' bf16 expressions, each torch op's rounding replayed
// (round_as, bf16.h): h + r rounded to bf16; mean(h²) in fp32; y = bf16(bf16(h·rstd)·w);
// silu: y = bf16(bf16(silu(g))·u).
// ISA: AVX-512F (exp512 of simd_exp.h) when the CPU has it, a portable scalar loop (std::exp)
// otherwise; both give the same rms_norm bits (same per-lane order, no FMA contraction).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"
#include "isa.h"
#include "release_gil.h"
#include "simd_exp.h"

namespace {

using baton::bf16;
using baton::round_as;

bool has_avx512(int64_t isa) { return baton::use_avx512(isa, "cpu_norm"); }

// Σ x² in 16 lanes, then the lanes summed as a tree (8+8, 4+4, 2+2, 1+1), scalar form.
template <typename T>
float sumsq_scalar(const T* x, int64_t n) {
  float lane[16] = {0};
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    const float sq = v * v;
    lane[i % 16] += sq;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

#ifdef BATON_X86
// 16 lanes of x from i on, zeros past n (bf16 has no 16-bit masked load in AVX-512F).
__attribute__((target("avx512f"))) inline __m512 load_tail(const float* x, int64_t i, int64_t n) {
  const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1u);
  return _mm512_maskz_loadu_ps(m, x + i);
}
__attribute__((target("avx512f"))) inline __m512 load_tail(const bf16* x, int64_t i, int64_t n) {
  if (n - i >= 16) return baton::load16(x + i);
  alignas(64) float buf[16] = {0};
  for (int64_t j = i; j < n; ++j) buf[j - i] = static_cast<float>(x[j]);
  return _mm512_load_ps(buf);
}

template <typename T>
__attribute__((target("avx512f"))) float sumsq_avx512(const T* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load_tail(x, i, n);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  alignas(64) float lane[16];
  _mm512_store_ps(lane, acc);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

__attribute__((target("avx512f"))) void silu_mul_avx512(const float* g, const float* u, float* y,
                                                       int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
  }
}
#endif

template <typename T>
void silu_mul_scalar(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gv = static_cast<float>(g[i]);
    const float s = round_as<T>(gv / (1.0f + std::exp(-gv)));
    y[i] = static_cast<T>(s * static_cast<float>(u[i]));
  }
}

#ifdef BATON_X86
__attribute__((target("avx512f"))) void silu_mul_avx512(const bf16* g, const bf16* u, bf16* y,
                                                       int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = baton::load16(g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = baton::round16<bf16>(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    baton::store16(y + i, _mm512_mul_ps(s, baton::load16(u + i)));
  }
  silu_mul_scalar(g + i, u + i, y + i, n - i);
}
#endif

// Every tensor of one call: a contiguous CPU tensor of h's (gu's) dtype, fp32 or bf16.
void check(const torch::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "cpu_norm: fp32 or bf16 only");
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous(),
              "cpu_norm: ", name, " must be a contiguous CPU tensor of one dtype, fp32 or bf16");
}

#ifdef BATON_X86
// One row of add_rms_norm_rows in AVX-512F: the same per-element operations (each rounding of
// the scalar loop replayed by round16/store16), 16 elements at a time, the tail scalar.
template <typename T>
__attribute__((target("avx512f"))) void add_rms_norm_row_avx512(T* x, const T* r, const T* w, T* o,
                                                               int64_t H, float eps) {
  const int64_t full = H / 16 * 16;
  if (r != nullptr) {
    for (int64_t i = 0; i < full; i += 16)
      baton::store16(x + i, _mm512_add_ps(baton::load16(x + i), baton::load16(r + i)));
    for (int64_t i = full; i < H; ++i)
      x[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(r[i]));
  }
  const float rstd = 1.0f / std::sqrt(sumsq_avx512(x, H) / static_cast<float>(H) + eps);
  const __m512 rv = _mm512_set1_ps(rstd);
  for (int64_t i = 0; i < full; i += 16)
    baton::store16(o + i, _mm512_mul_ps(baton::round16<T>(_mm512_mul_ps(baton::load16(x + i), rv)),
                                        baton::load16(w + i)));
  for (int64_t i = full; i < H; ++i) {
    const float n = round_as<T>(static_cast<float>(x[i]) * rstd);
    o[i] = static_cast<T>(n * static_cast<float>(w[i]));
  }
}
#endif

template <typename T>
void add_rms_norm_rows(T* hp, const T* rp, const T* wp, T* op, int64_t rows, int64_t H, float eps,
                       bool simd) {
  // rows split over threads (a prefill's rows; one row's result never depends on the split)
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
  for (int64_t t = r0; t < r1; ++t) {
    T* x = hp + t * H;
#ifdef BATON_X86
    if (simd) {
      add_rms_norm_row_avx512(x, rp == nullptr ? nullptr : rp + t * H, wp, op + t * H, H, eps);
      continue;
    }
#endif
    if (rp != nullptr)
      for (int64_t i = 0; i < H; ++i)
        x[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(rp[t * H + i]));
#ifdef BATON_X86
    const float ss = simd ? sumsq_avx512(x, H) : sumsq_scalar(x, H);
#else
    const float ss = sumsq_scalar(x, H);
#endif
    const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t i = 0; i < H; ++i) {
      const float n = round_as<T>(static_cast<float>(x[i]) * rstd);
      op[t * H + i] = static_cast<T>(n * static_cast<float>(wp[i]));
    }
  }
  });
}

template <typename T>
void silu_mul_rows(const T* g, T* y, int64_t rows, int64_t I, bool simd) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
#ifdef BATON_X86
      if (simd) { silu_mul_avx512(g + t * 2 * I, g + t * 2 * I + I, y + t * I, I); continue; }
#endif
      silu_mul_scalar(g + t * 2 * I, g + t * 2 * I + I, y + t * I, I);
    }
  });
}

}  // namespace

// h [T, H] (updated in place when r is non-empty), r [T, H] or empty, w [H], out [T, H].
void add_rms_norm_out(torch::Tensor& h, const torch::Tensor& r, const torch::Tensor& w, double eps,
                      torch::Tensor& out, int64_t isa) {
  const at::ScalarType dt = h.scalar_type();
  check(h, dt, "h"); check(w, dt, "w"); check(out, dt, "out");
  TORCH_CHECK(h.dim() == 2 && w.dim() == 1 && w.size(0) == h.size(1) && out.sizes() == h.sizes(),
              "cpu_norm: h [T, H], w [H], out [T, H] expected");
  const bool add = r.numel() > 0;
  if (add) { check(r, dt, "r"); TORCH_CHECK(r.sizes() == h.sizes(), "cpu_norm: r must match h"); }
  const bool simd = has_avx512(isa);
  const float e = static_cast<float>(eps);
  if (dt == at::kFloat)
    add_rms_norm_rows(h.data_ptr<float>(), add ? r.data_ptr<float>() : nullptr, w.data_ptr<float>(),
                      out.data_ptr<float>(), h.size(0), h.size(1), e, simd);
  else
    add_rms_norm_rows(h.data_ptr<bf16>(), add ? r.data_ptr<bf16>() : nullptr, w.data_ptr<bf16>(),
                      out.data_ptr<bf16>(), h.size(0), h.size(1), e, simd);
}

// gu [T, 2I] ([gate | up]), out [T, I].
void silu_mul_out(const torch::Tensor& gu, torch::Tensor& out, int64_t isa) {
  check(gu, gu.scalar_type(), "gu"); check(out, gu.scalar_type(), "out");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && out.dim() == 2 && out.size(0) == gu.size(0)
              && out.size(1) * 2 == gu.size(1), "cpu_norm: gu [T, 2I], out [T, I] expected");
  const bool simd = has_avx512(isa);
  if (gu.scalar_type() == at::kFloat)
    silu_mul_rows(gu.data_ptr<float>(), out.data_ptr<float>(), gu.size(0), out.size(1), simd);
  else
    silu_mul_rows(gu.data_ptr<bf16>(), out.data_ptr<bf16>(), gu.size(0), out.size(1), simd);
}

void register_cpu_norm(pybind11::module& m) {
  m.def("add_rms_norm_out", &add_rms_norm_out, BATON_RELEASE_GIL,
        "h += r; out = rms_norm(h) * w (fp32/bf16 CPU)");
  m.def("silu_mul_out", &silu_mul_out, BATON_RELEASE_GIL, "out = silu(gate) * up (fp32/bf16 CPU)");
  m.def("has_avx512", [] { return has_avx512(0); }, "whether the AVX-512F variants run here");
}
