// Fused fp32 CPU element-wise ops of a decode layer (kernels/cpu_decode.py), each one native call
// where the torch path runs several ops (torch's CPU rms_norm alone is ~6 kernels):
//
// add_rms_norm_out: h += r in place (skipped when r is empty), then
//   y = (h · rsqrt(mean(h²) + eps)) · w, transformers' LlamaRMSNorm in fp32 (weight applied last);
//   mean(h²) is summed in 16 lanes (lane j: elements j, j+16, ...), lanes added in a fixed tree.
// silu_mul_out: y = silu(g) · u over gu [T, 2I] = [gate | up] columns, silu(g) = g / (1 + e^−g).
//
// ISA: AVX-512F (exp512 of simd_exp.h) when the CPU has it, a portable scalar loop (std::exp)
// otherwise; both give the same rms_norm bits (same per-lane order, no FMA contraction).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "isa.h"
#include "simd_exp.h"

namespace {

bool has_avx512(int64_t isa) { return baton::use_avx512(isa, "cpu_norm"); }

// Σ x² in 16 lanes, then the lanes summed as a tree (8+8, 4+4, 2+2, 1+1), scalar form.
float sumsq_scalar(const float* x, int64_t n) {
  float lane[16] = {0};
  for (int64_t i = 0; i < n; ++i) {
    const float sq = x[i] * x[i];
    lane[i % 16] += sq;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

#ifdef BATON_X86
__attribute__((target("avx512f"))) float sumsq_avx512(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
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

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "cpu_norm: ", name, " must be a contiguous fp32 CPU tensor");
}

}  // namespace

// h [T, H] (updated in place when r is non-empty), r [T, H] or empty, w [H], out [T, H].
void add_rms_norm_out(torch::Tensor& h, const torch::Tensor& r, const torch::Tensor& w, double eps,
                      torch::Tensor& out, int64_t isa) {
  check(h, "h"); check(w, "w"); check(out, "out");
  TORCH_CHECK(h.dim() == 2 && w.dim() == 1 && w.size(0) == h.size(1) && out.sizes() == h.sizes(),
              "cpu_norm: h [T, H], w [H], out [T, H] expected");
  const bool add = r.numel() > 0;
  if (add) { check(r, "r"); TORCH_CHECK(r.sizes() == h.sizes(), "cpu_norm: r must match h"); }
  const int64_t T = h.size(0), H = h.size(1);
  float* hp = h.data_ptr<float>();
  const float* rp = add ? r.data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool simd = has_avx512(isa);
  for (int64_t t = 0; t < T; ++t) {
    float* x = hp + t * H;
    if (add)
      for (int64_t i = 0; i < H; ++i) x[i] += rp[t * H + i];
#ifdef BATON_X86
    const float ss = simd ? sumsq_avx512(x, H) : sumsq_scalar(x, H);
#else
    const float ss = sumsq_scalar(x, H);
#endif
    const float rstd = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) {
      const float n = x[i] * rstd;
      op[t * H + i] = n * wp[i];
    }
  }
}

// gu [T, 2I] ([gate | up]), out [T, I].
void silu_mul_out(const torch::Tensor& gu, torch::Tensor& out, int64_t isa) {
  check(gu, "gu"); check(out, "out");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && out.dim() == 2 && out.size(0) == gu.size(0)
              && out.size(1) * 2 == gu.size(1), "cpu_norm: gu [T, 2I], out [T, I] expected");
  const int64_t T = gu.size(0), I = out.size(1);
  const float* g = gu.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const bool simd = has_avx512(isa);
  for (int64_t t = 0; t < T; ++t) {
#ifdef BATON_X86
    if (simd) { silu_mul_avx512(g + t * 2 * I, g + t * 2 * I + I, y + t * I, I); continue; }
#endif
    for (int64_t i = 0; i < I; ++i) {
      const float gv = g[t * 2 * I + i];
      y[t * I + i] = gv / (1.0f + std::exp(-gv)) * g[t * 2 * I + I + i];
    }
  }
}

void register_cpu_norm(pybind11::module& m) {
  m.def("add_rms_norm_out", &add_rms_norm_out, "h += r; out = rms_norm(h) * w (fp32 CPU)");
  m.def("silu_mul_out", &silu_mul_out, "out = silu(gate) * up (fp32 CPU)");
  m.def("has_avx512", [] { return has_avx512(0); }, "whether the AVX-512F variants run here");
}
